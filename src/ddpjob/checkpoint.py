"""Checkpoint files: atomic save with an integrity manifest, verified load, and model weights.

A checkpoint is one file ``step-<N>.pt`` loadable with ``torch.load(weights_only=True)``, plus a
manifest ``step-<N>.pt.sum`` (JSON: size and CRC-32) written after it. A file without a matching
manifest is incomplete or corrupt and is never resumed from. Model weights are always stored
unwrapped: no ``module.`` prefix, whatever wrapper (DataParallel, DDP) trained them.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import re
import shutil
import sys
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch
from torch import nn

from ddpjob.errors import StorageError, UsageError, first_line

FORMAT = "ddpjob-checkpoint/1"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP, torch.compile
_STEP_FILE = re.compile(r"^step-(\d+)(\.pt)?$")  # a file, or a DCP folder (ddpjob.sharded)
_CHUNK = 16 << 20


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


def path_for(directory: Path, step: int) -> Path:
    return directory / f"step-{step}.pt"


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sum")


class _CrcWriter:
    """File wrapper that computes CRC-32 and size while torch.save writes."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.crc, self.size = f, 0, 0
        self.error: OSError | None = None  # torch.save turns our OSError into a vague RuntimeError

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        view = memoryview(data)
        try:
            while view:  # an unbuffered file may take part of it; ENOSPC raises OSError here
                view = view[self.f.write(view) or 0 :]
        except OSError as exc:
            self.error = exc
            raise
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(obj: Any, path: Path) -> None:
    """Write obj to path atomically: temp file, fsync, rename, then the manifest, fsync dir."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer: _CrcWriter | None = None
    try:
        with open(tmp, "wb", buffering=0) as f:
            writer = _CrcWriter(f)
            torch.save(obj, writer)  # type: ignore[arg-type]
            os.fsync(f.fileno())
        os.replace(tmp, path)
        manifest = json.dumps({"format": FORMAT, "size": writer.size, "crc32": writer.crc})
        mtmp = manifest_path(tmp)
        with open(mtmp, "w") as mf:
            mf.write(manifest)
            mf.flush()
            os.fsync(mf.fileno())
        os.replace(mtmp, manifest_path(path))
        _fsync_dir(path.parent)
    except (OSError, RuntimeError) as exc:
        for leftover in (tmp, manifest_path(tmp)):
            leftover.unlink(missing_ok=True)
        cause = (writer.error if writer and writer.error else None) or exc
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else first_line(cause)
        raise StorageError(
            f"cannot write checkpoint {path}: {reason}; free space or fix permissions of {path.parent}"
        ) from None


class BackgroundSave:
    """save() in a forked child process. The child sees the parent's memory as it was at the fork
    (copy-on-write), so the caller is blocked only for the fork itself, however large the state;
    the parent trains on and changes its tensors meanwhile. CPU tensors only (copy others first)."""

    def __init__(self, obj: Any, path: Path, after: Callable[[], None]) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: write, report, and leave without running the parent's exit handlers
            os.close(read_fd)
            code = 0
            try:
                save(obj, path)
                after()
            except StorageError as exc:
                os.write(write_fd, str(exc).encode())
                code = 3
            except BaseException as exc:
                os.write(write_fd, f"cannot write checkpoint {path}: {exc}".encode())
                code = 1
            finally:
                os._exit(code)
        os.close(write_fd)
        self.pid, self.fd, self.path = pid, read_fd, path

    def wait(self) -> None:
        """Until the file is on disk; raises StorageError if the child could not write it."""
        _, status = os.waitpid(self.pid, 0)
        with os.fdopen(self.fd, "rb") as f:
            message = f.read().decode(errors="replace")
        if os.waitstatus_to_exitcode(status) != 0:
            raise StorageError(message or f"cannot write checkpoint {self.path}: writer exited with status {status}")


def verify(path: Path) -> str | None:
    """None if path matches its manifest, else the reason it does not."""
    if path.is_dir():
        from ddpjob import sharded

        return sharded.verify(path)
    try:
        manifest = json.loads(manifest_path(path).read_text())
        size, crc = int(manifest["size"]), int(manifest["crc32"])
    except FileNotFoundError:
        return "no manifest (save did not finish)"
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if path.stat().st_size != size:
        return f"size {path.stat().st_size} != {size} in manifest (truncated)"
    return None if file_crc(path) == crc else "checksum mismatch (corrupt)"


def file_crc(path: Path) -> int:
    """CRC-32 of the file, read through a memory map (no copy; the pages stay cached for the load)."""
    if path.stat().st_size == 0:
        return 0
    crc = 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        for start in range(0, len(view), _CHUNK):
            crc = zlib.crc32(view[start : start + _CHUNK], crc)
        view.release()
    return crc


def identity(path: Path) -> str:
    """Content identity of a checkpoint file: its manifest's size and CRC-32, else computed."""
    if path.is_dir():
        from ddpjob import sharded

        return sharded.identity(path)
    try:
        manifest = json.loads(manifest_path(path).read_text())
        return f"{path.name}:{manifest['size']}:{manifest['crc32']}"
    except (OSError, ValueError, KeyError):
        return f"{path.name}:{path.stat().st_size}:{file_crc(path)}"


