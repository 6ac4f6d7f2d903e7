"""Which rank is slow: each rank's own time per step, shared at logging intervals.

Each rank times the work it does without waiting for the others: from the start of a step (the
first batch fetched) to the moment its backward has accumulated the last of its parameters'
gradients, before DDP waits for the other ranks' all-reduce. A hook on each parameter counts the
gradients as they land and notes the time at the last one; the gradients and DDP's own fused
reduction are left alone (a DDP communication hook, used before, replaced that reduction with a
Python one and cost 3-5% of a step in bench/loop.py's heavy configuration). A step in which some
parameter gets no gradient is not timed. On CUDA both ends are events on the stream, read back
only at the interval. At each logging interval the ranks all-gather their mean (one small
collective per interval, never per step); rank 0 records the slowest and the fastest rank with
their hosts and the spread, and when one rank has been slower than the median of the others by
--straggler-factor for --straggler-intervals intervals in a row, it warns once, naming it.

    own = Stragglers(env, device, factor, intervals); own.attach(ddp_model)
    own.start()              # a step begins (before its first batch is fetched)
    own.step_done()          # after the optimizer step
    fields = own.share()     # at a logging interval, on every rank: {} on the others, fields on rank 0
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ddpjob import log
from ddpjob.distenv import DistEnv


class Stragglers:
    def __init__(self, env: DistEnv, device: torch.device, factor: float, intervals: int) -> None:
        self.env, self.factor, self.intervals = env, factor, intervals
        self.cuda = device.type == "cuda"
        self.host = socket.gethostname()
        self.seconds, self.count = 0.0, 0
        self.events: list[tuple[Any, Any]] = []
        self.started: Any = None
        self.last_ready: Any = None
        self.expected = self.accumulated = 0  # gradients per backward; landed so far
        self.slow_for: dict[int, int] = {}  # rank -> consecutive slow intervals (rank 0)
        self.warned: set[int] = set()

    def attach(self, model: torch.nn.Module) -> None:
        """Count the gradients of ``model``'s trainable parameters as backward accumulates them."""
        params = [p for p in model.parameters() if p.requires_grad]
        self.expected = len(params)
        for param in params:
            param.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param: torch.Tensor) -> None:
        self.accumulated += 1
        if self.accumulated == self.expected:  # this backward's last gradient (each micro-batch's)
            self.accumulated = 0
            self.ready()

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.started, self.accumulated = self._now(), 0

    def ready(self) -> None:
        self.last_ready = self._now()

    def step_done(self) -> None:
        if self.last_ready is None:
            return
        if self.cuda:
            self.events.append((self.started, self.last_ready))
        else:
            self.seconds += self.last_ready - self.started
        self.count, self.last_ready = self.count + 1, None

    def _mean_ms(self) -> float:
        if self.cuda:
            if self.events:
                self.events[-1][1].synchronize()
            self.seconds = sum(b.elapsed_time(e) for b, e in self.events) / 1000
            self.events.clear()
        mean = 1000 * self.seconds / max(self.count, 1)
        self.seconds, self.count = 0.0, 0
        return mean

    def share(self) -> dict[str, Any]:
        """Collective (every rank, at the same steps): the interval's figures for rank 0's record."""
        mine = (self.host, round(self._mean_ms(), 3))
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return {}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if not self.env.is_main:
            return {}
        times = [ms for _, ms in everyone]
        slow, fast = max(range(len(times)), key=times.__getitem__), min(range(len(times)), key=times.__getitem__)
        self._watch(everyone)
        return {
            "own_ms_slowest": times[slow],
            "slowest_rank": slow,
            "slowest_host": everyone[slow][0],
            "own_ms_fastest": times[fast],
            "fastest_rank": fast,
            "fastest_host": everyone[fast][0],
            "own_ms_spread": round(times[slow] / max(times[fast], 1e-9), 3),
        }

    def _watch(self, everyone: list[Any]) -> None:
        times = [ms for _, ms in everyone]
        for rank, (host, ms) in enumerate(everyone):
            median = statistics.median(times[:rank] + times[rank + 1 :])  # of the others: 2 ranks have a median too
            self.slow_for[rank] = self.slow_for.get(rank, 0) + 1 if ms > self.factor * median else 0
            if self.slow_for[rank] >= self.intervals and rank not in self.warned:
                self.warned.add(rank)
                log.warning(
                    f"rank {rank} ({host}) is a straggler: its own step work took {ms:.1f} ms, "
                    f"{ms / max(median, 1e-9):.1f}x the others' median {median:.1f} ms, for {self.intervals} logging intervals "
                    "in a row; every rank waits for it at each step (check that node's load, clocks and data path)"
                )
