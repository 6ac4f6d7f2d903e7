"""Test plug-in: the digits model, except that its forward raises at call ``at`` (a user's model
that fails mid-run)."""

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
