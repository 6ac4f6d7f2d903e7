"""Test plug-in: a model whose first state_dict on rank 0 (the first save) takes long, as a save
to slow storage does, while the other ranks wait for it."""

import os
import time

from torch import nn

from ddpjob.plugins import digits_mlp


class SlowStateDict(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.net, self.seconds, self.slow = digits_mlp(), seconds, os.environ.get("RANK", "0") == "0"

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.net(x)

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.slow and kwargs.get("prefix", "") == "":
            self.slow = False
            time.sleep(self.seconds)
        return super().state_dict(*args, **kwargs)


def model(seconds: float = 6.0) -> nn.Module:
    return SlowStateDict(seconds)
