"""Test plug-in: a model with tied weights (as language models tie embedding and output)."""

from torch import nn


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode, self.decode = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.decode.weight = self.encode.weight

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.decode(self.encode(x))


def model() -> nn.Module:
    return Tied()
