"""Where training stopped, and whether a verified checkpoint of that step is on disk.

Exit 75 ("requeue me") means: a verified checkpoint of the step where training stopped exists. A
worker cannot always know that (it may give up waiting for rank 0 while rank 0 still seals the
checkpoint, or be killed after it was sealed), so the exit code is decided by what is on disk.

Every worker writes ``RUN_DIR/stop.json`` (the same content on every rank; each replaces it
atomically) when the ranks agree to stop on a signal, and when training has finished (the last
step is then where it stopped: a signal during the final evaluation finds it). Each time torchrun's
agent in ``ddpjob launch`` starts workers, launch marks the record there as stale (``mark``) and
reads past it, so a record is never of an earlier attempt or of an earlier round of an elastic job.
Nothing removes it: in a job of several nodes sharing RUN_DIR, node 0 may stop first and be replaced
at once (a Job ignores exit 75), or the others re-form and train on (elastic), while another node's
launch still waits for its workers and has yet to read the record of their stop. ``outcome`` then
checks the checkpoint of that step with its format's verify.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ddpjob import log
from ddpjob.checkpoint import catalogue
from ddpjob.checkpoint.storage import Where

NAME = "stop.json"


@dataclass(frozen=True)
class Stop:
    step: int
    signal: int  # the signal the ranks agreed to stop on; 0: training finished


@dataclass(frozen=True)
class Outcome:
    stop: Stop
    checkpoint: Where | None  # the verified checkpoint of the stop's step, else None
    why: str  # why there is none ("" when there is)

    @property
    def saved(self) -> bool:
        return self.checkpoint is not None


def record(run_dir: str | Path, step: int, signal: int) -> None:
    """Write (atomically, over any earlier one) the step where training stopped. Where RUN_DIR cannot
    be written, a warning: the stop then cannot be verified, and ends with a code other than 75."""
    path = Path(run_dir) / NAME
    tmp = path.with_name(f".{NAME}.{socket.gethostname()}-{os.getpid()}")  # pods of a shared RUN_DIR share pids
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"step": step, "signal": signal}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning(f"cannot record the stop step in {path}: {exc.strerror or exc}")


Mark = tuple[int, int] | None  # a record's file (inode, mtime in ns); None: there was none


def mark(run_dir: str | Path) -> Mark:
    """The record there now (an earlier attempt's), for read() to pass over. A record written later is
    another file (written aside, then renamed over it): it may get a freed inode again, but not the
    same mtime, as it is written by workers started after this mark, seconds later at the least
    (file times move in steps of 1 to 10 ms, on some NFS servers 1 s)."""
    try:
        found = (Path(run_dir) / NAME).stat()
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns


def read(run_dir: str | Path, stale: Mark = None) -> Stop | None:
    """The recorded stop, or None (none recorded, unreadable, or the one marked stale)."""
    path = Path(run_dir) / NAME
    try:
        if stale is not None and mark(run_dir) == stale:
            return None
        found = json.loads(path.read_text())
        return Stop(int(found["step"]), int(found["signal"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def verified(checkpoint_dir: Where, step: int) -> tuple[Where | None, str]:
    """(the checkpoint of step that passes its format's full verify, None) or (None, why not)."""
    found = [path for s, path in catalogue.list_steps(checkpoint_dir) if s == step]
    if not found:
        return None, f"there is no checkpoint of step {step} in {checkpoint_dir}"
    reasons = []
    for path in found:
        try:
            reason = catalogue.verify(path)
        except OSError as exc:
            reason = f"unreadable ({exc.strerror or exc})"
        if reason is None:
            return path, ""
        reasons.append(f"{path.name}: {reason}")
    return None, f"its checkpoint fails verification ({'; '.join(reasons)})"


def lost(step: int, checkpoint_dir: Where) -> str:
    """What a stop at step without its checkpoint loses: the steps since the newest complete one."""
    newest = next(
        (s for s, path in catalogue.list_steps(checkpoint_dir) if s < step and not catalogue.verify(path, None)), 0
    )
    if newest > 0:
        return f"steps {newest + 1}..{step} are lost (the newest checkpoint is step {newest})"
    return f"all {step} steps are lost (no checkpoint)"


def outcome(run_dir: str | Path, checkpoint_dir: Where, wait: float = 0.0, stale: Mark = None) -> Outcome | None:
    """The recorded stop and whether its checkpoint is verified on disk; None: no stop recorded
    (but the one marked ``stale``).

    ``wait``: seconds to keep looking when the checkpoint is not verified yet. A node whose workers
    all reported the stop's checkpoint saved (exit 75) may not see it yet: rank 0 on another node
    sealed it, and this node's view of shared storage (NFS attribute and directory caches) lags.
    The caller passes --fs-timeout then, and 0 when a worker failed (no wait on a failed save)."""
    stop = read(run_dir, stale)
    return None if stop is None else checked(stop, checkpoint_dir, wait)


def checked(stop: Stop, checkpoint_dir: Where, wait: float = 0.0) -> Outcome:
    """A recorded stop and whether its checkpoint is verified on disk, looking for up to ``wait`` s."""
    deadline, told = time.monotonic() + wait, False
    while True:
        path, why = verified(checkpoint_dir, stop.step)
        if path is not None or time.monotonic() >= deadline:
            return Outcome(stop, path, why)
        if not told:
            log.info(
                f"the workers saved step {stop.step}, but {checkpoint_dir} does not show its checkpoint yet ({why}): "
                f"waiting up to {wait:g} s (--fs-timeout) for shared storage"
            )
            told = True
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
