"""The learning-rate schedule: the LR as a function of the optimizer step alone.

Its length is the run's steps (global batch and dataset size, never --max-steps), so it is the
same at every world size with --global-batch-size fixed, and a resumed run sets the LR from its
step, whatever the schedule was when the checkpoint was written: it cannot drift from the loop.

Built in: ``cosine`` (to --min-lr over the run, the default), ``linear`` (to --min-lr), ``constant``;
each after ``warmup`` steps of linear warm-up (step s < warmup uses base x (s+1)/(warmup+1)). Or a
user's function ``fn(step, total_steps) -> factor`` of each group's base LR, used as is.

    schedule = Schedule(optimizer, total_steps, "cosine", warmup=100, min_lr=1e-5)
    schedule.set(step)                            # after optimizer step `step`: the LR for the next one
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ddpjob.errors import UsageError


class Schedule:
    """Each group's LR from its base LR (the LR it was built with) and the step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        kind: str | Callable[[int, int], float] = "cosine",
        warmup: int = 0,
        min_lr: float = 0.0,
        source: str = "",
    ) -> None:
        self.optimizer, self.total_steps = optimizer, max(total_steps, 1)
        self.kind, self.warmup, self.min_lr, self.source = kind, warmup, min_lr, source
        self.base_lrs = [float(group.setdefault("initial_lr", group["lr"])) for group in optimizer.param_groups]

    def decay(self, step: int) -> float:
        """The built-in shape after warm-up: 1 at its start, 0 at the end of the run."""
        span = max(self.total_steps - self.warmup, 1)
        done = min(max(step - self.warmup, 0), span)
        if self.kind == "linear":
            return 1 - done / span
        return 0.5 * (1 + math.cos(math.pi * done / span))

    def lr_at(self, base: float, step: int) -> float:
        if callable(self.kind):
            factor = self.kind(step, self.total_steps)
            if not isinstance(factor, int | float) or not math.isfinite(factor) or factor < 0:
                raise UsageError(
                    f"{self.source} returned {factor!r} for step {step}, not a finite number of 0 or more; return "
                    "the factor of the base LR as a float"
                )
            return base * float(factor)
        if step < self.warmup:
            return base * (step + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return base
        floor = min(self.min_lr, base)
        return floor + (base - floor) * self.decay(step)

    def set(self, step: int) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = self.lr_at(base, step)

    @property
    def lr(self) -> float:
        """The LR the next optimizer step uses (the first group's)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs), "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to take: the base LRs are this run's (--lr applies on resume, as the other
        optimizer settings do) and so is the length. The saved state records what the run used."""
