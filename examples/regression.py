"""A regression with its own loss, as a ddpjob plug-in: float targets, mean squared error, and the
mean absolute error logged beside it (and averaged over the validation set across ranks).

    ddpjob train --model examples.regression:model --data examples.regression:data \\
        --loss examples.regression:mse_loss
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def model(features: int = 8, hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def data(samples: int = 2048, features: int = 8, noise: float = 0.05) -> tuple[TensorDataset, TensorDataset]:
    """(x, y) with y = sin(x @ w) + noise, one float target per sample; the last eighth is held out."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=gen)
    y = torch.sin(x @ torch.randn(features, 1, generator=gen) / features**0.5) + noise * torch.randn(
        samples, 1, generator=gen
    )
    n_val = samples // 8
    return TensorDataset(x[n_val:], y[n_val:]), TensorDataset(x[:n_val], y[:n_val])


def mse_loss(
    output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ddpjob's user-loss form: fn(model output, batch) -> (scalar loss, {name: extra metric})."""
    target = batch[1]
    return F.mse_loss(output, target), {"mae": (output - target).abs().mean().detach()}
