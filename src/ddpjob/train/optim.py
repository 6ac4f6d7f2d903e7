"""How the optimizer and the LR schedule are built (``--optimizer``, ``--schedule``).

Optimizers: ``adamw`` (default), ``adam``, ``sgd`` with ``--lr``, ``--momentum``, ``--nesterov``,
``--betas`` and ``--weight-decay``; weight decay skips biases and norm weights (parameters with fewer
than 2 dimensions), as nanoGPT and torchtitan do; torch's fused implementation where every parameter
is on a device it has fused kernels for (CPU and CUDA), else its default. Or ``MODULE:CALLABLE[(k=v)]``,
a factory called with the (unwrapped) model that returns a ``torch.optim.Optimizer``.

Schedules (schedule.py): ``cosine`` (default), ``linear``, ``constant``, with ``--warmup-steps`` and
``--min-lr``; or ``MODULE:CALLABLE[(k=v)]``, a function ``fn(step, total_steps) -> factor`` of each
group's base LR. The LR is a function of the step alone, so resumes and resizes keep it.

A checkpoint records the optimizer's ``layout`` (kind, parameters per group, setting names); a resume
whose optimizer differs (another --optimizer, --weight-decay 0 <-> > 0) is bad input, checked by
``check_resume`` (before this record: from the saved state's groups). On resume the optimizer's
state (moments, momentum buffers) carries over and this run's settings win: ``keep_settings``
puts back the weight decay, betas, momentum this run was given over the saved ones (the LR is
the schedule's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpjob import log
from ddpjob.config import FIELDS, OPTIMIZER_NAMES, SCHEDULE_NAMES, Config, flag
from ddpjob.errors import UsageError
from ddpjob.plugins import load_function
from ddpjob.train.schedule import Schedule

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = dict(
    zip(OPTIMIZER_NAMES, (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD), strict=True)
)
BUILT_IN_SETTINGS = ("momentum", "nesterov", "betas", "weight_decay")  # what a factory sets itself
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
    """``fused=True`` where torch has fused kernels for every parameter (none for sparse gradients:
    an nn.Embedding or nn.EmbeddingBag with ``sparse=True``), else torch's own choice."""
    params = list(model.parameters())
    sparse = any(isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse for m in model.modules())
    fusable = not sparse and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return {"fused": True} if params and fusable else {}


def build_optimizer(cfg: Config, model: nn.Module, warn: bool = True) -> torch.optim.Optimizer:
    """The optimizer of ``--optimizer`` for ``model`` (the user's module, unwrapped); ``warn``: say
    (once, from one process) which built-in optimizers' flags a factory ignores."""
    if cfg.optimizer not in OPTIMIZERS:
        ignored = [flag(name) for name in BUILT_IN_SETTINGS if getattr(cfg, name) != FIELDS[name].default]
        if warn and ignored:
            log.warning(
                f"{', '.join(ignored)} set the built-in optimizers; --optimizer {cfg.optimizer} "
                "sets its own, so they are ignored"
            )
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
    if cfg.schedule in SCHEDULE_NAMES:
        return Schedule(optimizer, total_steps, cfg.schedule, cfg.warmup_steps, cfg.min_lr)
    return Schedule(optimizer, total_steps, load_function(cfg.schedule), source=f"--schedule {cfg.schedule}")


def check_plugins(cfg: Config) -> None:
    """Import an optimizer or schedule plug-in now, so a wrong name fails before any network wait."""
    for spec, built_in in ((cfg.optimizer, OPTIMIZERS), (cfg.schedule, SCHEDULE_NAMES)):
        if spec not in built_in:
            load_function(spec)


NOT_SETTINGS = ("params", "lr", "initial_lr")  # what a group holds besides settings; the LR is the schedule's


def layout(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What must match for a checkpoint's optimizer state to load: kind, parameters per group, setting names."""
    return {
        "kind": type(optimizer).__name__.lower(),
        "groups": [len(group["params"]) for group in optimizer.param_groups],
        "settings": sorted({key for group in optimizer.param_groups for key in group} - set(NOT_SETTINGS)),
    }


def saved_layout(resumed: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's record of its optimizer; for one written before the record, what its saved
    optimizer state shows (the kind told by its settings); None when neither is there."""
    if "optimizer_layout" in resumed:
        return dict(resumed["optimizer_layout"])
    groups = resumed.get("optimizer", {}).get("param_groups") if isinstance(resumed.get("optimizer"), dict) else None
    if not groups:
        return None
    settings = sorted({key for group in groups for key in group} - set(NOT_SETTINGS))
    kind = "sgd" if "momentum" in settings else "adam or adamw" if "betas" in settings else "unknown"
    return {"kind": kind, "groups": [len(group["params"]) for group in groups], "settings": settings}


def check_resume(resumed: dict[str, Any], mine: dict[str, Any], source: str) -> None:
    """UsageError when the checkpoint's optimizer is not this run's (``mine``: ``layout`` before loading)."""
    saved = saved_layout(resumed)
    if saved is None:
        return
    same_kind = saved["kind"] == mine["kind"] or mine["kind"] in saved["kind"].split(" or ")
    if same_kind and saved["groups"] == mine["groups"] and saved["settings"] == mine["settings"]:
        return

    def said(record: dict[str, Any]) -> str:
        return f"{record['kind']} with {len(record['groups'])} parameter group(s) of {record['groups']} parameters"

    raise UsageError(
        f"the checkpoint {source}'s optimizer is {said(saved)}, this run's is {said(mine)}: resume with the same "
        "--optimizer and --weight-decay (0 or not), or start over with --resume never or --init-from"
    )


def settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's settings (weight decay, betas, momentum, ...), the LR left out."""
    return [{k: v for k, v in group.items() if k not in NOT_SETTINGS} for group in optimizer.param_groups]


def keep_settings(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Put ``settings`` taken before a checkpoint was loaded back over the ones it brought."""
    for group, mine in zip(optimizer.param_groups, saved, strict=True):
        group.update(mine)