def list_steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-<N>.pt file and step-<N> DCP folder in directory, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_FILE.match(p.name))]
    return sorted(found, reverse=True)


def latest_valid(directory: Path) -> Path | None:
    """The newest checkpoint whose manifest matches; each one skipped is named in a warning."""
    for _, path in list_steps(directory):
        reason = verify(path)
        if reason is None:
            return path
        print(f"[ddpjob] warning: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
    return None


def prune(directory: Path, keep: int) -> None:
    for _, path in list_steps(directory)[keep:]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            continue
        path.unlink(missing_ok=True)
        manifest_path(path).unlink(missing_ok=True)


def read(path: Path | str, map_location: str | torch.device = "cpu", mmap: bool = True, verified: bool = False) -> Any:
    """torch.load with weights_only=True; every way a file can be bad becomes one UsageError line.
    The integrity check is skipped when the caller has just done it (``verified``)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist; check the path")
    if not verified and manifest_path(path).exists() and (reason := verify(path)):
        raise UsageError(f"checkpoint {path} failed its integrity check: {reason}; use an earlier one")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
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
            return read(path, map_location, mmap=False)
        first = first_line(exc)[:200]
        raise UsageError(
            f"{path} is not a readable PyTorch checkpoint (truncated or another format): {first}"
        ) from None


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
    """Raise one UsageError with a line per missing, unexpected or mis-shaped key."""
    expected = model.state_dict()
    problems = [f"missing key {k}" for k in expected if k not in state]
    problems += [f"unexpected key {k}" for k in state if k not in expected]
    problems += [
        f"shape mismatch for {k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise UsageError(
            f"{source} does not fit the model ({len(problems)} problems; wrong --model?):\n  " + "\n  ".join(shown)
        )


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> nn.Module:
    """Load state into model. A model built on the meta device takes the tensors as they are
    (``assign=True``: no second copy); any other model copies them in."""
    check_compatible(model, state, source)
    on_meta = any(t.is_meta for t in model.state_dict().values())
    model.load_state_dict(state, assign=on_meta)
    return model


class _Slot(NamedTuple):
    """Where a tensor sat in a broadcast state: its shape, dtype and device type."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str


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


def broadcast(state: Any, device: torch.device) -> Any:
    """Rank 0's loaded state on every rank (``--load-mode rank0``: no shared filesystem).

    The structure and small values travel pickled; each tensor's bytes go by ``dist.broadcast``
    straight from rank 0's memory-mapped file into a tensor allocated once on the receiver, so no
    rank holds more than one copy. ``device`` is where this rank's CUDA tensors belong.
    """
    import torch.distributed as dist

    tensors: list[torch.Tensor] = []

    def to_slot(t: torch.Tensor) -> _Slot:
        tensors.append(t)
        return _Slot(tuple(t.shape), t.dtype, t.device.type)

    box = [map_tensors(state, to_slot) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    wire = device if dist.get_backend() == "nccl" else torch.device("cpu")
    received = iter(tensors)

    def fill(slot: _Slot) -> torch.Tensor:
        if dist.get_rank() == 0:
            tensor = next(received)
            dist.broadcast(tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(wire), src=0)
            return tensor
        tensor = torch.empty(slot.shape, dtype=slot.dtype, device=wire)
        dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=0)
        return tensor.to(device if slot.device_type == "cuda" else "cpu")

    return map_tensors(box[0], fill)
