"""`ddpjob ckpt inspect|convert`: look into and convert checkpoints, ours or anyone's.

- inspect: format, step, epoch, keys with shapes and dtypes, size, integrity, torch version,
  whether keys carry a wrapper prefix.
- convert: strip or add the ``module.`` prefix; between a plain state dict, a ddpjob checkpoint,
  a DCP folder and safetensors (model weights: one file, or a Hugging Face sharded set).

SRC and DEST may be object store URLs (``s3://``; checkpoint.storage), except safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpjob.checkpoint import catalogue
from ddpjob.checkpoint.formats import dcp_folder, hf_safetensors, single_file
from ddpjob.checkpoint.storage import ObjectPath, Where
from ddpjob.checkpoint.weights import WRAPPER_PREFIXES, add_prefix, model_state
from ddpjob.errors import UsageError
from ddpjob.tools import outputs


def describe_format(obj: Any) -> str:
    if isinstance(obj, Mapping) and obj.get("format") == "dcp":
        return "DCP folder (torch.distributed.checkpoint; model weights shown)"
    if isinstance(obj, Mapping) and obj.get("format") == single_file.FORMAT:
        return f"ddpjob checkpoint ({single_file.FORMAT})"
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        return "wrapped state dict (key 'state_dict', e.g. Lightning)"
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        return "dict with a 'model' state dict"
    return "plain state dict"


def _safetensors_form(path: Path) -> str:
    index, files = hf_safetensors.files_of(path)
    return f"sharded safetensors ({len(files)} shards, {index.name})" if index else "safetensors (one file)"


def load_any(path: Where) -> Any:
    """A checkpoint or state dict from a torch file, the tensors of a .safetensors file or sharded
    set, or the model weights of a DCP folder."""
    if isinstance(path, Path) and hf_safetensors.is_weights(path):
        return hf_safetensors.read(path)
    if problem := catalogue.unknown_folder(path):
        raise UsageError(problem)
    if path.is_dir():
        return {"format": "dcp", "model": dcp_folder.read_model(path)}
    return single_file.read(path)


def size_of(path: Where) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def inspect(path: Where, show: int = 50) -> list[str]:
    obj = load_any(path)
    raw_keys = next((obj[k] for k in ("model", "state_dict") if isinstance(obj.get(k), Mapping)), obj)
    weights = model_state(obj, str(path))
    safetensors = isinstance(path, Path) and hf_safetensors.is_weights(path)
    form = _safetensors_form(path) if isinstance(path, Path) and safetensors else describe_format(obj)
    prefixes = sorted({p for k in raw_keys for p in WRAPPER_PREFIXES if k.startswith(p)})
    integrity = catalogue.verify(path) if catalogue.checkable(path) else "no manifest"
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


TARGETS = ("plain", "ddpjob", "dcp", "safetensors")  # what `ckpt convert --to` writes
WITH_MANIFEST = ("plain", "ddpjob")  # targets written with a manifest, DEST.sum


def convert(src: Where, dst: Where, to: str, prefix: str, max_shard_size: str = "") -> str:
    """Write src's model weights to dst as `to` (plain, ddpjob, dcp or safetensors: one file, or with
    max_shard_size a Hugging Face sharded set in the folder dst), with or without prefix. dst is a
    new path (or, for a folder, an empty folder) that does not overlap src: nothing is overwritten."""
    if max_shard_size and to != "safetensors":
        raise UsageError(f"--max-shard-size shards safetensors only; add --to safetensors (not --to {to})")
    if max_shard_size:
        hf_safetensors.parse_size(max_shard_size)  # a bad size fails before a large source is read
    inputs = [
        src,
        *(hf_safetensors.files_of(src)[1] if isinstance(src, Path) and hf_safetensors.is_weights(src) else []),
    ]
    folder = to == "dcp" or bool(max_shard_size)
    hint = " (or add --max-shard-size to write a folder of shards)" if to == "safetensors" and not folder else ""
    what = (
        "--max-shard-size writes a folder of shards"
        if max_shard_size
        else f"--to {to} writes {'a folder' if folder else 'one file'}"
    )
    companions = [single_file.manifest_path(dst)] if to in WITH_MANIFEST else []
    if isinstance(dst, ObjectPath):
        _check_object(dst, src, to, companions)
    else:
        local_inputs = [p for p in inputs if isinstance(p, Path)]
        dst = outputs.check(dst, local_inputs, folder, what + hint, [c for c in companions if isinstance(c, Path)])
    weights = model_state(load_any(src), str(src))
    if prefix:
        weights = add_prefix(weights, prefix)
    if to == "dcp":
        _make_parent(dst)
        dcp_folder.write_model(weights, dst)
    elif to == "safetensors" and isinstance(dst, Path):  # never an object (_check_object)
        return f"wrote {dst}: {hf_safetensors.write(weights, dst, max_shard_size)} as safetensors{_prefix_note(prefix)}"
    else:
        data: dict[str, Any] = weights
        if to == "ddpjob":
            data = {"format": single_file.FORMAT, "model": weights, "step": 0, "torch_version": str(torch.__version__)}
        _make_parent(dst)
        single_file.save(data, dst)
    return f"wrote {dst}: {len(weights)} tensors as {to}{_prefix_note(prefix)}"


def _check_object(dst: ObjectPath, src: Where, to: str, companions: list[Where]) -> None:
    """What outputs.check is for a local path: a new key, never over what the store holds."""
    if to == "safetensors":
        raise UsageError(f"--to safetensors writes a local path, not {dst}; convert to a local path, then upload it")
    source = src.url if isinstance(src, ObjectPath) else str(src)
    if dst == src or dst.url.startswith(f"{source}/") or source.startswith(f"{dst.url}/"):
        raise UsageError(f"{dst} overlaps the source {src}; choose another destination")
    for taken in (dst, *companions):
        if taken.exists():
            raise UsageError(f"{taken} exists; convert never overwrites: choose a new key or remove it")


def _make_parent(dst: Where) -> None:
    if isinstance(dst, Path):
        dst.parent.mkdir(parents=True, exist_ok=True)


def _prefix_note(prefix: str) -> str:
    return f" with prefix {prefix!r}" if prefix else ", no prefix"
