"""Stop on a signal at a step boundary that every rank agrees on.

``STOP_SIGNALS`` is the one list of signals a job stops on, for the workers here and for the agent
(``ddpjob launch`` has torchrun forward exactly these): SIGTERM (Kubernetes, docker stop, scancel),
SIGINT (Ctrl-C), SIGUSR1 (Slurm ``--signal``), SIGHUP (a closed terminal or ssh session) and
SIGQUIT. Each only sets a flag. Every ``stop_check_every`` steps the ranks take the maximum of their
flags (without waiting for it), so all of them stop after the same step, rank 0 checkpoints, and
all exit with EXIT_PREEMPTED, which means that checkpoint exists: a stop whose checkpoint cannot be
written exits with another code (loop.py).
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

from ddpjob import log
from ddpjob.errors import EXIT_FAILED

# torchrun forwards what it handles to the workers, so the agent and the workers share this list:
# a signal one of them left to its default action would kill the workers with no checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)


def shield_worker(worker_id: int) -> None:
    """A DataLoader worker's init: the stop signals are its rank's to handle. torchrun signals the
    rank's whole process group and Slurm every process of the step; torch's workers die of SIGTERM,
    and the rank would fail on a dead worker instead of checkpointing. So a worker ignores SIGINT
    and SIGUSR1, and SIGTERM unless its rank sends it (torch ends a worker that way at shutdown)."""
    for sig in STOP_SIGNALS:
        if sig != signal.SIGTERM:
            signal.signal(sig, signal.SIG_IGN)
    rank_process = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken only by the thread below

    def watch() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank_process:
            pass
        os._exit(128 + signal.SIGTERM)  # as SIGTERM's default action would

    threading.Thread(target=watch, name="ddpjob-worker-sigterm", daemon=True).start()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name if signum else "a stop signal"


class StopSignal:
    def __init__(self, check_every: int, device: torch.device) -> None:
        self.check_every = check_every
        self.received = 0
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.pending: dist.Work | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        atexit.unregister(ignore_at_exit)  # once, however many runs this process makes
        atexit.register(ignore_at_exit)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.received
        self.received = signum  # before the log line: a write that fails here must not lose the stop
        if first:
            log.failure(f"got {signal.Signals(signum).name}: stopping at the next agreed step")

    def agreed(self, step: int) -> bool:
        """True on every rank, at the same step, once any rank got a stop signal.

        The max of the flags is taken with an asynchronous all-reduce that is started at one check
        and read at the next, so the loop never waits for it: a signal stops training within two
        check intervals."""
        if step % self.check_every:
            return False
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return bool(self.received)
        stop = False
        if self.pending is not None:
            self.pending.wait()
            self.pending, stop = None, bool(self.flag.item())
            self.received = self.received or int(self.flag.item())  # the signal another rank got
        if not stop:
            self.flag.fill_(self.received)
            self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        return stop

    def finish(self) -> None:
        """Complete the all-reduce in flight, before other collectives' results are needed."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def settle(self, finished: bool) -> None:
        """After the loop. Once a stop is under way, a later stop signal (Slurm signals every
        process of the step, and the batch script forwards TERM again) is the same request, and
        once training has finished there is nothing left to stop: it is ignored, so it cannot kill
        a worker that has checkpointed and is exiting 75, or one that finished and is exiting 0.
        After a failure in the loop the default actions come back: a failed worker stops at once
        (a hang in its tear-down cannot hold it). A set-up that fails never gets here: a signal in
        its tear-down is only recorded, and its error line and code come out. At exit every stop
        signal is ignored (ignore_at_exit)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if self.received or finished else signal.SIG_DFL)


def ignore_at_exit() -> None:
    """Registered with atexit as the handlers are installed: CPython puts back SIG_DFL for every
    signal it handled as the interpreter exits, after the atexit functions, so a stop signal then
    would kill a worker that has said its exit code."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def exit_with_parent(interval: float = 1.0) -> None:
    """End this worker within ``interval`` seconds of its parent (the torchrun agent) dying.

    torchrun starts each worker in a session of its own, so when the agent is killed with SIGKILL
    (the OOM killer, a crash, a supervisor that kills only its child) nothing reaches the workers:
    they would train on, holding ports and the checkpoint dir, beside the job that replaces them.
    A daemon thread notices the new parent and ends the process; its lock on the checkpoint dir
    goes with it. (``PR_SET_PDEATHSIG`` would follow the agent's forking thread, not the agent.)
    """
    parent = os.getppid()
    if parent == 1:  # the agent died before we got here
        log.failure("the torchrun agent is already gone: this worker exits")
        os._exit(EXIT_FAILED)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        log.failure(f"the torchrun agent (pid {parent}) is gone: this worker exits")
        os._exit(EXIT_FAILED)

    threading.Thread(target=watch, name="ddpjob-parent-watch", daemon=True).start()
