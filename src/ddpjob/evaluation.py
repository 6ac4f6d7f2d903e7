"""What evaluation reports on the validation set, each rank taking every world_size-th sample:

- every job: ``val_loss``, the loss of ``--loss`` averaged over the set;
- classifiers (the cross-entropy path): ``accuracy``;
- token models (the model's own loss on a dict batch with integer ``"labels"`` of shape [batch,
  sequence], which the model shifts as Hugging Face's do): the loss weighted by the tokens predicted (labels[..., 1:] != -100),
  ``perplexity`` (exp of it) and ``bits_per_token`` (it / ln 2);
- a user loss's extra metrics, averaged the same way.

Sums are taken in float64 and added over ranks with one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddpjob import batches, streams
from ddpjob.distenv import DistEnv
from ddpjob.errors import UsageError
from ddpjob.losses import IGNORE_INDEX, Loss, LossResult, class_scores


def token_count(batch: Any) -> torch.Tensor | None:
    """Tokens a token model's loss averages over: of integer ``labels`` per sequence, those that are
    not -100, the first of each left out (the model shifts: it predicts nothing); None for other batches."""
    label = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(label, torch.Tensor) and label.dim() == 2 and not label.is_floating_point():
        return (label[..., 1:] != IGNORE_INDEX).sum()
    return None


def weighed(result: LossResult, output: Any, batch: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """One batch's sums: the weight (a token model's counted tokens, a classifier's counted labels, else
    samples), the weighted loss and extras, and for classifiers the correct predictions."""
    tokens = token_count(batch) if result.kind == "model" else None  # a user loss's own weighting is unknown
    weight = tokens.double() if tokens is not None else torch.tensor(float(batches.size(batch)), device=device)
    sums: dict[str, torch.Tensor] = {}
    if tokens is not None:
        sums["tokens"] = weight
    label = batches.labels(batch)
    if result.kind == "cross_entropy" and label is not None:
        logits, label = class_scores(output, label)
        if not label.is_floating_point():  # class probabilities have no one right answer
            counted = label != IGNORE_INDEX  # as cross_entropy averages: over the labels it counts
            weight = counted.sum().double()
            hits = (logits.argmax(1 if logits.dim() > 1 else 0) == label) & counted
            sums["correct"] = hits.sum().double()
    sums |= {"weight": weight, "val_loss": result.value.detach().double() * weight}
    for name, value in result.extras.items():
        sums[name] = torch.as_tensor(value, device=device).double().reshape(()) * weight
    return sums


def all_reduced(totals: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """Totals summed over ranks, under the union of the names every rank has (a rank may have seen no batch)."""
    names = sorted(totals)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, names)
        names = sorted(set().union(*every))
        zero = torch.zeros((), dtype=torch.float64, device=device)
        stacked = torch.stack([totals.get(name, zero) for name in names])
        dist.all_reduce(stacked)
        return dict(zip(names, stacked.tolist(), strict=True))
    return {name: float(totals[name]) for name in names}


@torch.no_grad()
def evaluate(
    model: nn.Module, val_set: Dataset[Any], loss: Loss, env: DistEnv, device: torch.device, batch_size: int
) -> dict[str, float]:
    """The metrics above on ``val_set``, the same on every rank."""
    model.eval()
    shard = streams.eval_shard(val_set, env)
    totals: dict[str, torch.Tensor] = {}
    for batch in DataLoader(shard, batch_size=batch_size):
        batch = batches.to_device(batch, device)
        output = batches.forward(model, batch)
        for name, value in weighed(loss(output, batch), output, batch, device).items():
            totals[name] = totals[name] + value if name in totals else value
    model.train()
    summed = all_reduced(totals, device)
    weight = summed.pop("weight", 0.0)
    if not weight:  # the same sum on every rank: all of them stop here
        raise UsageError(
            "the validation data yielded no samples on any rank; a validation IterableDataset must start "
            "anew at set_epoch(0) before each evaluation (or give --data a training set only)"
        )
    result = {"val_loss": summed.pop("val_loss", 0.0) / weight}
    if "correct" in summed:
        result["accuracy"] = summed.pop("correct") / weight
    if summed.pop("tokens", 0.0):
        result["perplexity"] = math.exp(min(result["val_loss"], 700.0))
        result["bits_per_token"] = result["val_loss"] / math.log(2)
    result.update({name: value / weight for name, value in summed.items()})
    return result
