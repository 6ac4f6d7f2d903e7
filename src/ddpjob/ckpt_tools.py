"""`ddpjob ckpt inspect|convert`: look into and convert checkpoints, ours or anyone's.

- inspect: format, step, epoch, keys with shapes and dtypes, size, integrity, torch version,
  whether keys carry a wrapper prefix.
- convert: strip or add the ``module.`` prefix; between a plain state dict, a ddpjob checkpoint,
  a DCP folder and safetensors (model weights: one file, or a Hugging Face sharded set).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpjob import checkpoint, checkpointer, hfweights, sharded
from ddpjob.errors import UsageError
from ddpjob.weights import WRAPPER_PREFIXES, add_prefix, model_state


def describe_format(obj: Any) -> str:
    if isinstance(obj, Mapping) and obj.get("format") == "dcp":
        return "DCP folder (torch.distributed.checkpoint; model weights shown)"
    if isinstance(obj, Mapping) and obj.get("format") == checkpoint.FORMAT:
        return f"ddpjob checkpoint ({checkpoint.FORMAT})"
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        return "wrapped state dict (key 'state_dict', e.g. Lightning)"
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        return "dict with a 'model' state dict"
    return "plain state dict"


def _safetensors_form(path: Path) -> str:
    index, files = hfweights.files_of(path)
    return f"sharded safetensors ({len(files)} shards, {index.name})" if index else "safetensors (one file)"


def load_any(path: Path) -> Any:
    """A checkpoint or state dict from a torch file, the tensors of a .safetensors file or sharded
    set, or the model weights of a DCP folder."""
    if hfweights.is_weights(path):
        return hfweights.read(path)
    if problem := checkpointer.unknown_folder(path):
        raise UsageError(problem)
    if path.is_dir():
        return {"format": "dcp", "model": sharded.read_model(path)}
    return checkpoint.read(path)


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def inspect(path: Path, show: int = 50) -> list[str]:
    obj = load_any(path)
    raw_keys = next((obj[k] for k in ("model", "state_dict") if isinstance(obj.get(k), Mapping)), obj)
    weights = model_state(obj, str(path))
    form = _safetensors_form(path) if hfweights.is_weights(path) else describe_format(obj)
    prefixes = sorted({p for k in raw_keys for p in WRAPPER_PREFIXES if k.startswith(p)})
    integrity = checkpointer.verify(path) if checkpointer.checkable(path) else "no manifest"
    params = sum(t.numel() for t in weights.values())
    lines = [
        f"file:       {path} ({size_of(path) / 2**20:.2f} MiB)",
        f"format:     {form}",
        f"integrity:  {'ok (matches its manifest)' if integrity is None else integrity}",
        f"written by: torch {obj.get('torch_version', '?')}",
        f"step/epoch: {obj.get('step', '-')} / {obj.get('epoch', obj.get('progress', {}).get('epoch', '-'))}",
        f"prefix:     {', '.join(prefixes) + ' (wrapped model; ddpjob strips it on load)' if prefixes else 'none'}",
        f"contents:   {', '.join(k for k in obj if isinstance(k, str) and k not in raw_keys) or 'weights only'}",
        f"weights:    {len(weights)} tensors, {params:,} values",
    ]
    for key, tensor in list(weights.items())[:show]:
        lines.append(f"  {key:<40} {tuple(tensor.shape)!s:<20} {str(tensor.dtype).replace('torch.', '')}")
    if len(weights) > show:
        lines.append(f"  ... and {len(weights) - show} more (--all shows them)")
    return lines


def convert(src: Path, dst: Path, to: str, prefix: str, max_shard_size: str = "") -> str:
    """Write src's model weights to dst as `to` (plain, ddpjob, dcp or safetensors: one file, or with
    max_shard_size a Hugging Face sharded set in the folder dst), with or without prefix."""
    if max_shard_size and to != "safetensors":
        raise UsageError(f"--max-shard-size shards safetensors only; add --to safetensors (not --to {to})")
    if max_shard_size:
        hfweights.parse_size(max_shard_size)  # a bad size fails before a large source is read
    inputs = [src, *(hfweights.files_of(src)[1] if hfweights.is_weights(src) else [])]
    folder = dst.resolve() if max_shard_size else None  # shards are written into dst
    if any(p.resolve() == dst.resolve() or p.resolve().parent == folder for p in inputs):
        raise UsageError(f"{dst} is (or holds) the input; write the converted checkpoint elsewhere")
    check_destination(dst, to, folder is not None)
    weights = model_state(load_any(src), str(src))
    if prefix:
        weights = add_prefix(weights, prefix)
    if to == "dcp":
        sharded.write_model(weights, dst)
    elif to == "safetensors":
        return f"wrote {dst}: {hfweights.write(weights, dst, max_shard_size)} as safetensors{_prefix_note(prefix)}"
    else:
        data: dict[str, Any] = weights
        if to == "ddpjob":
            data = {"format": checkpoint.FORMAT, "model": weights, "step": 0, "torch_version": str(torch.__version__)}
        dst.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.save(data, dst)
    return f"wrote {dst}: {len(weights)} tensors as {to}{_prefix_note(prefix)}"


def check_destination(dst: Path, to: str, shards: bool) -> None:
    """UsageError unless dst can take the output: a folder of shards goes into a new or empty folder
    (an earlier set's index or shards left there would be read instead of, or mixed with, the new
    ones), a file (plain, ddpjob, one .safetensors) to a path that is no folder."""
    if shards and dst.is_dir() and (held := sorted(p.name for p in dst.iterdir())):
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        raise UsageError(
            f"{dst} is not empty (it holds {', '.join(held[:3])}{more}): shards written there would mix with what it "
            "holds; choose an empty folder or remove it"
        )
    if shards and dst.exists() and not dst.is_dir():
        raise UsageError(f"{dst} is a file; --max-shard-size writes a folder of shards: choose a new folder path")
    if not shards and to != "dcp" and dst.is_dir():
        hint = " (or add --max-shard-size to write a folder of shards)" if to == "safetensors" else ""
        raise UsageError(f"{dst} is a folder; --to {to} writes one file: give a file path{hint}")


def _prefix_note(prefix: str) -> str:
    return f" with prefix {prefix!r}" if prefix else ", no prefix"
