"""How a loss is computed from the model's output and the batch (``--loss``), three ways:

- the model's own loss: an output that *is* a loss (a 0-dim tensor, a dict with ``"loss"``, or an
  object whose ``.loss`` is not None, as Hugging Face's ``ModelOutput``) is used as is;
- cross-entropy: else, on an ``(input, label)`` batch, ``cross_entropy(output, label)`` (the output
  may be a dict or object with ``logits``);
- a user's function (``--loss MODULE:CALLABLE[(k=v)]``): ``fn(output, batch)`` returning a scalar
  tensor, or ``(scalar, {name: tensor | float})``, the extra metrics to log.

Anything else is bad input: one line, exit 2.

    loss = Loss(cfg.loss)
    result = loss(output, batch)     # result.value, result.extras, result.kind
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ddpjob import batches
from ddpjob.errors import UsageError
from ddpjob.plugins import load_function

AUTO = "auto"


class LossResult(NamedTuple):
    value: torch.Tensor  # 0-dim: what backward() runs on
    extras: dict[str, torch.Tensor | float]  # a user loss's extra metrics
    kind: str  # "model", "cross_entropy" or "user"


def own_loss(output: Any) -> tuple[Any, str] | None:
    """The loss the model returned, with where it was; None when the output is not a loss."""
    if isinstance(output, torch.Tensor):
        return (output, "the model's output") if output.dim() == 0 else None
    if isinstance(output, Mapping):
        value = output.get("loss")
        return (value, "the model's output['loss']") if value is not None else None
    value = getattr(output, "loss", None)
    return (value, "the model's output.loss") if value is not None else None


def logits_of(output: Any) -> Any:
    """Class scores from an output: itself, or its ``logits`` (dict key or attribute)."""
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    return getattr(output, "logits", output)


def describe(value: Any) -> str:
    """A short description of a value for an error message: 'tensor of shape [8, 10]', "dict with keys ['x']"."""
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {list(value.shape)}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {sorted(map(str, value))}"
    if isinstance(value, tuple | list):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def check_scalar(value: Any, source: str) -> torch.Tensor:
    """``value`` if it is a 0-dim tensor; else one UsageError naming ``source`` and the fix."""
    if not isinstance(value, torch.Tensor):
        raise UsageError(f"{source} is a {describe(value)}, not a scalar tensor; return the loss as a 0-dim tensor")
    if value.dim() != 0:
        raise UsageError(
            f"{source} is a {describe(value)}, not a scalar; reduce it to one number (e.g. .mean()) before returning it"
        )
    return value


def check_extras(extras: Any, source: str) -> dict[str, torch.Tensor | float]:
    """A user loss's extra metrics: a dict of names to numbers or one-element tensors."""
    if not isinstance(extras, Mapping) or not all(
        isinstance(v, int | float) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in extras.values()
    ):
        raise UsageError(
            f"{source} returned extras as a {describe(extras)}; give a dict of names to numbers or one-element tensors"
        )
    return {str(k): v.detach() if isinstance(v, torch.Tensor) else float(v) for k, v in extras.items()}


class Loss:
    """``--loss``: ``auto`` (the model's own loss, else cross-entropy on labels) or a user's function."""

    def __init__(self, spec: str = AUTO) -> None:
        self.spec = spec
        self.user: Callable[[Any, Any], Any] | None = None if spec == AUTO else load_function(spec)

    def __call__(self, output: Any, batch: Any) -> LossResult:
        if self.user is not None:
            return self._user(output, batch)
        own = own_loss(output)
        if own is not None:
            return LossResult(check_scalar(*own), {}, "model")
        label = batches.labels(batch)
        if label is None:
            raise UsageError(
                f"model returned no loss and the batch has no labels: the output is a {describe(output)}, the batch "
                f"a {describe(batch)}; return a loss from forward (a scalar, a dict with 'loss' or an object with "
                "'.loss'), yield (input, label) items, or pass --loss MODULE:CALLABLE"
            )
        return LossResult(nn.functional.cross_entropy(logits_of(output), label), {}, "cross_entropy")

    def _user(self, output: Any, batch: Any) -> LossResult:
        assert self.user is not None
        source = f"--loss {self.spec}"
        returned = self.user(output, batch)
        if isinstance(returned, tuple) and len(returned) == 2:
            value, extras = returned
            return LossResult(check_scalar(value, f"the loss from {source}"), check_extras(extras, source), "user")
        return LossResult(check_scalar(returned, f"the loss from {source}"), {}, "user")
