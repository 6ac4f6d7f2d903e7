"""The single-file checkpoint format: ``step-<N>.pt`` and its manifest ``step-<N>.pt.sum``.

The file loads with ``torch.load(weights_only=True)``. The manifest (JSON: size, checksum, and the
run that wrote it) is written after the file, so a file without a matching manifest is incomplete
or corrupt and is never resumed from. A save writes a temporary created exclusively (never through
a link), fsyncs it, renames it into place, then does the same for the manifest and fsyncs the folder.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import IO, Any

import torch

from ddpjob import checksum, fsutil
from ddpjob.errors import StorageError, UsageError, first_line

FORMAT = "ddpjob-checkpoint/1"


def path_for(directory: Path, step: int) -> Path:
    return directory / f"step-{step}.pt"


def manifest_path(path: Path) -> Path:
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


def _write_durably(path: Path, write: Any) -> None:
    """write(file) into a fresh temporary, fsync, rename to path."""
    tmp = fsutil.temp_name(path)
    try:
        with os.fdopen(fsutil.create_exclusive(tmp), "wb", buffering=0) as f:
            write(f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save(obj: Any, path: Path, run: str = "") -> None:
    """Write obj to path atomically, then its manifest (tagged with the run that wrote it), fsync dir."""
    writer: _DigestWriter | None = None

    def write_state(f: IO[bytes]) -> None:
        nonlocal writer
        writer = _DigestWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]

    try:
        _write_durably(path, write_state)
        assert writer is not None
        manifest = {
            "format": FORMAT,
            "size": writer.size,
            **writer.digest.fields(),
            **writer.blocks.fields(),
            "run": run,
        }
        _write_durably(manifest_path(path), lambda f: f.write(json.dumps(manifest).encode()))
        fsutil.fsync_dir(path.parent)
    except (OSError, RuntimeError) as exc:
        cause = (writer.error if writer and writer.error else None) or exc
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else first_line(cause)
        raise StorageError(
            f"cannot write checkpoint {path}: {reason}; free space or fix permissions of {path.parent}"
        ) from None


def manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of path, or None when there is none (or it is unreadable)."""
    try:
        found = json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def verify(path: Path, share: tuple[int, int] | None = (0, 1)) -> str | None:
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
        got = checksum.block_digests(path, mine, block)
        bad = [i for i in mine if got[i] != blocks[i]]
        return f"checksum mismatch in block {bad[0]} of {len(blocks)} (corrupt)" if bad else None
    if part != 0:  # a whole-file checksum (older manifests): one of the sharing ranks checks it
        return None
    return None if checksum.matches(path, found) else "checksum mismatch (corrupt)"  # type: ignore[arg-type]


def identity(path: Path) -> str:
    """Content identity: name, size and checksum from the manifest (computed when there is none)."""
    found = manifest(path) or {"size": path.stat().st_size, **checksum.of_file(path)}
    return f"{path.name}:{found['size']}:{checksum.value(found)}"


def run_of(path: Path) -> str:
    """The run (lineage) that wrote the checkpoint; "" for checkpoints older than run tags."""
    return str((manifest(path) or {}).get("run", ""))


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    manifest_path(path).unlink(missing_ok=True)


def read(path: Path | str, mmap: bool = True, verified: bool = False) -> Any:
    """torch.load with weights_only=True, into host memory; every way a file can be bad becomes one
    UsageError line. Tensors stay on the CPU: the model and optimizer move theirs to the rank's device,
    while RNG states must stay host tensors. The integrity check is skipped when the caller has just
    done it (``verified``)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist; check the path")
    if not verified and manifest_path(path).exists() and (reason := verify(path)):
        raise UsageError(f"checkpoint {path} failed its integrity check: {reason}; use an earlier one")
    try:
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
        if mmap and "mmap" in str(exc):  # legacy (non-zip) format files cannot be memory-mapped
            return read(path, mmap=False, verified=True)
        first = first_line(exc)[:200]
        raise UsageError(
            f"{path} is not a readable PyTorch checkpoint (truncated or another format): {first}"
        ) from None
