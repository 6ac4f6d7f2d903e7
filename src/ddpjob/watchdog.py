"""Phase timeouts, and the watchdog thread that turns a rank without progress into a failure.

A job waits for different things in different phases, and one timeout cannot fit them all:

- ``startup`` (``--startup-timeout``): from joining the process group until the first step has
  finished: NCCL's communicator set-up, the DDP start-up broadcast, the first step with its
  compilation and warm-up, the nodes of a large job arriving at their first collective;
- ``step`` (``--collective-timeout``): every later step, where a peer that waits this long is dead,
  hung or cut off;
- ``eval`` (``--eval-timeout``): an evaluation pass, and the checks at the end of the run;
- ``checkpoint`` (``--save-timeout``): saving, loading and waiting for a checkpoint (whose
  collectives also run on a group of their own with this timeout).

Entering a phase sets the default process group's timeout to the phase's limit (the backend then
cuts off a collective that waits longer: the one-line ``a collective failed`` error), and restarts
the clock of the watchdog. The watchdog thread notes every finished step as progress. A rank that
makes no progress for its phase's limit plus a grace (so that the backend's own timeout, with the
better message, fires first) is stuck somewhere no collective timeout reaches: a data loader or a
filesystem that does not return, a deadlock in user code. It writes its traces, prints one line and
exits with code 1, so torchrun's ``--max-restarts``, a Slurm requeue or a Kubernetes restart policy
can act. ``--heartbeat S`` also prints the step, the phase and the time without progress every S
seconds; ``--trace-after`` writes the traces earlier without stopping anything.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from ddpjob.config import Config
from ddpjob.errors import EXIT_FAILED
from ddpjob.traces import Tracer


def grace(limit: float) -> float:
    """Extra seconds past a phase's limit before the watchdog acts: the backend's timeout first."""
    return max(10.0, 0.1 * limit)


class Phases:
    """The phase this rank is in, its limit, and when it last made progress."""

    def __init__(self, cfg: Config) -> None:
        self.limits = {
            "startup": (cfg.startup_timeout, "--startup-timeout"),
            "step": (cfg.collective_timeout, "--collective-timeout"),
            "eval": (cfg.eval_timeout, "--eval-timeout"),
            "checkpoint": (cfg.save_timeout, "--save-timeout"),
        }
        self.name = "startup"
        self.since = time.monotonic()

    @property
    def limit(self) -> float:
        return self.limits[self.name][0]

    def describe(self) -> str:
        """'--startup-timeout (600 s)': the flag that bounds the current phase."""
        limit, flag = self.limits[self.name]
        return f"{flag} ({limit:g} s)"

    def step_done(self) -> None:
        """A finished step: progress, and the end of start-up."""
        if self.name == "startup":
            self.switch("step")
        self.since = time.monotonic()

    def switch(self, name: str) -> None:
        self.name, self.since = name, time.monotonic()
        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.limit))

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
    progress write the traces, once per stall (0: never); past the phase's limit and grace write
    them and exit 1."""
    stop = threading.Event()
    tick = min(t for t in (heartbeat, trace_after / 4, 1.0) if t > 0)

    def watch() -> None:
        since, last_beat, traced = phases.since, time.monotonic(), False
        while not stop.wait(tick):
            now, step = time.monotonic(), tracer.current_step()
            if phases.since != since:
                since, traced = phases.since, False
            idle = now - since
            if heartbeat and now - last_beat >= heartbeat:
                last_beat = now
                print(f"[ddpjob] heartbeat: step {step}, {phases.name}, no progress for {idle:.0f}s", flush=True)
            if trace_after and not traced and idle >= trace_after:
                traced = True
                tracer.dump(f"no progress for {idle:.0f} s in {phases.name} (--trace-after {trace_after:g})")
                print(f"[ddpjob] no progress for {idle:.0f}s at step {step}: wrote {tracer.folder}", flush=True)
            if idle >= phases.limit + grace(phases.limit):
                tracer.dump(f"no progress for {idle:.0f} s in {phases.name}, past {phases.describe()}")
                print(
                    f"[ddpjob] rank {tracer.rank}: no progress for {idle:.0f}s at step {step} in {phases.name}, "
                    f"past {phases.describe()}: exiting {EXIT_FAILED} so the job restarts (traces in {tracer.folder}; "
                    f"`ddpjob diagnose` says where it stopped); raise {phases.describe().split()[0]} if this phase "
                    "is slow but alive",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_FAILED)

    threading.Thread(target=watch, name="ddpjob-watchdog", daemon=True).start()
    return stop
