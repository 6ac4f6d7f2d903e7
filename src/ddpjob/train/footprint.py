"""How many bytes of training state each rank holds: parameters, gradients, optimizer state
(under fsdp2 a rank's own shards), and the process's peak resident memory, gathered from every
rank for one metrics record."""

from __future__ import annotations

import resource
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpjob.train.fsdp import is_dtensor


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of tensor: its own shard of a DTensor."""
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    return local.numel() * local.element_size()


def of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes; tied parameters count once."""
    params = list({id(p): p for p in model.parameters()}.values())
    moments = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": sum(nbytes(p) for p in params),
        "grad_bytes": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(nbytes(v) for v in moments),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


def gathered(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Collective: each figure of ``of`` as a list by rank."""
    mine: Any = of(model, optimizer)
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {key: [rank[key] for rank in everyone] for key in mine}
