"""`ddpjob ckpt inspect|convert`: look into and convert checkpoints, ours or anyone's.

- inspect: format, step, epoch, keys with shapes and dtypes, size, integrity, torch version,
  whether keys carry a wrapper prefix.
- convert: strip or add the ``module.`` prefix; between a plain state dict, a ddpjob checkpoint,
  a DCP folder and safetensors (model weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpjob import checkpoint, checkpointer, optional, sharded
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


def load_any(path: Path) -> Any:
    """A checkpoint or state dict from a torch file, the tensors of a .safetensors file, or the
    model weights of a DCP folder."""
    if path.is_dir():
        return {"format": "dcp", "model": sharded.read_model(path)}
    if path.suffix == ".safetensors" and path.is_file():
        return optional.require("safetensors.torch", f"reading {path}").load_file(str(path))
    return checkpoint.read(path)


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def inspect(path: Path, show: int = 50) -> list[str]:
    obj = load_any(path)
    raw_keys = next((obj[k] for k in ("model", "state_dict") if isinstance(obj.get(k), Mapping)), obj)
    weights = model_state(obj, str(path))
    prefixes = sorted({p for k in raw_keys for p in WRAPPER_PREFIXES if k.startswith(p)})
    integrity = checkpointer.verify(path) if checkpointer.checkable(path) else "no manifest"
    params = sum(t.numel() for t in weights.values())
    lines = [
        f"file:       {path} ({size_of(path) / 2**20:.2f} MiB)",
        f"format:     {describe_format(obj)}",
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


def convert(src: Path, dst: Path, to: str, prefix: str) -> str:
    """Write src's model weights to dst as `to` (plain, ddpjob or safetensors), with or without prefix."""
    weights = model_state(load_any(src), str(src))
    if prefix:
        weights = add_prefix(weights, prefix)
    if dst.resolve() == src.resolve():
        raise UsageError(f"{dst} is the input file; write the converted checkpoint elsewhere")
    if to == "dcp":
        sharded.write_model(weights, dst)
    elif to == "safetensors":
        save_file = optional.require("safetensors.torch", "ddpjob ckpt convert --to safetensors").save_file
        save_file({k: v.contiguous() for k, v in weights.items()}, str(dst))
    else:
        data: dict[str, Any] = weights
        if to == "ddpjob":
            data = {"format": checkpoint.FORMAT, "model": weights, "step": 0, "torch_version": str(torch.__version__)}
        dst.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.save(data, dst)
    return f"wrote {dst}: {len(weights)} tensors as {to}{f' with prefix {prefix!r}' if prefix else ', no prefix'}"
