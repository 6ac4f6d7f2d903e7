"""What evaluation reports on the validation set, each rank taking every world_size-th sample:

- every job: ``val_loss``, the loss of ``--loss`` averaged over the set;
- classifiers (the cross-entropy path): ``accuracy``;
- token models (the model's own loss on a dict batch with integer ``"labels"`` of shape [batch,
  sequence], which the model shifts as Hugging Face's do): the loss weighted by the tokens predicted (labels[..., 1:] != -100),
  ``perplexity`` (exp of it) and ``bits_per_token`` (it / ln 2);
- a user loss (``--loss``): weighted by samples, its extras the same way (under their own names, apart
  from the sums here, so an extra may be named ``samples``).

A batch whose labels are all ignored (-100, padding) weighs 0 and adds nothing (its loss, a mean over
no labels, is NaN), whichever the loss; a pass in which no rank counted a label is bad input: one line.

Sums are taken in float64 and added over ranks with one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddpjob.distenv import DistEnv
from ddpjob.errors import UsageError
from ddpjob.train import batches, feeds
from ddpjob.train.losses import IGNORE_INDEX, Loss, LossResult, class_scores


def token_count(batch: Any) -> torch.Tensor | None:
    """Tokens a token model's loss averages over: of integer ``labels`` per sequence, those that are
    not -100, the first of each left out (the model shifts: it predicts nothing); None for other batches."""
    label = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(label, torch.Tensor) and label.dim() == 2 and not label.is_floating_point():
        return (label[..., 1:] != IGNORE_INDEX).sum()
    return None


EXTRA = "extra:"  # a user loss's extras are summed under EXTRA + name, apart from the sums below
# ("samples", "weight", ...), so that an extra may be named as one of them


def counted_labels(batch: Any) -> torch.Tensor | None:
    """Whether a batch has a label that counts (not -100): of its integer labels (an ``(input, label)``
    pair's, or a dict's ``"labels"``); None for a batch without them."""
    label = batches.labels(batch)
    if label is None and isinstance(batch, Mapping):
        label = batch.get("labels")
    if isinstance(label, torch.Tensor) and not label.is_floating_point():
        return (label != IGNORE_INDEX).any()
    return None


def weighed(result: LossResult, output: Any, batch: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """One batch's sums: its samples, the weight (a token model's counted tokens, a classifier's counted
    labels, else samples), the weighted loss and extras, and for classifiers the correct predictions.
    A batch of weight 0 (only ignored labels: its loss is a mean over nothing, NaN) adds nothing; so
    does a user loss's batch whose integer labels are all ignored."""
    tokens = token_count(batch) if result.kind == "model" else None  # a user loss's own weighting is unknown
    samples = torch.tensor(float(batches.size(batch)), dtype=torch.float64, device=device)
    weight = tokens.double() if tokens is not None else samples
    sums: dict[str, torch.Tensor] = {"samples": samples}
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
    any_counted = counted_labels(batch) if result.kind == "user" else None
    if any_counted is not None:
        weight = torch.where(any_counted, samples, torch.zeros_like(samples))

    def times_weight(value: torch.Tensor | float) -> torch.Tensor:
        value = torch.as_tensor(value, device=device).detach().double().reshape(())
        return torch.where(weight > 0, value * weight, torch.zeros_like(value))  # not NaN x 0

    sums |= {"weight": weight, "val_loss": times_weight(result.value)}
    for name, value in result.extras.items():
        sums[EXTRA + name] = times_weight(value)
    return sums


def in_step(loader: Iterable[Any], device: torch.device, lockstep: bool) -> Iterator[Any]:
    """(batch, counted) for each of loader's batches; ``lockstep`` with several ranks: then
    (a spare batch, False) until no rank has batches left, agreed by one all-gather per batch. The
    spare is the rank's own last batch, or, for a rank that had none (an empty share), the first
    batch of the lowest rank that has one, sent to it: every rank still joins every forward."""
    if not (lockstep and dist.is_initialized() and dist.get_world_size() > 1):
        yield from ((batch, True) for batch in loader)
        return
    mine, spare = iter(loader), None
    flags = [torch.zeros(2, device=device) for _ in range(dist.get_world_size())]
    while True:
        batch = next(mine, None)
        spare = batch if batch is not None else spare
        mine_flags = torch.tensor([float(batch is not None), float(spare is None)], device=device)
        dist.all_gather(flags, mine_flags)  # [has a batch now, has no spare] of every rank
        has = [bool(f[0].item()) for f in flags]
        if not any(has):
            return
        if any(f[1].item() for f in flags):  # a rank with no batch yet: the lowest rank with one sends it
            source = has.index(True)
            sent = [batch if dist.get_rank() == source else None]
            dist.broadcast_object_list(sent, src=source)
            spare = spare if spare is not None else sent[0]
        yield (batch, True) if batch is not None else (spare, False)


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
    model: nn.Module,
    val_set: Dataset[Any],
    loss: Loss,
    env: DistEnv,
    device: torch.device,
    batch_size: int,
    lockstep: bool = False,
) -> dict[str, float]:
    """The metrics above on ``val_set``, the same on every rank. ``lockstep``: every forward is a
    collective (fsdp2), so each rank runs as many as the rank with the most batches, repeating
    one of its batches (counted once) once its own are done."""
    model.eval()
    shard = feeds.eval_shard(val_set, env)
    totals: dict[str, torch.Tensor] = {}
    for batch, counted in in_step(DataLoader(shard, batch_size=batch_size), device, lockstep):
        batch = batches.to_device(batch, device)
        output = batches.forward(model, batch)
        if not counted:
            continue
        for name, value in weighed(loss(output, batch), output, batch, device).items():
            totals[name] = totals[name] + value if name in totals else value
    model.train()
    summed = all_reduced(totals, device)
    weight = summed.pop("weight", 0.0)
    if not summed.pop("samples", 0.0):  # the same sums on every rank: all of them stop here
        raise UsageError(
            "the validation data yielded no samples on any rank; a validation IterableDataset must start "
            "anew at set_epoch(0) before each evaluation (or give --data a training set only)"
        )
    if not weight:
        raise UsageError(
            f"every label of the validation data is {IGNORE_INDEX} (ignored; for a token model, every label it "
            "predicts: labels[..., 1:]) on every rank, so val_loss has nothing to average; give the validation "
            "set labels that count (or give --data a training set only)"
        )
    result = {"val_loss": summed.pop("val_loss", 0.0) / weight}
    if "correct" in summed:
        result["accuracy"] = summed.pop("correct") / weight
    if summed.pop("tokens", 0.0):
        result["perplexity"] = math.exp(min(result["val_loss"], 700.0))
        result["bits_per_token"] = result["val_loss"] / math.log(2)
    result.update(
        {name.removeprefix(EXTRA): value / weight for name, value in summed.items() if name.startswith(EXTRA)}
    )
    return result
