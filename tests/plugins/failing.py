"""Test plug-ins: the digits model, except that its forward raises at call ``at`` (a user's model
that fails mid-run); factories that fail in set-up, once the stop signals are handled: slowly, or
with a SIGTERM arriving as set-up tears down."""

import gc
import os
import signal
import time
from pathlib import Path

from torch import nn

from ddpjob import plugins


class Failing(nn.Module):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.net, self.at, self.calls = plugins.digits_mlp(), at, 0

    def forward(self, x):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("the model failed")
        return self.net(x)


def model(at: int = 6) -> nn.Module:
    return Failing(at)


def slow_to_fail(seconds: float = 1.0):  # type: ignore[no-untyped-def]
    """Touches $CALLED as it is called (in set-up, after the stop handlers are in), takes ``seconds``,
    then returns no nn.Module: a set-up that fails as bad input."""
    Path(os.environ["CALLED"]).touch()
    time.sleep(seconds)
    return (nn.Linear(2, 2),)


class _TermWhenCollected:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, at the next bytecode
        time.sleep(0.3)


def fails_then_term():  # type: ignore[no-untyped-def]
    """Returns no nn.Module; a SIGTERM arrives as set-up tears down, from setup.job's own gc.collect()
    (as torchrun's agent stops this worker because another rank already exited 2)."""
    gc.disable()  # the collection in set-up's tear-down is the one that finds the cycle
    cycle = _TermWhenCollected()
    cycle.me = cycle  # type: ignore[attr-defined]
    del cycle
    return (nn.Linear(2, 2),)
