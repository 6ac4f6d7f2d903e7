"""How the optimizer and the LR schedule are built (``--optimizer``, ``--schedule``).

Optimizers: ``adamw`` (default), ``adam``, ``sgd`` with ``--lr``, ``--momentum``, ``--nesterov``,
``--betas`` and ``--weight-decay``; weight decay skips biases and norm weights (parameters with fewer
than 2 dimensions), as nanoGPT and torchtitan do; torch's fused implementation where every parameter
is on a device it has fused kernels for (CPU and CUDA), else its default. Or ``MODULE:CALLABLE[(k=v)]``,
a factory called with the (unwrapped) model that returns a ``torch.optim.Optimizer``.

Schedules (schedule.py): ``cosine`` (default), ``linear``, ``constant``, with ``--warmup-steps`` and
``--min-lr``; or ``MODULE:CALLABLE[(k=v)]``, a function ``fn(step, total_steps) -> factor`` of each
group's base LR. The LR is a function of the step alone, so resumes and resizes keep it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpjob.config import Config
from ddpjob.errors import UsageError
from ddpjob.plugins import load_function
from ddpjob.schedule import BUILT_IN, Schedule

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}
FUSED_DEVICES = ("cpu", "cuda")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters; with weight decay, two groups: decayed (2+ dims: weights of linear,
    conv and embedding layers) and not (biases, norm weights)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not weight_decay:
        return [{"params": params, "weight_decay": 0.0}]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def implementation(model: nn.Module) -> dict[str, Any]:
    """``fused=True`` where torch has fused kernels for every parameter, else torch's own choice."""
    params = list(model.parameters())
    fusable = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return {"fused": True} if params and fusable else {}


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``--optimizer`` for ``model`` (the user's module, unwrapped)."""
    if cfg.optimizer not in OPTIMIZERS:
        optimizer = load_function(cfg.optimizer)(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(
                f"--optimizer {cfg.optimizer} returned a {type(optimizer).__name__}, not a torch.optim.Optimizer; "
                "return e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
            )
        return optimizer
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        kwargs: dict[str, Any] = {"momentum": cfg.momentum, "nesterov": cfg.nesterov}
    else:
        kwargs = {"betas": cfg.beta_pair}
    return OPTIMIZERS[cfg.optimizer](groups, lr=cfg.lr, **kwargs, **implementation(model))


def build_schedule(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int) -> Schedule:
    """The LR schedule of ``--schedule`` over ``total_steps``."""
    if cfg.schedule in BUILT_IN:
        return Schedule(optimizer, total_steps, cfg.schedule, cfg.warmup_steps, cfg.min_lr)
    return Schedule(optimizer, total_steps, load_function(cfg.schedule), source=f"--schedule {cfg.schedule}")


def check_plugins(cfg: Config) -> None:
    """Import an optimizer or schedule plug-in now, so a wrong name fails before any network wait."""
    for spec, built_in in ((cfg.optimizer, OPTIMIZERS), (cfg.schedule, BUILT_IN)):
        if spec not in built_in:
            load_function(spec)
