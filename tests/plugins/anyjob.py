"""Test plug-ins for jobs of any shape: token models that return their own loss (as a scalar, a dict
or an object with .loss) on dict batches, an autoencoder fed bare tensors, a regression on nested
batches with a non-tensor leaf and a user loss, and plug-ins that break the rules on purpose."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB = 16


class Tokens(Dataset):
    """Hugging Face-style items {"input_ids", "labels"} (labels == input_ids): counting sequences
    (each token the previous + 1, mod VOCAB) from random starts, so a model can learn them."""

    def __init__(self, samples: int, block: int, seed: int, key: str = "labels") -> None:
        starts = torch.randint(0, VOCAB, (samples, 1), generator=torch.Generator().manual_seed(seed))
        self.ids, self.key = (starts + torch.arange(block)) % VOCAB, key

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], self.key: self.ids[index]}


def tokens(samples: int = 256, block: int = 8, key: str = "labels") -> tuple[Tokens, Tokens]:
    """``key``: the name of the labels field ("labels"; anything else: the model gets no labels)."""
    return Tokens(samples, block, 0, key), Tokens(64, block, 1, key)


@dataclass
class Output:
    """Like transformers' ModelOutput: fields, ``loss`` None when no labels were given."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class TinyLM(nn.Module):
    """Embedding + a norm + a linear head; shifts internally as Hugging Face causal LMs do."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        self.returns = returns
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **unused: Any) -> Any:
        logits = self.head(self.norm(self.embed(input_ids)))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        if self.returns == "scalar":
            return loss if loss is not None else logits
        if self.returns == "dict":
            return {"logits": logits, "loss": loss} if loss is not None else {"logits": logits}
        return Output(logits, loss)


def tiny_lm(returns: str = "dict") -> nn.Module:
    """``returns``: "scalar" (the loss itself), "dict" ({"logits", "loss"}) or "object" (Output)."""
    return TinyLM(returns)


class Vectors(Dataset):
    """Bare tensors: points near a line in 8 dimensions."""

    def __init__(self, samples: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, 1, generator=gen) @ torch.ones(1, 8) + 0.1 * torch.randn(
            samples, 8, generator=gen
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index]


def vectors(samples: int = 256) -> tuple[Vectors, Vectors]:
    return Vectors(samples, 0), Vectors(64, 1)


class AutoEncoder(nn.Module):
    """Takes a bare tensor batch and returns its reconstruction loss: a 0-dim tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.encode, self.decode = nn.Linear(8, 2), nn.Linear(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.decode(self.encode(x)), x)


def autoencoder() -> nn.Module:
    return AutoEncoder()


class Nested(Dataset):
    """Items ({"x": features, "pair": (a, b), "name": str}, target): nested, with a string leaf."""

    def __init__(self, samples: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, 4, generator=gen)
        self.pair = torch.randn(samples, 2, generator=gen)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + self.pair.sum(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> Any:
        inputs = {"x": self.x[index], "pair": (self.pair[index, 0], self.pair[index, 1]), "name": f"item-{index}"}
        return inputs, self.y[index]


def nested(samples: int = 256) -> tuple[Nested, Nested]:
    return Nested(samples, 0), Nested(64, 1)


class Regressor(nn.Module):
    """Reads the nested batch; fails loudly unless the string leaf arrived as the collated list."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 1)

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        names = inputs["name"]
        assert isinstance(names, list) and all(n.startswith("item-") for n in names), names
        a, b = inputs["pair"]
        return self.linear(torch.cat([inputs["x"], a[:, None], b[:, None]], dim=1)).squeeze(1)


def regressor() -> nn.Module:
    return Regressor()


def mse(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(output, batch[1])


def mse_and_mae(output: torch.Tensor, batch: Any, scale: float = 1.0) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss and extras to log: a tensor (mae) and a float (scale)."""
    error = output - batch[1]
    return (error**2).mean() * scale, {"mae": error.abs().mean(), "scale": scale}


def per_sample(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """Forgets to reduce: a loss per sample."""
    return (output - batch[1]) ** 2


def sgd_factory(model: nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def not_an_optimizer(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())


def step_down(step: int, total_steps: int, at: float = 0.5) -> float:
    """A schedule plug-in: full LR for the first ``at`` of the run, then a tenth."""
    return 1.0 if step < at * total_steps else 0.1


def plain_number(output: torch.Tensor, batch: Any) -> float:
    """Returns a Python number: nothing for backward() to run on."""
    return float((output - batch[1]).abs().mean())


def named_extra(output: torch.Tensor, batch: Any, name: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """A loss with one extra metric called ``name`` (a reserved one, on purpose)."""
    return (output - batch[1]).pow(2).mean(), {name: 1.0}


def own_loss(output: Any, batch: Any) -> torch.Tensor:
    """A user loss that passes the model's own loss on."""
    return output["loss"]


class ConstantLoss(nn.Module):
    """Returns {"loss"} from a dict batch with labels, whatever their shape."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.w * 2.0}


class Fixed(nn.Module):
    """Returns the given logits, row by row of the batch's indices."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.logits[index]


class PartlyUsed(nn.Module):
    """Returns its loss from one of two layers: the other's parameters never get a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.used(x), x)


def partly_used() -> nn.Module:
    return PartlyUsed()


def cross_entropy_marked(output: torch.Tensor, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Cross-entropy on (input, label) batches, with an extra metric that shows this loss was used."""
    return nn.functional.cross_entropy(output, batch[1]), {"marked": 1.0}


_TRAINING_LOSSES = [0]  # the losses computed for training in this process


def failing_loss(output: torch.Tensor, batch: Any, at: int) -> torch.Tensor:
    """Cross-entropy that raises in training's ``at``-th micro-batch, on every rank: a user's bug mid-run."""
    if torch.is_grad_enabled():
        _TRAINING_LOSSES[0] += 1
        if _TRAINING_LOSSES[0] == at:
            raise ValueError(f"the user's loss failed in micro-batch {at}")
    return nn.functional.cross_entropy(output, batch[1])
