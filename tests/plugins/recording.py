"""Test plug-ins: the digits data, recording every training sample index a process fetches; and the
digits model, recording the first number the process's torch RNG gives in training.

Each process appends the indices it reads, in order, to TEST_SAMPLES_DIR/<time_ns>-<pid>-rank<R>.txt
(the time its data was made names the file: before its run's start record), so a test can tell which
samples each optimizer step saw. Use with --num-workers 0: the loader then fetches each micro-batch when the loop asks for it.
"""

import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpjob import plugins


class Recording(Dataset):
    def __init__(self, base: Any, delay: float, until: str = "") -> None:
        self.base, self.delay, self.until = base, delay, until
        self.file: Any = None
        self.made = time.time_ns()  # in set-up: every rank's before its run's "start" record

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        if self.file is None:
            name = f"{self.made}-{os.getpid()}-rank{os.environ.get('RANK', '0')}.txt"
            self.file = open(os.path.join(os.environ["TEST_SAMPLES_DIR"], name), "a", buffering=1)  # noqa: SIM115
        self.file.write(f"{index}\n")
        if self.delay and self.until and os.path.exists(os.path.join(os.environ["TEST_SAMPLES_DIR"], self.until)):
            self.delay = 0.0  # released: the rest of the run at full speed
        time.sleep(self.delay)
        return self.base[index]


def digits(delay: float = 0.0, until: str = "") -> tuple[Recording, Any]:
    """``delay``: seconds of sleep per sample fetched, so a test can act mid-run; ``until``: a file
    name in TEST_SAMPLES_DIR that ends the delay once the test has made it (after it acted)."""
    train, val = plugins.digits()
    return Recording(train, delay, until), val


def model() -> nn.Module:
    """digits_mlp (with dropout) that, at its first forward in training, draws torch.rand(()) from
    the global RNG and appends it to TEST_SAMPLES_DIR/rng-rank<R>.draws: the stream the loop left it."""
    net = plugins.digits_mlp()

    def first_draw(module: nn.Module, args: Any) -> None:
        path = os.path.join(os.environ["TEST_SAMPLES_DIR"], f"rng-rank{os.environ.get('RANK', '0')}.draws")
        with open(path, "a") as f:
            f.write(f"{torch.rand(()).item()!r}\n")
        handle.remove()

    handle = net.register_forward_pre_hook(first_draw)
    return net
