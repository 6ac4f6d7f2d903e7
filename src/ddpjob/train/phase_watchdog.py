"""Phase timeouts, and the watchdog thread that turns a rank without progress into a failure.

A job waits for different things in different phases, and one timeout cannot fit them all:

- ``startup`` (``--startup-timeout``): from joining the process group until the first micro-batch
  has finished: NCCL's communicator set-up, the DDP start-up broadcast, the first forward and
  backward with their compilation (``--compile``) and warm-up, the nodes of a large job arriving
  at their first collective;
- ``step`` (``--collective-timeout``): every later micro-batch, where a peer that waits this long
  is dead, hung or cut off (a recompilation mid-run, e.g. for a new sequence length, counts here);
- ``eval`` (``--eval-timeout``): an evaluation pass, the checks and the tracker's last records at
  the end of the run;
- ``checkpoint`` (``--save-timeout``, or ``--fs-timeout`` if longer): saving, loading and waiting
  for a checkpoint (whose collectives also run on a group of their own with this timeout).

Entering a phase sets the default process group's timeout to the phase's limit. On gloo a
collective that waits longer raises, and every rank exits 1 with the one-line ``a collective
failed`` error; on NCCL the backend's own watchdog aborts the process instead (SIGABRT: exit -6 /
134), after dumping its flight recorder. The watchdog thread here notes every finished micro-batch
as progress. A rank that makes no progress for its phase's limit plus a grace (so that the
backend's timeout fires first) is stuck where no collective timeout reaches: a data loader or a
filesystem that does not return, a deadlock in user code. It prints one line, writes its traces
(for at most the grace: the hung storage may be RUN_DIR's) and exits 1, so torchrun's
``--max-restarts``, a Slurm requeue or a Kubernetes restart policy can act. ``--heartbeat S`` also
prints the step, the phase and the time without progress every S seconds; ``--trace-after``
writes the traces earlier without stopping anything.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from ddpjob import log
from ddpjob.config import Config
from ddpjob.errors import EXIT_FAILED
from ddpjob.train.traces import Tracer


def grace(limit: float) -> float:
    """Extra seconds past a phase's limit before the watchdog acts: the backend's timeout first."""
    return max(10.0, 0.1 * limit)


class State(NamedTuple):
    """One phase and the time of the last progress in it: replaced whole, so the watchdog thread
    never pairs one phase's start with another phase's limit."""

    name: str
    limit: float
    flag: str
    since: float

    def describe(self) -> str:
        """'--startup-timeout (600 s)': the flag that bounds this phase."""
        return f"{self.flag} ({self.limit:g} s)"


def arm_c_timer(seconds: float) -> None:
    """faulthandler's timer: in ``seconds``, dump every thread's stack to the process's own stderr
    (fd 2, whatever wraps sys.stderr) and exit 1, unless re-armed first. Best effort: a process
    without a usable stderr goes without this backstop."""
    if sys.__stderr__ is not None:
        with contextlib.suppress(OSError, ValueError):
            faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)


class Phases:
    """The phase this rank is in, its limit, and when it last made progress."""

    def __init__(self, cfg: Config) -> None:
        self.limits = {
            "startup": (cfg.startup_timeout, "--startup-timeout"),
            "step": (cfg.collective_timeout, "--collective-timeout"),
            "eval": (cfg.eval_timeout, "--eval-timeout"),
            # a load may also wait --fs-timeout for a file to show on this node's storage
            "checkpoint": (max(cfg.save_timeout, cfg.fs_timeout), "--save-timeout"),
        }
        self.state = State("startup", *self.limits["startup"], time.monotonic())
        self.watched = False  # a watchdog runs: arm faulthandler's timer at each switch

    @property
    def name(self) -> str:
        return self.state.name

    def describe(self) -> str:
        return self.state.describe()

    def progress(self) -> None:
        """A finished micro-batch: progress, and the end of start-up."""
        if self.state.name == "startup":
            self.switch("step")
        else:
            self.state = self.state._replace(since=time.monotonic())

    def switch(self, name: str) -> None:
        self.state = State(name, *self.limits[name], time.monotonic())
        if self.watched:  # from this thread: the watchdog's may not run again (see start_watchdog)
            arm_c_timer(self.state.limit + 3 * grace(self.state.limit))
        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.state.limit))

    @contextlib.contextmanager
    def enter(self, name: str) -> Iterator[None]:
        """Run the block in phase ``name``, then return to the phase it was entered from (not when
        it raises: the error is reported with the phase it happened in)."""
        before = self.name
        self.switch(name)
        yield
        self.switch(before)


def start_watchdog(phases: Phases, tracer: Tracer, heartbeat: float, trace_after: float) -> threading.Event:
    """One thread until the returned event is set: every ``heartbeat`` seconds print this rank's
    step, phase and time without progress (0: never); after ``trace_after`` seconds without
    progress write the traces, once per stall (0: never); past the phase's limit and grace say so
    in one line, write them (for at most the grace: the storage may be what hangs) and exit 1.
    Each tick and each phase switch also re-arm faulthandler's timer, a C thread that needs no GIL:
    if this thread cannot run (the main thread stuck in C code holding the GIL), that one dumps the
    stacks and exits 1 two graces later."""
    stop = threading.Event()
    phases.watched = True
    tick = min(t for t in (heartbeat, trace_after / 4, 1.0) if t > 0)

    def watch() -> None:
        last_beat, traced_since = time.monotonic(), -1.0
        while not stop.wait(tick):
            now, state, step = time.monotonic(), phases.state, tracer.current_step()
            idle, deadline = now - state.since, state.limit + grace(state.limit)
            arm_c_timer(max(deadline - idle, 0) + 2 * grace(state.limit))
            if heartbeat and now - last_beat >= heartbeat:
                last_beat = now
                log.info(f"heartbeat: step {step}, {state.name}, no progress for {idle:.0f}s")
            if trace_after and traced_since != state.since and idle >= trace_after:
                traced_since = state.since
                tracer.dump(f"no progress for {idle:.0f} s in {state.name} (--trace-after {trace_after:g})")
                log.info(f"no progress for {idle:.0f}s at step {step}: wrote {tracer.folder}")
            if idle >= deadline:
                log.failure(
                    f"rank {tracer.rank}: no progress for {idle:.0f}s at step {step} in {state.name}, "
                    f"past {state.describe()}: exiting {EXIT_FAILED} so the job restarts (traces in {tracer.folder}; "
                    f"`ddpjob diagnose` says where it stopped); raise {state.flag} if this phase is slow but alive"
                )
                dump = threading.Thread(target=tracer.dump, args=(f"no progress past {state.describe()}",), daemon=True)
                dump.start()
                dump.join(grace(state.limit))
                os._exit(EXIT_FAILED)
        phases.watched = False
        faulthandler.cancel_dump_traceback_later()

    threading.Thread(target=watch, name="ddpjob-watchdog", daemon=True).start()
    return stop
