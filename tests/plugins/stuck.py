"""Test plug-in: the digits model, except that rank 1 stops in its forward at step ``at`` (sleeps
there): alive, and never entering the collective the other ranks wait in."""

import os
import time

from torch import nn

from ddpjob import plugins


class Stuck(nn.Module):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.net, self.at, self.calls = plugins.digits_mlp(), at, 0

    def forward(self, x):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.training and self.calls >= self.at and os.environ.get("RANK") == "1":
            time.sleep(3600)
        return self.net(x)


def model(at: int = 6) -> nn.Module:
    return Stuck(at)
