"""How a loss is computed from the model's output and the batch (``--loss``), three ways:

- the model's own loss: an output that *is* a loss (a dict with ``"loss"``, an object whose ``.loss``
  is not None, as Hugging Face's ``ModelOutput``, or a 0-dim tensor unless the batch is an
  ``(input, label)`` pair: then it is a prediction, e.g. a regression's at batch size 1) is used as
  is; under ``--strategy dp`` the per-GPU losses nn.DataParallel gathers into a vector are averaged;
- cross-entropy: else, on an ``(input, label)`` batch, ``cross_entropy(output, label)`` (the output
  may be a dict or object with ``logits``); logits ``[..., C]`` with integer labels ``[...]`` (a
  language model's ``[B, T, V]`` and ``[B, T]``) are flattened first, classes last winning over
  torch's classes-at-dim-1. On the first call, shapes and label range are checked (then no
  per-step cost); float labels must be class probabilities shaped as the logits, else they are a
  regression's targets: bad input;
- a user's function (``--loss MODULE:CALLABLE[(k=v)]``): ``fn(output, batch)`` returning a scalar
  tensor, or ``(scalar, {name: tensor | float})``, the extra metrics to log, whose names may not
  be one of the fields ddpjob logs itself (``RESERVED``).

Anything else is bad input: one line, exit 2.

    loss = Loss(cfg.loss, replicas=torch.cuda.device_count() if cfg.strategy == "dp" else 1)
    result = loss(output, batch)     # result.value, result.extras, result.kind

With gradient accumulation a step's loss is the mean of its micro-batches' (as its gradient is):
``StepMean`` adds them up on the device and gives that mean, with the extras', for the log.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ddpjob.errors import UsageError
from ddpjob.plugins import load_function
from ddpjob.train import batches

AUTO = "auto"
IGNORE_INDEX = -100  # labels that no loss counts (padding), as torch's cross_entropy and Hugging Face
# Fields of the train and eval records (metrics.py, evaluation.py, stragglers.py): an extra metric of a
# user loss named as one would overwrite it.
RESERVED = frozenset(
    {
        *("event", "time", "step", "epoch", "loss", "lr", "steps_per_s", "samples_per_s", "grad_norm", "gpu_mem_gib"),
        *("own_ms_slowest", "own_ms_fastest", "own_ms_spread", "slowest_rank", "slowest_host", "fastest_rank"),
        *("fastest_host", "weight", "val_loss", "tokens", "correct", "accuracy", "perplexity", "bits_per_token"),
        "params",
    }
)


class LossResult(NamedTuple):
    value: torch.Tensor  # 0-dim: what backward() runs on
    extras: dict[str, torch.Tensor | float]  # a user loss's extra metrics
    kind: str  # "model", "cross_entropy" or "user"


def own_loss(output: Any, batch: Any = None, replicas: int = 1) -> tuple[Any, str] | None:
    """The loss the model returned, with where it was; None when the output is not a loss. A bare
    tensor is a loss when 0-dim (or, with ``replicas`` > 1, nn.DataParallel's vector of one loss per
    replica) and the batch is not an ``(input, label)`` pair."""
    if isinstance(output, torch.Tensor):
        gathered = replicas > 1 and output.dim() == 1 and len(output) == replicas
        is_loss = (output.dim() == 0 or gathered) and batches.labels(batch) is None
        return (output, "the model's output") if is_loss else None
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


def check_extras(extras: Any, source: str, first: bool = True) -> dict[str, torch.Tensor | float]:
    """A user loss's extra metrics: a dict of names to numbers or one-element tensors; on the
    ``first`` call also none named as a field ddpjob logs itself."""
    if not isinstance(extras, Mapping) or not all(
        isinstance(v, int | float) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in extras.values()
    ):
        raise UsageError(
            f"{source} returned extras as a {describe(extras)}; give a dict of names to numbers or one-element tensors"
        )
    taken = sorted(RESERVED.intersection(map(str, extras))) if first else []
    if taken:
        raise UsageError(
            f"{source} returned extras named {', '.join(taken)}, which ddpjob logs itself; rename them (reserved: "
            f"{', '.join(sorted(RESERVED))})"
        )
    return {str(k): v.detach() if isinstance(v, torch.Tensor) else float(v) for k, v in extras.items()}


def class_scores(output: Any, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels as cross_entropy takes them: classes last (``[..., C]`` with ``[...]``) flattened
    to ``[N, C]`` and ``[N]``; anything else as given (torch's own classes-at-dim-1 layout)."""
    logits = logits_of(output)
    if isinstance(logits, torch.Tensor) and logits.dim() > 2 and logits.shape[:-1] == label.shape:
        return logits.flatten(0, -2), label.flatten()
    return logits, label


