"""Model weights in the forms Hugging Face ships them: one ``.safetensors`` file, or a sharded set
(``model.safetensors.index.json`` whose ``weight_map`` names the shard holding each tensor).

Reading maps each file (safetensors' own mmap, no copy): the tensors returned are views of the
files' pages, so a model built on the meta device and given them with ``assign=True`` holds the
only copy, shared through the page cache by the ranks of a node. Writing follows Hugging Face's
naming (``model-00001-of-00003.safetensors``, ``metadata.total_size``); tensors that share memory
(tied weights) are written once, under their first name, as Hugging Face does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpjob import optional
from ddpjob.checkpoint import checksum
from ddpjob.checkpoint.weights import storage_key
from ddpjob.errors import Retriable, UsageError, first_line

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"  # what a Hugging Face folder holds when the model fits in one shard
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def is_weights(path: Path) -> bool:
    """Whether path is safetensors weights: a .safetensors file, an index file, or a folder with either."""
    if path.is_dir():
        return (path / INDEX).is_file() or (path / SINGLE).is_file()
    return path.name.endswith((".safetensors", ".safetensors.index.json"))


def files_of(path: Path) -> tuple[Path | None, list[Path]]:
    """(index or None, the weight files in order); UsageError for an unreadable index or a missing shard."""
    if path.is_dir():
        path = path / INDEX if (path / INDEX).is_file() else path / SINGLE
    if not path.name.endswith(".index.json"):
        return None, [path]
    shards = list(dict.fromkeys(weight_map(path).values()))
    for name in shards:
        if not (path.parent / name).is_file():
            raise UsageError(
                f"shard {name} named by {path} does not exist; copy the complete set ({len(shards)} shard files) "
                "next to the index"
            )
    return path, [path.parent / name for name in shards]


def weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file name."""
    try:
        found = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise UsageError(
            f"cannot read the safetensors index {index}: {first_line(exc)}; re-download or re-convert it"
        ) from None
    if not isinstance(found, dict) or not all(isinstance(v, str) and "/" not in v for v in found.values()):
        raise UsageError(f"{index} has no weight_map of tensor names to shard files; is it a safetensors index?")
    return found


SAMPLE = 64 << 10  # bytes of tensor data at each end of a shard that its identity hashes


def identity(path: Path) -> str:
    """What every rank compares to know it sees the files rank 0 chose, cheap however large the set:
    ``name:size:digest`` of the index (all of it) and of each shard, joined by ``;``. A shard's
    digest covers its header (every tensor's name, dtype, shape and offsets) and the first and last
    SAMPLE bytes of its tensor data; a file of another size is one still being copied."""
    index, files = files_of(path)
    parts = [f"{index.name}:{index.stat().st_size}:{checksum.value(checksum.of_file(index))}"] if index else []
    return ";".join([*parts, *(f"{f.name}:{f.stat().st_size}:{_layout_digest(f)}" for f in files)])


def _layout_digest(file: Path) -> checksum.Value:
    """Digest of a safetensors file's header (8 bytes of length N, then N bytes of JSON) and of the
    tensor data's first and last SAMPLE bytes: three short reads, not the whole file."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = 8 + min(int.from_bytes(f.read(8), "little"), max(size - 8, 0))
        f.seek(0)
        head = f.read(start + SAMPLE)
        f.seek(max(start + SAMPLE, size - SAMPLE))
        return checksum.digest(head + f.read(SAMPLE))


def read(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file or sharded set, memory-mapped, shard by shard."""
    safetensors = optional.require("safetensors", f"reading {path}")
    safe_open, safetensors_error = safetensors.safe_open, safetensors.SafetensorError
    index, files = files_of(path)
    wanted = weight_map(index) if index else None
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                present = list(f.keys())
                names = [k for k, v in wanted.items() if v == file.name] if wanted is not None else present
                if absent := [k for k in names if k not in present]:
                    more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
                    raise UsageError(
                        f"{index} maps {absent[0]}{more} to {file.name}, which does not hold it: the shards are "
                        "from another set; re-download or re-convert it"
                    )
                state.update((name, f.get_tensor(name)) for name in names)
        except OSError as exc:  # the storage failing (EIO, ESTALE), not the file: may clear
            raise Retriable(f"cannot read {file}: {first_line(exc)}; a restart retries") from None
        except (safetensors_error, ValueError, TypeError) as exc:  # a truncated file, a bad header, a dtype
            raise UsageError(f"{file} is not a readable safetensors file: {first_line(exc)}") from None
    return state


def parse_size(text: str) -> int:
    """Bytes in a size such as 2GB, 500MB (decimal, as Hugging Face counts), 1GiB or 4096."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--max-shard-size {text!r} must be a size such as 2GB, 500MB, 1GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def distinct(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """state as safetensors can store it: contiguous, a tensor that is another's view of the same
    memory (tied weights) dropped, any other tensor sharing memory with one kept copied."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    storages: set[int] = set()
    for name, tensor in state.items():
        key = storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        shared = tensor.untyped_storage().data_ptr() in storages
        storages.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor.detach().clone() if shared else tensor.detach().contiguous()
    return out


def shard(state: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, in shards of at most max_bytes (a larger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write(state: Mapping[str, torch.Tensor], dst: Path, max_shard_size: str = "") -> str:
    """Write state to the file dst, or (with max_shard_size) as a Hugging Face folder dst: one
    model.safetensors when it fits in one shard, else numbered shards and their index. Returns
    what was written, in words."""
    save_file = optional.require("safetensors.torch", "ddpjob ckpt convert --to safetensors").save_file
    max_bytes = parse_size(max_shard_size) if max_shard_size else 0
    tensors = distinct(state)
    dropped = f", {len(state) - len(tensors)} tied tensor(s) stored once" if len(tensors) < len(state) else ""
    if not max_bytes:
        dst.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(dst), metadata={"format": "pt"})
        return f"{len(tensors)} tensors{dropped}"
    shards = shard(tensors, max_bytes)
    dst.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file(tensors, str(dst / SINGLE), metadata={"format": "pt"})
        return f"{len(tensors)} tensors in {SINGLE}{dropped}"
    located: dict[str, str] = {}
    for number, part in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(dst / name), metadata={"format": "pt"})
        located.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    count = sum(t.numel() for t in tensors.values())
    index = {"metadata": {"total_size": total, "total_parameters": count}, "weight_map": located}
    (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return f"{len(tensors)} tensors in {len(shards)} shards and {INDEX}{dropped}"
