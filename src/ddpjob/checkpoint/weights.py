"""Model weights, whoever wrapped or saved them: wrapper prefixes both ways, state dicts out of
checkpoints of any shape, loading into a model (meta-built or not), and rank 0's broadcast.

Model weights are always stored unwrapped: no ``module.`` prefix, whatever wrapper (DataParallel,
DDP, torch.compile) trained them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ddpjob import log
from ddpjob.errors import UsageError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP, torch.compile


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel / torch.compile."""
    while isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if hasattr(model, "module") else model._orig_mod  # type: ignore[assignment]
    return model


def strip_prefix(state: Mapping[str, Any], prefixes: tuple[str, ...] = WRAPPER_PREFIXES) -> dict[str, Any]:
    """Remove wrapper prefixes (``module.``, ``_orig_mod.``) from every key, repeatedly."""
    out = {}
    for key, value in state.items():
        while key.startswith(prefixes):
            key = key[next(len(p) for p in prefixes if key.startswith(p)) :]
        out[key] = value
    return out


def add_prefix(state: Mapping[str, Any], prefix: str = "module.") -> dict[str, Any]:
    """The reverse: keys as a DataParallel/DDP-wrapped model's ``state_dict()`` has them."""
    return {prefix + key: value for key, value in strip_prefix(state).items()}


def model_state(obj: Any, source: str) -> dict[str, torch.Tensor]:
    """Model weights from a ddpjob checkpoint, a Lightning-style {'state_dict': ...} or a plain state dict."""
    if isinstance(obj, Mapping):
        for key in ("model", "state_dict", "model_state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(f"{source} holds no model state dict (expected tensors by parameter name)")
    return strip_prefix(obj)


def check_compatible(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise one UsageError with a line per missing, unexpected or mis-shaped key, or a float
    tensor for a non-float one (or the reverse)."""
    expected = model.state_dict()
    problems = [f"missing key {k}" for k in expected if k not in state]
    problems += [f"unexpected key {k}" for k in state if k not in expected]
    problems += [
        f"shape mismatch for {k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    problems += [
        f"dtype mismatch for {k}: checkpoint {_name(state[k].dtype)} vs model {_name(v.dtype)}"
        for k, v in expected.items()
        if k in state and state[k].is_floating_point() != v.is_floating_point()
    ]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise UsageError(
            f"{source} does not fit the model ({len(problems)} problems; wrong --model?):\n  " + "\n  ".join(shown)
        )


def with_tied(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """state, plus each key it lacks that the model ties to a key it has (weights stored once, as
    Hugging Face and ``ddpjob ckpt convert --to safetensors`` store tied weights)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    out = dict(state)
    for names in groups.values():
        if stored := next((n for n in names if n in state), None):
            out.update((n, state[stored]) for n in names if n not in state)
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_model_dtypes(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """state with each tensor whose dtype is not the model's (bf16 weights for an fp32 model) cast
    to the model's, the others as they are; rank 0 says what was cast, in one line."""
    expected = model.state_dict()
    cast = {k: expected[k].dtype for k, v in state.items() if k in expected and v.dtype != expected[k].dtype}
    if not cast:
        return dict(state)
    if not dist.is_initialized() or dist.get_rank() == 0:
        pairs = sorted({f"{_name(state[k].dtype)} -> {_name(d)}" for k, d in cast.items()})
        log.info(f"{source}: {len(cast)} of {len(state)} tensors cast to the model's dtype ({', '.join(pairs)})")
    return {k: v.to(cast[k]) if k in cast else v for k, v in state.items()}


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> nn.Module:
    """Load state into model (tied weights may be stored once), in the model's dtypes. A model built
    on the meta device takes the tensors as they are (``assign=True``: no second copy; only those of
    another dtype are cast, a copy); any other model copies them in."""
    state = with_tied(model, state)
    check_compatible(model, state, source)
    state = to_model_dtypes(model, state, source)
    on_meta = any(t.is_meta for t in model.state_dict().values())
    model.load_state_dict(state, assign=on_meta)
    return model


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each Parameter that the model uses in more than one place (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def tie(model: nn.Module, groups: list[list[str]]) -> nn.Module:
    """Make every name of each group the same Parameter again: the first name's."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)
    return model


class _Slot(NamedTuple):
    """Where a tensor sat in a broadcast state: its shape and dtype, and which tensor it is (tensors
    that share memory, such as tied weights, share one slot)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor_id: int


def storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors that are the same view of the same memory (tied weights)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with every tensor (or _Slot) leaf of its dicts, lists and tuples mapped by ``fn``;
    dicts keep their type and attributes, named tuples are left as they are."""
    if isinstance(obj, torch.Tensor | _Slot):
        return fn(obj)
    if isinstance(obj, dict):  # an OrderedDict keeps its type and attributes (state dict _metadata)
        out = type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
        if hasattr(obj, "__dict__"):
            out.__dict__.update(obj.__dict__)
        return out
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def broadcast(state: Any, group: Any) -> Any:
    """Rank 0's loaded state on every rank (``--load-mode rank0``: no shared filesystem), in host
    memory, over ``group`` (a gloo group).

    The structure and small values travel pickled; each tensor's bytes go by ``dist.broadcast``
    straight from rank 0's memory-mapped file into a tensor allocated once on the receiver, so no
    rank holds more than one copy. Tensors that share memory on rank 0 share it everywhere.
    """

    tensors: list[torch.Tensor] = []
    slots: dict[tuple[Any, ...], _Slot] = {}

    def to_slot(t: torch.Tensor) -> _Slot:
        key = storage_key(t)
        if key not in slots:
            slots[key] = _Slot(tuple(t.shape), t.dtype, len(tensors))
            tensors.append(t)
        return slots[key]

    main = dist.get_rank() == 0
    box = [map_tensors(state, to_slot) if main else None]
    dist.broadcast_object_list(box, src=0, group=group)
    received: dict[int, torch.Tensor] = {}

    def fill(slot: _Slot) -> torch.Tensor:
        if slot.tensor_id not in received:
            tensor = tensors[slot.tensor_id] if main else torch.empty(slot.shape, dtype=slot.dtype)
            dist.broadcast(tensor.detach().contiguous().reshape(-1).view(torch.uint8), src=0, group=group)
            received[slot.tensor_id] = tensor
        return received[slot.tensor_id]

    return map_tensors(box[0], fill)