def check_labels(logits: Any, label: torch.Tensor) -> None:
    """Once, on the first batch: labels that fit the logits; else one UsageError naming both."""
    if label.is_floating_point():
        probabilities = (
            isinstance(logits, torch.Tensor)
            and logits.dim() >= 2
            and label.shape == logits.shape
            and logits.shape[1] > 1
            and bool((label >= 0).all())
            and torch.allclose(label.sum(1), torch.ones(()), atol=1e-3)
        )
        if not probabilities:
            raise UsageError(
                f"float labels ({describe(label)}) for cross-entropy on a {describe(logits)}: a regression? pass "
                "--loss MODULE:CALLABLE (e.g. mean squared error); class labels must be integers"
            )
        return
    if not isinstance(logits, torch.Tensor) or logits.dim() == 0:
        raise UsageError(
            f"the model's output is a {describe(logits)}, not class scores for cross-entropy; return logits "
            "[batch, classes] (or a dict/object with 'logits'), or pass --loss MODULE:CALLABLE"
        )
    classes = logits.shape[-1] if logits.dim() < 2 else logits.shape[1]
    expected = logits.shape[:1] + logits.shape[2:] if logits.dim() >= 2 else torch.Size([])
    if label.shape != expected:
        raise UsageError(
            f"labels of shape {list(label.shape)} do not fit logits of shape {list(logits.shape)} (labels "
            f"{list(expected)} expected); return logits [batch, classes] for labels [batch], or pass --loss MODULE:CALLABLE"
        )
    counted = label[label != IGNORE_INDEX]
    if counted.numel() and (int(counted.max()) >= classes or int(counted.min()) < 0):
        raise UsageError(
            f"labels range {int(counted.min())}..{int(counted.max())} but the model outputs {classes} classes "
            f"(0..{classes - 1}); widen the model's output or fix the labels"
        )


class Loss:
    """``--loss``: ``auto`` (the model's own loss, else cross-entropy on labels) or a user's function.
    ``replicas``: nn.DataParallel's device count under --strategy dp (its gathered losses are averaged)."""

    def __init__(self, spec: str = AUTO, replicas: int = 1) -> None:
        self.spec, self.replicas = spec, replicas
        self.user: Callable[[Any, Any], Any] | None = None if spec == AUTO else load_function(spec)
        self.checked = False  # the first call checks what later ones take on trust

    def __call__(self, output: Any, batch: Any) -> LossResult:
        result = self._user(output, batch) if self.user is not None else self._auto(output, batch)
        self.checked = True
        return result

    def _auto(self, output: Any, batch: Any) -> LossResult:
        own = own_loss(output, batch, self.replicas)
        if own is not None:
            value, source = own
            if self.replicas > 1 and isinstance(value, torch.Tensor) and value.dim() == 1:
                value = value.mean()  # nn.DataParallel gathered one loss per replica
            return LossResult(check_scalar(value, source), {}, "model")
        label = batches.labels(batch)
        if label is None:
            raise UsageError(
                f"model returned no loss and the batch has no labels: the output is a {describe(output)}, the batch "
                f"a {describe(batch)}; return a loss from forward (a scalar, a dict with 'loss' or an object with "
                "'.loss'), yield (input, label) items, or pass --loss MODULE:CALLABLE"
            )
        logits, label = class_scores(output, label)
        if not self.checked:
            check_labels(logits, label)
        return LossResult(nn.functional.cross_entropy(logits, label), {}, "cross_entropy")

    def _user(self, output: Any, batch: Any) -> LossResult:
        assert self.user is not None
        source = f"--loss {self.spec}"
        returned = self.user(output, batch)
        if isinstance(returned, tuple) and len(returned) == 2:
            value, extras = returned
            extras = check_extras(extras, source, first=not self.checked)
            return LossResult(check_scalar(value, f"the loss from {source}"), extras, "user")
        return LossResult(check_scalar(returned, f"the loss from {source}"), {}, "user")


class StepMean:
    """An optimizer step's loss and extras: their mean over its micro-batches, summed on the device (no
    host sync); with one micro-batch per step, the micro-batch's own, with no arithmetic."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.extras: dict[str, torch.Tensor | float] = {}
        self.count = 0

    def add(self, result: LossResult) -> None:
        value = result.value.detach().float()  # summed in bf16 it would lose its low bits
        self.value = value if self.value is None else self.value + value
        for name, extra in result.extras.items():
            self.extras[name] = self.extras[name] + extra if name in self.extras else extra
        self.count += 1

    def take(self) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """The mean so far, and a fresh start for the next step."""
        assert self.value is not None, "take() before add()"
        value, extras, count = self.value, self.extras, self.count
        self.value, self.extras, self.count = None, {}, 0
        if count == 1:
            return value, extras
        return value / count, {name: extra / count for name, extra in extras.items()}
