"""Test plug-ins that stall outside any collective: a data loader that stops returning, an
evaluation that is slow on rank 1 only, data that is slow to build (a long set-up), and data slow
for a stretch of steps (a wide window for a test to act in)."""

import ctypes
import os
import time
from collections.abc import Callable

from torch.utils.data import Dataset

from ddpjob import plugins


class Stalling(Dataset):  # type: ignore[type-arg]
    """Wraps a dataset; fetching item i sleeps ``seconds`` when ``when(i, fetched so far)``."""

    def __init__(self, inner: Dataset, when: Callable[[int, int], bool], seconds: float) -> None:  # type: ignore[type-arg]
        self.inner, self.when, self.seconds, self.fetched = inner, when, seconds, 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        self.fetched += 1
        if self.when(i, self.fetched):
            time.sleep(self.seconds)
        return self.inner[i]


def hanging(after: int = 200):  # type: ignore[no-untyped-def]
    """The digits training set, whose loader never returns after ``after`` samples (a hung filesystem)."""
    train, _ = plugins.digits()
    return Stalling(train, lambda i, fetched: fetched > after, 3600)


def gil_held(after: int = 200):  # type: ignore[no-untyped-def]
    """The digits training set, whose loader after ``after`` samples blocks in a C call that keeps the
    GIL (libc's sleep through ctypes.PyDLL, which does not release it, as a C extension stuck in I/O
    would): no Python thread of the rank can run, and the rank burns no CPU while it waits."""
    train, _ = plugins.digits()
    libc = ctypes.PyDLL(None)

    def hold(i: int, fetched: int) -> bool:
        if fetched > after:
            libc.sleep(3600)
        return False

    return Stalling(train, hold, 0)


def slow_eval(seconds: float = 8.0):  # type: ignore[no-untyped-def]
    """The digits, whose validation pass takes ``seconds`` longer on rank 1 (at its first sample)."""
    train, val = plugins.digits()
    return train, Stalling(val, lambda i, fetched: i == 1, seconds) if os.environ.get("RANK") == "1" else val


def slow_to_build(seconds: float = 5.0, samples: int = 8192):  # type: ignore[no-untyped-def]
    """ddpjob.plugins.synthetic, built ``seconds`` late: each worker stays that long in its set-up,
    before its process group and its stop handlers, whatever the machine's load."""
    time.sleep(seconds)
    return plugins.synthetic(samples=samples)


def slow_from(after: int, span: int = 2048, seconds: float = 0.003, samples: int = 8192):  # type: ignore[no-untyped-def]
    """ddpjob.plugins.synthetic (the same samples, so the same training), whose samples after the
    first ``after`` a process fetched take ``seconds`` longer each, for ``span`` samples: a test
    that acts once training passed a step gets seconds to do so, whatever the machine's load,
    without slowing the steps before."""
    return Stalling(plugins.synthetic(samples=samples), lambda i, fetched: after < fetched <= after + span, seconds)
