"""What each rank was doing when the job stopped making progress, written to RUN_DIR/traces/.

Per rank R, rewritten at each dump:
- ``rank_R``: the process group's flight-recorder dump (torch's ``_dump_fr_trace``: a pickle of
  plain records: every recent collective with its sequence number, name, sizes and whether it
  completed, and the group's last enqueued / completed sequence numbers; NCCL's recorder on CUDA);
- ``stack_R.txt``: every thread's Python stack (faulthandler; safe while the main thread is
  blocked inside a collective, which holds no GIL);
- ``meta_R.json``: host, pid, step, why, and the main thread's id, so its stack can be found
  (written last: a dump is whole once it is there).

Each file is written under a temporary name and renamed, so a rank killed mid-dump leaves the
previous dump or none, never a torn one. A rank removes its own files when it starts, so a
folder never mixes attempts of that rank.

A rank dumps when it has made no progress for ``--trace-after`` seconds and before the watchdog
ends a stuck rank (from the watchdog thread of phase_watchdog.py: the main thread may be blocked in
C++), and when a collective fails. A rank that is stopped
(SIGSTOP), dead or killed writes nothing: ``ddpjob diagnose`` names it by its absence. On NCCL,
torch's own dump on timeout is switched on too (``enable_nccl_dumps``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ddpjob import log

FR_BUFFER = "2000"  # collectives each rank's flight recorder keeps


def enable_nccl_dumps(run_dir: str, rank: int) -> None:
    """Before the process group starts: NCCL's flight recorder on, and its dump on a timeout into
    the traces folder (the user's own settings win)."""
    folder = Path(run_dir) / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FR_BUFFER)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "nccl_rank_"))


class Tracer:
    """Writes this rank's traces; ``current_step`` is set once the loop has a step to report."""

    def __init__(self, run_dir: str, rank: int) -> None:
        self.folder, self.rank = Path(run_dir) / "traces", rank
        self.lock = threading.Lock()
        for name in self.names():  # an earlier attempt's: a dump of this one must not mix with them
            with contextlib.suppress(OSError):
                (self.folder / name).unlink()
        self.current_step: Callable[[], int] = lambda: -1
        self.dumped_at: int | None = None  # the step of the last dump

    def dump(self, why: str, keep: bool = False) -> None:
        """Write this rank's three files; never raises (it runs when things are already wrong).
        ``keep``: not if this rank already wrote them at this step (a collective that failed after
        a stall: gloo marks it finished once it has failed, so the stall's dump says more)."""
        with self.lock:
            if keep and self.dumped_at == self.current_step():
                return
            self.dumped_at = self.current_step()
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                meta = {
                    "rank": self.rank,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "step": self.current_step(),
                    "why": why,
                    "time": round(time.time(), 3),
                    "main_thread": threading.main_thread().ident,
                }
                records, stack, meta_name = self.names()
                flight = _flight_records()
                if flight is not None:
                    _replace(self.folder / records, lambda f: f.write(flight))
                _replace(self.folder / stack, lambda f: faulthandler.dump_traceback(file=f, all_threads=True))
                _replace(self.folder / meta_name, lambda f: f.write((json.dumps(meta) + "\n").encode()))
            except Exception as exc:  # diagnostics must not turn a hang into another failure
                log.info(f"could not write traces: {exc}")

    def names(self) -> tuple[str, str, str]:
        """This rank's files: flight records, stacks, meta."""
        return f"rank_{self.rank}", f"stack_{self.rank}.txt", f"meta_{self.rank}.json"


def _replace(path: Path, write: Callable[[BinaryIO], object]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as f:
        write(f)
    os.replace(temporary, path)


def _flight_records() -> bytes | None:
    """torch's flight-recorder dump of the default group's backend (NCCL keeps its own recorder),
    or None where this torch has none."""
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    dump = getattr(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None)
    try:
        return dump() if dump else None
    except RuntimeError:
        return None
