"""Elastic membership changes: seconds from a node's death to the first step at the smaller world
size (shrink), and from a node joining to the first step at the larger one (grow).

Two `ddpjob launch` agents on this host, --nnodes 1:2, c10d rendezvous on 127.0.0.1 (node 0 hosts
the store), one worker each (gloo), --max-restarts 3, --elastic-wait (torch's last_call_timeout),
the synthetic MLP (--width), a checkpoint every --save-every steps, --stop-check-every 1.
- shrink: both nodes train; at time T node 1 dies: SIGKILL to its agent and its worker at once, as
  when a machine goes away (the agent alone would leave its worker up to 1 s longer: ddpjob's
  parent watch polls once a second). Node 0 goes on alone.
- grow: node 0 trains alone; at time T node 1's agent is started. The group restarts at 2.
Each change is split, from RUN_DIR/metrics.jsonl (global rank 0's records), the agents' logs
(LOGLEVEL=INFO: ms timestamps) and the c10d rendezvous state in node 0's store (read every 0.2 s):
  detection        T -> the old generation's "end" record (shrink: its collective failed;
                   grow: it checkpointed and stopped for the restart)
  re-rendezvous    -> the new worker process started ("process_started" of the new "start" record)
  worker start     -> its process group is up ("group_joined"): python + torch, data, process group
  checkpoint load  -> the new "start" record: newest checkpoint chosen, verified, loaded, DDP built
  first step       -> the first "train" record at the new size
The parts add up to the total. A second table splits detection and re-rendezvous further. When
global rank 0 was on the node that died there is no "end" record: detection is then measured up
to the survivor's agent starting its rendezvous (it includes the old worker's exit) and says so.
The runs are stopped with SIGTERM once the first step at the new size is in (workers checkpoint
and exit 75). Medians of --repeats.
    python bench/elastic.py [--repeats 3] [--elastic-wait 2] [--width 1024] [--save-every 20]
"""

import argparse
import base64
import contextlib
import inspect
import io
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
from common import PY, env, free_port, median, table
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from ddpjob.launch.rendezvous_watch import _StateUnpickler  # builds inert records only
from ddpjob.plugins import synthetic_mlp

RDZV_ID = "ddpjob"  # launch's default --rdzv-id
SENTINEL = b"Y2FuaW1hZGFt"  # what the c10d backend stores before the first node writes
SAMPLES = 16384  # 256 steps of 64 per epoch
LOG_LINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) +\d+ \S+\] (.*)$", re.MULTILINE)


