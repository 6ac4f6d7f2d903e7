"""The learning-rate schedule: the LR as a function of the optimizer step alone.

Its length is the run's steps (global batch and dataset size, never --max-steps), so it is the
same at every world size with --global-batch-size fixed, and a resumed run sets the LR from its
step, whatever the schedule was when the checkpoint was written: it cannot drift from the loop.

    schedule = Schedule(optimizer, total_steps)   # records each group's base LR
    schedule.set(step)                            # after optimizer step `step`: the LR for the next one
"""

from __future__ import annotations

import math
from typing import Any

import torch


class Schedule:
    """Cosine decay from each group's base LR to 0 over ``total_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int) -> None:
        self.optimizer, self.total_steps = optimizer, max(total_steps, 1)
        self.base_lrs = [float(group.setdefault("initial_lr", group["lr"])) for group in optimizer.param_groups]

    def factor(self, step: int) -> float:
        return 0.5 * (1 + math.cos(math.pi * min(step, self.total_steps) / self.total_steps))

    def set(self, step: int) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * self.factor(step)

    @property
    def lr(self) -> float:
        """The LR the next optimizer step uses (the first group's)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs), "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Base LRs from the checkpoint (also from torch's LR schedulers' state, which ddpjob wrote
        before); the length stays this run's."""
        self.base_lrs = [float(lr) for lr in state["base_lrs"]]
