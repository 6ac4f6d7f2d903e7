"""The single-file checkpoint format: ``step-<N>.pt`` and its manifest ``step-<N>.pt.sum``.

The file loads with ``torch.load(weights_only=True)``. The manifest (JSON: size, checksum, and the
run that wrote it) is written after the file, so a file without a matching manifest is incomplete
or corrupt and is never resumed from. The write goes through the location's storage (checkpoint.storage): on a
local folder a temporary created exclusively (never through a link), fsynced and renamed into place,
then the same for the manifest and an fsync of the folder; in an object store (``s3://``) a stream
to the object, then the manifest as a conditional put (``If-None-Match: *``), its commit.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import IO, Any

import torch

from ddpjob.checkpoint import checksum, storage
from ddpjob.checkpoint.storage import Where
from ddpjob.errors import StorageError, UsageError, denied, first_line, transient

FORMAT = "ddpjob-checkpoint/1"


def path_for(directory: Where, step: int) -> Where:
    return directory / f"step-{step}.pt"


def manifest_path(path: Where) -> Where:
    return path.with_name(path.name + ".sum")


class _DigestWriter:
    """File wrapper that computes the checksum and size while torch.save writes."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.digest, self.blocks, self.size = f, checksum.Stream(), checksum.Blocks(), 0
        self.error: OSError | None = None  # torch.save turns our OSError into a vague RuntimeError

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")  # sizes in bytes, whatever buffer format torch.save passes
        written = view.nbytes
        self.digest.update(view)
        self.blocks.update(view)
        self.size += written
        try:
            while view:  # an unbuffered file may take part of it; ENOSPC raises OSError here
                view = view[self.f.write(view) or 0 :]
        except OSError as exc:
            self.error = exc
            raise
        return written

    def flush(self) -> None:
        self.f.flush()


def save(obj: Any, path: Where, run: str = "") -> None:
    """Write obj to path whole, then its manifest (tagged with the run that wrote it): the commit.
    A manifest already there (an earlier save of this step) goes first: it vouches for the old data."""
    writer: _DigestWriter | None = None
    store = storage.of(path)

    def write_state(f: IO[bytes]) -> None:
        nonlocal writer
        writer = _DigestWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]

    try:
        store.writing(path)
        store.delete(manifest_path(path))
        store.write(path, write_state)
        assert writer is not None
        manifest = {
            "format": FORMAT,
            "size": writer.size,
            **writer.digest.fields(),
            **writer.blocks.fields(),
            "run": run,
        }
        store.commit(manifest_path(path), json.dumps(manifest).encode())
        store.written(path)
    except (OSError, RuntimeError) as exc:
        cause = (writer.error if writer and writer.error else None) or exc
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else first_line(cause)
        raise StorageError(
            f"cannot write checkpoint {path}: {reason}; free space or fix permissions of {path.parent}"
        ) from None


def manifest(path: Where) -> dict[str, Any] | None:
    """The manifest of path, or None when there is none (or it is unreadable)."""
    try:
        found = json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def verify(path: Where, share: tuple[int, int] | None = (0, 1)) -> str | None:
    """None if path matches its manifest, else the reason it does not. ``share`` (part, parts):
    check the checksums of every parts-th block from part on, so the ranks of a node can split
    the work; None: sizes only (is the file there, whole?)."""
    if not manifest_path(path).exists():
        return "no manifest (save did not finish)"
    found = manifest(path)
    try:
        size = int(found["size"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return "unreadable manifest"
    if not path.is_file():
        return "missing"
    if path.stat().st_size != size:
        return f"size {path.stat().st_size} != {size} in manifest (truncated)"
    if share is None:
        return None
    part, parts = share
    blocks, block = found.get("blocks"), found.get("block_size")  # type: ignore[union-attr]
    if isinstance(blocks, list) and isinstance(block, int) and block > 0:
        if len(blocks) != -(-size // block):
            return f"unreadable manifest ({len(blocks)} block checksums for {size} bytes)"
        mine = range(part, len(blocks), parts)
        got = storage.block_digests(path, mine, block)
        bad = [i for i in mine if got[i] != blocks[i]]
        return f"checksum mismatch in block {bad[0]} of {len(blocks)} (corrupt)" if bad else None
    if part != 0:  # a whole-file checksum (older manifests): one of the sharing ranks checks it
        return None
    return None if storage.matches(path, found) else "checksum mismatch (corrupt)"


def identity(path: Where) -> str:
    """Content identity: name, size and checksum from the manifest (computed when there is none)."""
    found = manifest(path) or storage.checksum_fields(path)
    return f"{path.name}:{found['size']}:{checksum.value(found)}"


def run_of(path: Where) -> str:
    """The run (lineage) that wrote the checkpoint; "" for checkpoints older than run tags."""
    return str((manifest(path) or {}).get("run", ""))


def remove(path: Where) -> None:
    """The manifest first: a checkpoint half removed is never taken for a complete one."""
    storage.of(path).delete(manifest_path(path))
    storage.of(path).delete(path)


def read(path: Where | str, mmap: bool = True, verified: bool = False) -> Any:
    """torch.load with weights_only=True, into host memory; every way a file can be bad becomes one
    UsageError line. Tensors stay on the CPU: the model and optimizer move theirs to the rank's device,
    while RNG states must stay host tensors. The integrity check is skipped when the caller has just
    done it (``verified``)."""
    path = storage.location(path) if isinstance(path, str) else path
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist; check the path")
    if not verified and manifest_path(path).exists() and (reason := verify(path)):
        raise UsageError(f"checkpoint {path} failed its integrity check: {reason}; use an earlier one")
    try:
        if not isinstance(path, Path):  # an object: read whole into memory (no memory map)
            with storage.of(path).open_read(path) as f:
                return torch.load(f, map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        lines = [ln for ln in str(exc).splitlines() if "GLOBAL" in ln]
        if not lines:  # not a pickle stream at all
            raise UsageError(f"{path} is not a readable PyTorch checkpoint (unknown format): {exc}") from None
        raise UsageError(
            f"{path} was refused by torch.load(weights_only=True): {lines[0].strip()[:160]}; "
            "it holds code, not just tensors - re-save it as a plain state dict"
        ) from None
    except Exception as exc:  # any other failure to parse: truncated, zip damage, not a pickle
        if retry := transient(exc, str(path)):  # EIO, ESTALE: the storage, not the file
            raise retry from None
        if problem := denied(exc, str(path)):
            raise problem from None
        if mmap and "mmap" in str(exc):  # legacy (non-zip) format files cannot be memory-mapped
            return read(path, mmap=False, verified=True)
        first = first_line(exc)[:200]
        raise UsageError(
            f"{path} is not a readable PyTorch checkpoint (truncated or another format): {first}"
        ) from None