def agent(work: Path, port: int, rank: int, a: argparse.Namespace) -> subprocess.Popen[bytes]:
    """One node: `ddpjob launch` with its output in work/node{rank}.log."""
    flags = ["--nnodes", "1:2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    flags += ["--max-restarts", "3", "--elastic-wait", str(a.elastic_wait), "--nproc-per-node", "1"]
    job = [
        "--data",
        f"ddpjob.plugins:synthetic(samples={SAMPLES})",
        "--model",
        f"ddpjob.plugins:synthetic_mlp(width={a.width})",
        "--batch-size",
        "16",
        "--global-batch-size",
        "64",
        "--epochs",
        "100",  # far more than a run lasts: it is stopped once measured
        "--log-every",
        "1",
        "--save-every",
        str(a.save_every),
        "--stop-check-every",
        "1",
        "--run-dir",
        str(work / "run"),
    ]
    extra = env(OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    for key in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        extra.pop(key, None)
    with open(work / f"node{rank}.log", "wb") as log:
        return subprocess.Popen(
            [PY, "-m", "ddpjob", "launch", *flags, *job], cwd=work, stdout=log, stderr=subprocess.STDOUT, env=extra
        )


def records(work: Path) -> list[dict[str, Any]]:
    """Complete lines of RUN_DIR/metrics.jsonl (a line being written is left for the next read)."""
    path = work / "run/metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    out = []
    for line in text[: text.rfind("\n") + 1].splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def trained(work: Path) -> int:
    return max((r["step"] for r in records(work) if r["event"] == "train"), default=0)


def workers(agent_pid: int) -> dict[int, int]:
    """pid -> global RANK of the `ddpjob train` processes whose parent is the agent."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
        if rank is not None:
            found[int(stat.parent.name)] = rank
    return found


def is_worker(pid: int) -> bool:
    try:
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"ddpjob" in cmdline and b"train" in cmdline


def wait_for(check: Callable[[], Any], timeout: float, what: str, nodes: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        if all(n.poll() is not None for n in nodes):
            raise SystemExit(f"every agent exited while waiting for {what}")
        time.sleep(0.05)
    raise SystemExit(f"timed out ({timeout:g} s) waiting for {what}")


def stop(nodes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the agents (workers checkpoint and exit 75); SIGKILL whatever is left after 90 s."""
    left = {pid for n in nodes if n.poll() is None for pid in workers(n.pid)}
    for n in nodes:
        if n.poll() is None:
            n.send_signal(signal.SIGTERM)
    for n in nodes:
        try:
            n.wait(90)
        except subprocess.TimeoutExpired:
            n.kill()
            n.wait()
    for pid in left:
        if is_worker(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def agent_events(path: Path) -> list[tuple[float, str]]:
    """(epoch seconds, message) of torch's log lines (glog prefix, local time, ms)."""
    year, out = datetime.now().year, []
    for m in LOG_LINE.finditer(path.read_text(errors="replace")):
        month, day, hour, minute, sec, message = m.groups()
        whole = float(sec)
        when = datetime(year, int(month), int(day), int(hour), int(minute), int(whole))
        out.append(((when + timedelta(microseconds=round(whole % 1 * 1e6))).timestamp(), message))
    return out


def first(events: list[tuple[float, str]], after: float | None, text: str) -> float | None:
    if after is None:
        return None
    return next((when for when, message in events if when >= after and text in message), None)


class States(threading.Thread):
    """The c10d rendezvous state in node 0's store, read every `period` seconds: (time, state)."""

    def __init__(self, port: int, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.port, self.period = port, period
        self.seen: list[tuple[float, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        store, key = None, "torch.rendezvous." + RDZV_ID
        while not self.done.wait(self.period):
            try:
                if store is None:
                    store = TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=2))
                if store.check([key]) and (raw := store.get(key)) != SENTINEL:
                    self.seen.append((time.time(), _StateUnpickler(io.BytesIO(base64.b64decode(raw))).load()))
            except Exception:  # the store is not up yet, or has gone: try again
                store = None

    def joined_new_round(self, after: float | None, last_call: float) -> float | None:
        """When the first node joined a round that started after `after`: the round's deadline,
        which that node sets to its join time + last_call_timeout, minus last_call_timeout."""
        if after is None:
            return None
        for when, state in self.seen:
            if when >= after and not state.complete and state.deadline is not None:
                return float(state.deadline.timestamp() - last_call)
        return None

    def last_keepalive(self, after: float, pid: int) -> float | None:
        """The last keep-alive time of the agent with this pid in the first state read after `after`."""
        for when, state in self.seen:
            if when >= after:
                beats = [hb for node, hb in state.last_heartbeats.items() if node.pid == pid]
                return float(beats[0].timestamp()) if beats else None
        return None

    def waiting(self, after: float) -> float | None:
        """When a node added itself to the wait list (its keep-alive time, set as it did)."""
        for when, state in self.seen:
            if when >= after and state.wait_list:
                node = next(iter(state.wait_list))
                return float(state.last_heartbeats[node].timestamp())
        return None


def new_size(work: Path, t: float, world: int) -> Callable[[], tuple[dict[str, Any], dict[str, Any]] | None]:
    """A check: the first "start" record after t at `world` processes and the first step after it."""

    def check() -> tuple[dict[str, Any], dict[str, Any]] | None:
        recs = records(work)
        start = next((r for r in recs if r["event"] == "start" and r["time"] >= t and r["world_size"] == world), None)
        if start is None:
            return None
        step = next(
            (r for r in recs if r["event"] == "train" and r["time"] >= start["time"] and r["step"] > start["step"]),
            None,
        )
        return (start, step) if step else None

    return check


def diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


def common_parts(recs: list[dict[str, Any]], start: dict[str, Any]) -> dict[str, Any]:
    """Worker start and checkpoint load from the new "start" record; the steps trained again."""
    before = [r["step"] for r in recs if r["event"] == "train" and r["time"] < start["time"]]
    return {
        "worker start": start["group_joined"] - start["process_started"],
        "checkpoint load": start["time"] - start["group_joined"],
        "steps redone": max(before, default=0) - start["step"],
    }


def shrink(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work, port = Path(tmp), free_port()
        nodes = [agent(work, port, 0, a), agent(work, port, 1, a)]
        states = States(port)
        try:
            wait_for(lambda: trained(work) >= a.at_step, 300, f"step {a.at_step} at 2 nodes", nodes)
            states.start()  # the store is up: no failed connections to log
            victim = nodes[1].pid
            kids = workers(victim)
            if not kids:
                raise SystemExit("node 1's worker process was not found under its agent")
            rank0_died = 0 in kids.values()  # the rendezvous orders nodes by (host, agent pid): normally node 0
            t = time.time()
            nodes[1].kill()  # the whole node: its agent and its worker
            for pid in kids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            start, step = wait_for(new_size(work, t, 1), 300, "the first step at 1 node", nodes)
        finally:
            states.done.set()
            stop(nodes)
            if states.ident is not None:
                states.join()
        recs, events = records(work), agent_events(work / "node0.log")
        ends = [r["time"] for r in recs if r["event"] == "end" and t <= r["time"] <= start["time"]]
        end = None if rank0_died or not ends else ends[0]
        rdzv = first(events, t, "Rendezvous'ing worker group")
        complete = first(events, rdzv, "Rendezvous complete")
        joined = states.joined_new_round(rdzv, a.elastic_wait)
        last_beat = states.last_keepalive(t, victim)
        parts = common_parts(recs, start)
        parts |= {
            "detection": diff(end or rdzv, t),
            "re-rendezvous": diff(start["process_started"], end or rdzv),
            "first step": step["time"] - start["time"],
            "total": step["time"] - t,
            "note": "rank 0 died with node 1: no end record; detection ends at the survivor's rendezvous start"
            if end is None
            else "",
            "detail": {
                "detection: the survivor's collective fails (T -> end record)": diff(end, t),
                "re-rendezvous: the old worker exits (end -> agent's rendezvous starts)": diff(rdzv, end),
                "re-rendezvous: dead node's keep-alive expires (-> survivor joins a new round)": diff(joined, rdzv),
                "re-rendezvous: last call (-> rendezvous complete)": diff(complete, joined),
                "re-rendezvous: spawn (-> worker process started)": diff(start["process_started"], complete),
                "(not a part) the dead node's last keep-alive was before T by": diff(t, last_beat),
                "(not a part) survivor joins a new round - that keep-alive": diff(joined, last_beat),
            },
        }
        return parts


def grow(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work, port = Path(tmp), free_port()
        nodes = [agent(work, port, 0, a)]
        states = States(port)
        try:
            wait_for(lambda: trained(work) >= a.at_step, 300, f"step {a.at_step} at 1 node", nodes)
            states.start()
            t = time.time()
            nodes.append(agent(work, port, 1, a))
            start, step = wait_for(new_size(work, t, 2), 300, "the first step at 2 nodes", nodes)
            rank0_node = 1 if 0 in workers(nodes[1].pid).values() else 0
        finally:
            states.done.set()
            stop(nodes)
            if states.ident is not None:
                states.join()
        recs = records(work)
        events0, events1 = agent_events(work / "node0.log"), agent_events(work / "node1.log")
        ends = [r["time"] for r in recs if r["event"] == "end" and t <= r["time"] <= start["time"]]
        end = ends[0] if ends else None
        joiner = first(events1, t, "Rendezvous'ing worker group")
        waiting = states.waiting(t)
        noticed = first(events0, t, "new nodes")
        rdzv = first(events0, noticed, "Rendezvous'ing worker group")
        complete = first(events0, rdzv, "Rendezvous complete")
        parts = common_parts(recs, start)
        parts |= {
            "detection": diff(end, t),
            "re-rendezvous": diff(start["process_started"], end),
            "first step": step["time"] - start["time"],
            "total": step["time"] - t,
            "note": f"rank 0 of the new group on node {rank0_node}" if rank0_node else "",
            "detail": {
                "detection: the joiner's agent starts (T -> its rendezvous starts)": diff(joiner, t),
                "detection: it joins the wait list": diff(waiting, joiner),
                "detection: the running agent sees it waiting": diff(noticed, waiting),
                "detection: workers checkpoint and stop (-> end record)": diff(end, noticed),
                "re-rendezvous: the old worker exits (end -> agent's rendezvous starts)": diff(rdzv, end),
                "re-rendezvous: rendezvous (-> complete)": diff(complete, rdzv),
                "re-rendezvous: spawn (-> worker process started)": diff(start["process_started"], complete),
            },
        }
        return parts


def med(values: list[float | None]) -> float | str:
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    return median(known) if len(known) == len(values) else f"{median(known):.3g} ({len(known)} of {len(values)})"


def runs(values: list[float | None]) -> str:
    return ", ".join("n/a" if v is None else f"{v:.2f}" for v in values)


PARTS = ["detection", "re-rendezvous", "worker start", "checkpoint load", "first step", "total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--elastic-wait", type=int, default=2, help="ddpjob's --elastic-wait (last_call_timeout)")
    parser.add_argument("--width", type=int, default=1024, help="synthetic_mlp width (checkpoint size)")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--at-step", type=int, default=50, help="kill / join once this step is trained")
    parser.add_argument("--changes", default="shrink,grow")
    a = parser.parse_args()
    defaults = inspect.signature(DynamicRendezvousHandler.from_backend).parameters
    interval, attempts = defaults["keep_alive_interval"].default, defaults["keep_alive_max_attempt"].default
    params = sum(p.numel() for p in synthetic_mlp(width=a.width).parameters())
    print(
        f"torch {torch.__version__}: keep_alive_interval {interval} s x keep_alive_max_attempt {attempts}; "
        f"last_call_timeout = --elastic-wait {a.elastic_wait} s; model {params / 1e6:.2f} M parameters "
        f"(checkpoint with AdamW ~{params * 12 / 2**20:.0f} MiB), a checkpoint every {a.save_every} steps",
        flush=True,
    )
    measure = {"shrink": shrink, "grow": grow}
    results: dict[str, list[dict[str, Any]]] = {}
    for change in a.changes.split(","):
        for i in range(a.repeats):
            r = measure[change](a)
            results.setdefault(change, []).append(r)
            shown = ", ".join(f"{k} {'n/a' if r[k] is None else f'{r[k]:.2f}'}" for k in PARTS)
            print(f"{change} run {i + 1}: {shown}; steps redone {r['steps redone']} {r['note']}", flush=True)
    label = {"shrink": "shrink 2 -> 1 (node killed)", "grow": "grow 1 -> 2 (node joins)"}
    rows = [
        [
            label[c],
            *(med([r[k] for r in rs]) for k in PARTS),
            med([r["steps redone"] for r in rs]),
            runs([r["total"] for r in rs]),
        ]
        for c, rs in results.items()
    ]
    table(
        f"elastic: seconds from T (node killed / started) to the first step at the new size, median of {a.repeats}",
        ["change", *(f"{k} (s)" for k in PARTS[:-1]), "total (s)", "steps redone", "total, each run"],
        rows,
    )
    detail = [
        [label[c], name, med([r["detail"][name] for r in rs]), runs([r["detail"][name] for r in rs])]
        for c, rs in results.items()
        for name in rs[0]["detail"]
    ]
    table("elastic: detection and re-rendezvous, split", ["change", "part", "median (s)", "runs"], detail)
    for c, rs in results.items():
        for i, r in enumerate(rs):
            if r["note"]:
                print(f"note: {c} run {i + 1}: {r['note']}")


if __name__ == "__main__":
    main()
