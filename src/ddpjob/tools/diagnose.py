"""``ddpjob diagnose RUN_DIR``: one verdict on a stuck or failed job, from the ranks' traces.

It reads what each rank wrote to RUN_DIR/traces/ (see train/traces.py): the flight recorder's record of
the default process group's collectives, the rank's Python stacks and where it ran. A collective
that some ranks entered and others did not names the culprits:

    rank 1 (node-b) never entered gloo:all_reduce #1842, which ranks 0, 2-7 are waiting in;
    its last stack: File "task.py", line 40 in forward ...

A rank with no trace is named as such: stopped (SIGSTOP), dead, or killed before it could write.
The flight-recorder files are pickles: they are read by an unpickler that builds only plain
containers, so a crafted file cannot run code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpjob.errors import UsageError
from ddpjob.train.metrics import read_records

DEFAULT_GROUP = "0"


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a flight-recorder dump")


@dataclass
class RankTrace:
    rank: int
    host: str
    step: int
    why: str
    entered: int = -1  # last collective sequence number it enqueued (entered) in the default group
    completed: int = -1  # last one it finished
    names: dict[int, str] = field(default_factory=dict)  # sequence number -> collective name
    stack: list[str] = field(default_factory=list)  # the main thread's frames, innermost first


def load(folder: Path) -> dict[int, RankTrace]:
    """Every rank's trace that can be read whole (an unreadable one counts as no trace)."""
    traces = {}
    for meta_path in sorted(folder.glob("meta_*.json")):
        try:
            traces[int(meta_path.stem.split("_")[1])] = _load_rank(folder, json.loads(meta_path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError):
            continue
    return traces


def _load_rank(folder: Path, meta: dict[str, Any]) -> RankTrace:
    rank = int(meta["rank"])
    trace = RankTrace(rank, str(meta.get("host", "?")), int(meta.get("step", -1)), str(meta.get("why", "")))
    for name in (f"rank_{rank}", f"nccl_rank_{rank}"):  # ddpjob's dump, or NCCL's own on a timeout
        records = folder / name
        if records.is_file():
            dump = _PlainUnpickler(io.BytesIO(records.read_bytes())).load()
            status = dump.get("pg_status", {}).get(DEFAULT_GROUP, {})
            trace.entered = int(status.get("last_enqueued_collective", -1))
            trace.completed = int(status.get("last_completed_collective", -1))
            for entry in dump.get("entries", []):
                if str(entry.get("process_group", ("",))[0]) == DEFAULT_GROUP and not entry.get("is_p2p"):
                    trace.names[int(entry["collective_seq_id"])] = str(entry["profiling_name"])
            break
    stack = folder / f"stack_{rank}.txt"
    if stack.is_file():
        trace.stack = main_stack(stack.read_text(), meta.get("main_thread"))
    return trace


def main_stack(text: str, thread_id: int | None) -> list[str]:
    """The main thread's frames from a faulthandler dump ('File "x.py", line 3 in f'), innermost first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    wanted = f"0x{thread_id:016x}" if thread_id is not None else ""
    for block in blocks:
        if wanted and wanted in block.splitlines()[0]:
            return [line.strip() for line in block.splitlines()[1:] if line.strip().startswith("File")]
    return []


def ranks_text(ranks: list[int]) -> str:
    """[0, 2, 3, 4, 7] -> '0, 2-4, 7'."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def verdict(traces: dict[int, RankTrace], world_size: int) -> str:
    if not traces:
        raise UsageError(
            "no traces in RUN_DIR/traces; they are written when a rank makes no progress for "
            "--trace-after seconds or a collective fails: run the job with that on"
        )
    traces = {r: t for r, t in traces.items() if r < world_size}  # not a larger earlier attempt's
    silent = sorted(set(range(world_size)) - set(traces))
    quiet = f"rank(s) {ranks_text(silent)} wrote no trace (stopped, e.g. SIGSTOP, dead, or killed before they could)"
    top = max((t.entered for t in traces.values()), default=-1)
    waiting = sorted(r for r, t in traces.items() if t.entered == top and t.completed < top)
    behind = sorted(r for r, t in traces.items() if t.entered < top)
    if not waiting:
        why = next((f"; the traces were written because: {t.why}" for t in traces.values() if t.why), "")
        done = f"no rank is waiting in a collective: every rank that wrote a trace finished collective #{top}{why}"
        done = "\n".join([done, *_stuck_in(traces)])
        return f"{quiet} and are the likely cause\n{done}" if silent else done
    name = next((traces[r].names[top] for r in waiting if top in traces[r].names), "a collective")
    where = f"{name} #{top}, which rank(s) {ranks_text(waiting)} ({_hosts(traces, waiting)}) are waiting in"
    lines = []
    for rank in behind:
        trace = traces[rank]
        last = f"; its last stack: {' <- '.join(trace.stack[:3])}" if trace.stack else ""
        lines.append(f"rank {rank} ({trace.host}) never entered {where}{last}")
    if silent:
        lines.append(f"{quiet} and are the likely cause: {where}; their logs and hosts say more")
    if not lines:
        lines.append(f"every rank entered {where}: the collective itself is stuck (network, or a peer's transport)")
    return "\n".join(lines)


def _stuck_in(traces: dict[int, RankTrace]) -> list[str]:
    """Where the ranks are, outside any collective: one line per distinct stack."""
    by_stack: dict[tuple[str, ...], list[int]] = {}
    for rank, trace in sorted(traces.items()):
        if trace.stack:
            by_stack.setdefault(tuple(trace.stack[:3]), []).append(rank)
    return [
        f"rank(s) {ranks_text(ranks)} ({_hosts(traces, ranks)}) are in: {' <- '.join(stack)}"
        for stack, ranks in by_stack.items()
    ]


def _hosts(traces: dict[int, RankTrace], ranks: list[int]) -> str:
    return ", ".join(sorted({traces[r].host for r in ranks}))


def diagnose(run_dir: Path, world_size: int | None = None) -> str:
    folder = run_dir / "traces"
    if not folder.is_dir():
        raise UsageError(f"{folder} does not exist; point ddpjob diagnose at the job's --run-dir")
    traces = load(folder)
    size = world_size or _world_size(run_dir) or (max(traces, default=-1) + 1)
    return verdict(traces, size)


def _world_size(run_dir: Path) -> int:
    """The world size of the job's newest start, from metrics.jsonl (0 if unknown)."""
    path = run_dir / "metrics.jsonl"
    starts = [r for r in read_records(path, "diagnose") if r.get("event") == "start"] if path.is_file() else []
    return int(starts[-1].get("world_size", 0)) if starts else 0
