"""What a batch is to the loop: moved to the rank's device, passed to the model, counted.

A batch is whatever the DataLoader's default collate made of the dataset's items: a tensor, a tuple
or list (``(input, label)``), a dict of tensors (the Hugging Face form), or nested mixes of these.
Leaves that are not tensors (strings, ids) pass through untouched.

    batch = to_device(batch, device)   # every tensor leaf, non_blocking (pinned memory on CUDA)
    output = forward(model, batch)     # dict -> model(**batch); tuple/list -> model(batch[0]); tensor -> model(batch)

A dict's keys must be parameters of the model's forward (non-tensor leaves too: ids and text reach
forward as the collated lists, to use or to take in ``**kwargs``); one that is not is bad input.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpjob.checkpoint.weights import unwrap
from ddpjob.errors import UsageError


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor leaf on ``device``, its structure (dict, tuple, list, named tuple) kept."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({key: to_device(value, device) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def forward(model: nn.Module, batch: Any) -> Any:
    """The model's output for ``batch``: a dict is passed as keyword arguments, a tuple or list gives
    its first element (the input; the rest are labels), a tensor is the input."""
    if isinstance(batch, Mapping):
        try:
            return model(**batch)
        except TypeError:  # costs nothing until raised; then: were the keys the trouble?
            check_keywords(model, batch)
            raise
    if isinstance(batch, tuple | list):
        return model(batch[0])
    return model(batch)


def check_keywords(model: nn.Module, batch: Mapping[str, Any]) -> None:
    """UsageError when the user's forward cannot take the dict batch's keys as keyword arguments."""
    signature = inspect.signature(unwrap(model).forward)
    try:
        signature.bind(**batch)
    except TypeError as exc:
        raise UsageError(
            f"the batch's keys {sorted(batch)} do not fit {type(unwrap(model)).__name__}.forward"
            f"{signature} ({exc}); drop the extra keys in the dataset or collate_fn, or add **kwargs to forward"
        ) from None


def labels(batch: Any) -> torch.Tensor | None:
    """The labels of an ``(input, label)`` batch; None for any other structure."""
    if isinstance(batch, tuple | list) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    return None


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The batch's first tensor leaf, depth first; None when it holds none."""
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, tuple | list) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def size(batch: Any) -> int:
    """Samples in the batch: the first dimension of its first tensor leaf (1 when it has none)."""
    first = first_tensor(batch)
    return int(first.shape[0]) if first is not None and first.dim() else 1
