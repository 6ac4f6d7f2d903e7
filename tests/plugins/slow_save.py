"""Test plug-ins: a model whose state_dict on rank 0 at the first save after ``after`` saves takes
long, as a save to slow storage does, while the other ranks wait for it (calls before the first
forward are no saves: an fsdp2 start reads the state dict to fill its shards); validation data that
stops the job."""

import os
import signal
import time

from torch import nn
from torch.utils.data import Dataset

from ddpjob.plugins import digits_mlp, synthetic, synthetic_mlp


class SlowStateDict(nn.Module):
    def __init__(self, net: nn.Module, seconds: float, after: int) -> None:
        super().__init__()
        self.net, self.seconds, self.slow = net, seconds, os.environ.get("RANK", "0") == "0" and seconds > 0
        self.after, self.started = after, False

    def forward(self, x):  # type: ignore[no-untyped-def]
        self.started = True
        return self.net(x)

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        # the whole model's: called as it is (a file save), or inside DDP's (prefix "module.", DCP)
        saving = self.slow and self.started and kwargs.get("prefix", "") in ("", "module.")
        if saving:
            self.after -= 1
        if saving and self.after < 0:
            self.slow = False
            time.sleep(self.seconds)
        return super().state_dict(*args, **kwargs)


def model(seconds: float = 6.0, width: int = 0, after: int = 0) -> nn.Module:
    """digits_mlp, or with ``width`` synthetic_mlp of that width (for ddpjob.plugins:synthetic); slow
    from the save after ``after`` saves on."""
    return SlowStateDict(synthetic_mlp(width=width) if width else digits_mlp(), seconds, after)


class SignalInEval(Dataset):  # type: ignore[type-arg]
    """Validation data whose first item, fetched on rank 0, sends SIGTERM to the torchrun agent
    (``ddpjob launch``, its parent) and then takes ``seconds``: a stop during the evaluation."""

    def __init__(self, inner: Dataset, seconds: float) -> None:  # type: ignore[type-arg]
        self.inner, self.seconds, self.armed = inner, seconds, os.environ.get("RANK") == "0"

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        if self.armed:
            self.armed = False
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(self.seconds)
        return self.inner[index]


def signal_in_eval(seconds: float = 60.0) -> tuple[Dataset, Dataset]:  # type: ignore[type-arg]
    """synthetic data; its validation set stops the job during the first evaluation (see SignalInEval)."""
    return synthetic(samples=8192), SignalInEval(synthetic(samples=256), seconds)
