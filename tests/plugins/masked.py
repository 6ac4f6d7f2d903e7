"""Test plug-in: nn.Linear subclasses with buffers their reset_parameters() does not set, as users
write them (a weight mask; a non-persistent gain outside the state dict), for digits' 64 -> 10."""

import torch
from torch import nn


class MaskedLinear(nn.Linear):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.register_buffer("mask", (torch.arange(n_out * n_in) % 3 != 0).float().view(n_out, n_in))
        self.register_buffer("gain", torch.full((n_out,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias) * self.gain


def model() -> nn.Module:
    return nn.Sequential(MaskedLinear(64, 32), nn.ReLU(), MaskedLinear(32, 32), nn.ReLU(), MaskedLinear(32, 10))
