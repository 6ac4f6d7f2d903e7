"""Sharded checkpoints with torch.distributed.checkpoint (DCP): ``--checkpoint-format dcp``.

A checkpoint is a folder ``step-<N>/``: every rank writes its part into ``.step-<N>.tmp/``, then
rank 0 writes ``ddpjob.sum`` (each file's size and checksum, and the run that wrote it), fsyncs,
and moves the folder into place (an existing one is swapped out atomically), so a folder without a
matching ``ddpjob.sum`` is incomplete. Loading reads into the live model and optimizer at any world
size (DDP replicas are identical, so resharding is reading the whole tensors). The model and
optimizer are DCP tensors; everything else (progress, scheduler, RNG, config) is one blob, read
with ``torch.load(weights_only=True)`` (DCP's own reader would unpickle it with code allowed).
DCP's ``.metadata`` file is still a pickle that DCP loads itself: load DCP folders only from
storage you trust. ``save_async`` copies the state to CPU memory and writes it from a thread
(``dcp.async_save``); ``Pending.wait`` seals the folder. Collectives go on the group the caller
passes (a gloo group with the save timeout), never the training group.

In an object store (``s3://``: checkpoint.storage) there is no rename: the parts go to their final
keys through torch's FsspecWriter, and ``ddpjob.sum``, written last as a conditional put, commits
them; a prefix without it is an incomplete save, never chosen. Rank 0 leaves ``step-<N>.writing``
beside it while it is written (checkpoint.storage): the next start removes the uncommitted steps that
record names, never a step-named prefix some other tool wrote.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ddpjob.checkpoint import atomic_fs, storage
from ddpjob.checkpoint.storage import ObjectPath, Where
from ddpjob.errors import StorageError, UsageError, denied, first_line, transient

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager

# torch.distributed.checkpoint is imported by the functions that read or write a folder's tensors,
# not with this module: it imports DTensor and sympy, seconds of start-up that a run which never
# touches a DCP folder (DDP with the single-file format) does not pay (tests/process/test_start_imports.py).
# Listing, verifying and removing folders (the catalogue's work) needs none of it.

MARKER = "ddpjob.sum"
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _blob(extra: dict[str, Any]) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    buffer.seek(0)
    return buffer


def _cause(exc: BaseException) -> BaseException:
    """The root cause. DCP wraps every rank's error in a CheckpointException (a BaseException);
    an OSError (disk full, EIO) explains the others."""
    from torch.distributed.checkpoint import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        causes = [cause for cause, _ in exc.failures.values()]
        return next((c for c in causes if isinstance(c, OSError)), causes[0])
    return exc


def _reason(exc: BaseException) -> str:
    """The root cause in one line."""
    return first_line(_cause(exc))


def _unreadable(folder: Where, exc: BaseException, problem: str) -> Exception:
    """What a failed read raises: Retriable for a storage error that may clear (EIO, ESTALE, ...),
    else UsageError naming the problem."""
    return (
        transient(_cause(exc), str(folder))
        or denied(_cause(exc), str(folder))
        or UsageError(f"{folder} {problem}: {_reason(exc)[:300]}")
    )


def _writer(where: Where) -> Any:
    """DCP's writer for a local folder or an object store prefix (torch's FsspecWriter)."""
    import torch.distributed.checkpoint as dcp

    if isinstance(where, ObjectPath):
        return storage.dcp_fsspec().FsspecWriter(where.url)
    return dcp.FileSystemWriter(str(where))


def _reader(where: Where) -> Any:
    """DCP's reader for a local folder or an object store prefix (torch's FsspecReader)."""
    import torch.distributed.checkpoint as dcp

    if isinstance(where, ObjectPath):
        return storage.dcp_fsspec().FsspecReader(where.url)
    return dcp.FileSystemReader(str(where))


def _file_records(tmp: Where) -> dict[str, dict[str, Any]]:
    """Each file's size and checksum. Every file DCP's metadata names must be there: a checkpoint
    dir that is not shared between the ranks (each node wrote its part to its own disk) cannot be
    sealed."""
    named = {info.relative_path for info in _reader(tmp).read_metadata().storage_data.values()}
    parts = {p.name: p for p in storage.of(tmp).list(tmp) if p.name != MARKER}
    if missing := sorted(named - set(parts)):
        raise OSError(
            f"{len(missing)} part(s) written by other ranks are not in {tmp} ({missing[0]}, ...): the checkpoint "
            "dir must be shared storage for --checkpoint-format dcp"
        )
    return {name: storage.checksum_fields(parts[name]) for name in sorted(parts)}


def _seal(tmp: Where, run: str, files: dict[str, dict[str, Any]] | None = None) -> None:
    """Write the marker (the file records, computed here unless given): the commit."""
    files = _file_records(tmp) if files is None else files
    storage.of(tmp).commit(tmp / MARKER, json.dumps({"files": files, "run": run}).encode())


def _finish(tmp: Where, final: Where, run: str, files: dict[str, dict[str, Any]] | None = None) -> None:
    """Rank 0: seal the folder and publish it (locally: move it into place)."""
    _seal(tmp, run, files)
    storage.of(final).publish(tmp, final)
    storage.of(final).written(final)


def _storage_error(final: Where, exc: BaseException) -> StorageError:
    reason = _reason(exc)
    # torch's zip writer may report a short write as "unexpected pos"
    if "No space left" not in reason and isinstance(final, Path):
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(final.parent)
            if usage.free < min(64 << 20, usage.total // 100):
                reason = f"No space left on device ({usage.free >> 10} KiB free; {reason})"
    return StorageError(f"cannot write checkpoint {final}: {reason}; free space or fix permissions of {final.parent}")


def _begin(directory: Where, step: int, group: dist.ProcessGroup | None) -> tuple[Where, Where]:
    """Collective: rank 0 clears what an interrupted save left where this one writes (in an object
    store, that is the final prefix: its marker first). (final, temp) folders."""
    final = directory / f"step-{step}"
    tmp = storage.of(final).staging(final)
    if not _distributed() or dist.get_rank() == 0:
        if isinstance(tmp, Path):
            if tmp.is_symlink():  # never write through a link planted at the predictable name
                tmp.unlink()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        else:
            storage.of(tmp).writing(tmp)
            remove(tmp)
    if _distributed():
        dist.barrier(group=group)
    return final, tmp


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state, "extra": _blob(extra)}


def save(
    directory: Where,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    group: dist.ProcessGroup | None,
    run: str,
) -> Where:
    """Collective: every rank calls it. Returns the folder written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    final, tmp = _begin(directory, step, group)
    try:
        dcp.save(
            _state(model, optimizer, extra),
            storage_writer=_writer(tmp),
            process_group=group,
            no_dist=not _distributed(),
        )
        if _distributed():
            dist.barrier(group=group)
        if not _distributed() or dist.get_rank() == 0:
            _finish(tmp, final, run)
    except (OSError, RuntimeError, CheckpointException) as exc:
        raise _storage_error(final, exc) from None
    return final


def reusable_stager() -> DefaultStager:
    """Copies the state to CPU memory for an async save and keeps that copy for the next save,
    which then copies into it instead of allocating (measured: 0.83 s first, 0.2 s after, 3 GiB)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
    )
    return DefaultStager(options)


class Pending:
    """A save in flight (``--save-mode async``): each rank's part is written by a thread that uses
    its own gloo group. On rank 0 a second thread checksums the files as soon as the write is
    done, off the loop's path; ``wait`` then seals the folder there and calls ``after``."""

    def __init__(self, future: Future[Any], tmp: Where, final: Where, after: Callable[[Where], None], run: str) -> None:
        self.future, self.tmp, self.final, self.after, self.run = future, tmp, final, after, run
        self.sealing = not _distributed() or dist.get_rank() == 0
        self.files: dict[str, dict[str, Any]] | None = None
        self.records = threading.Thread(target=self._record, name="ddpjob-dcp-checksums", daemon=True)
        if self.sealing:
            self.records.start()

    def _record(self) -> None:
        with contextlib.suppress(BaseException):  # wait() sees the write's own error, or recomputes
            self.future.result()
            self.files = _file_records(self.tmp)

    def wait(self) -> None:
        from torch.distributed.checkpoint import CheckpointException

        try:
            self.future.result()  # on rank 0 this returns once DCP's metadata, written last, is there
            if self.sealing:
                self.records.join()
                _finish(self.tmp, self.final, self.run, self.files)
                self.after(self.final)
        except (OSError, RuntimeError, CheckpointException) as exc:
            raise _storage_error(self.final, exc) from None


def save_async(
    directory: Where,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    barrier_group: dist.ProcessGroup | None,
    writer_group: dist.ProcessGroup | None,
    after: Callable[[Where], None],
    run: str,
    stager: DefaultStager | None = None,
) -> Pending:
    """Collective: copies the state to CPU memory (the only part the loop waits for) and returns.
    The writer thread's collectives use writer_group, so that the loop's own save collectives on
    barrier_group never interleave with them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    final, tmp = _begin(directory, step, barrier_group)
    try:
        future = dcp.async_save(
            _state(model, optimizer, extra),
            storage_writer=_writer(tmp),
            process_group=writer_group,
            no_dist=not _distributed(),
            async_stager=stager,
        )
    except (OSError, RuntimeError, CheckpointException) as exc:
        raise _storage_error(final, exc) from None
    assert isinstance(future, Future)  # a stager that copies before returning: the upload future itself
    return Pending(future, tmp, final, after, run)


def write_model(weights: dict[str, torch.Tensor], final: Where) -> None:
    """One process: model weights alone as a DCP folder (for `ddpjob ckpt convert --to dcp`). An
    existing (empty) folder is written into, never replaced: it may be a mount point, and keeps its
    mode and owner; its files move in from a temporary inside it, the marker last. In an object
    store the parts go to their keys and the marker commits them."""
    import torch.distributed.checkpoint as dcp

    if isinstance(final, ObjectPath):
        dcp.save({"model": weights}, storage_writer=_writer(final), no_dist=True)
        _seal(final, "")
        return
    into = final.is_dir()
    tmp = final / atomic_fs.temp_name(final).name if into else atomic_fs.temp_name(final)  # this process's own
    try:
        dcp.save({"model": weights}, checkpoint_id=str(tmp), no_dist=True)
        if into:
            _seal(tmp, "")
            for part in sorted(tmp.iterdir(), key=lambda p: p.name == MARKER):  # no marker: not a checkpoint yet
                os.replace(part, final / part.name)
            atomic_fs.fsync_dir(final)
        else:
            _finish(tmp, final, "")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _marker(folder: Where) -> dict[str, Any]:
    found = json.loads((folder / MARKER).read_text())
    if not isinstance(found, dict) or not isinstance(found.get("files"), dict):
        raise ValueError(MARKER)
    return found


def verify(folder: Where, share: tuple[int, int] | None = (0, 1)) -> str | None:
    """None if every file the marker lists is there with its size and checksum, else the reason.
    ``share`` (part, parts): checksum every parts-th file from part on (the ranks of a node split
    the work); None: sizes only. Markers written before checksums list sizes only."""
    try:
        files = _marker(folder)["files"]
    except FileNotFoundError:
        return f"no {MARKER} (save did not finish)"
    except (OSError, ValueError, KeyError):
        return f"unreadable {MARKER}"
    for index, (name, entry) in enumerate(sorted(files.items())):
        path = folder / name
        size = entry["size"] if isinstance(entry, dict) else entry
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is missing or truncated"
        mine = share is not None and index % share[1] == share[0]
        if mine and isinstance(entry, dict) and not storage.matches(path, entry):
            return f"{name} fails its checksum (corrupt)"
    return None


def identity(folder: Where) -> str:
    return f"{folder.name}:{(folder / MARKER).read_text()}"


def run_of(folder: Where) -> str:
    """The run (lineage) that wrote the folder; "" for folders older than run tags."""
    try:
        return str(_marker(folder).get("run", ""))
    except (OSError, ValueError):
        return ""


def remove(folder: Where) -> None:
    """The marker first: a folder half removed is never taken for a complete checkpoint."""
    store = storage.of(folder)
    store.delete(folder / MARKER)
    store.delete(folder)


def _safe_load(stream: io.BytesIO) -> Any:
    """torch.load(weights_only=True); a pickle that would import code is one line (UsageError)."""
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln] or [first_line(exc)]
        raise UsageError(f"refused by torch.load(weights_only=True): {lines[0][:160]}") from None


def _safe_planner() -> Any:
    """DCP's default planner unpickles byte items with ``weights_only=False``, so a crafted
    ``.distcp`` file could run code. This one reads them with ``weights_only=True`` (the BytesIO
    wrapper DCP stores is the only class allowed) and hands DCP a re-serialised copy."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, ReadItem

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            with torch.serialization.safe_globals([io.BytesIO]):
                obj = _safe_load(value)
            safe = io.BytesIO()
            torch.save(obj, safe)
            safe.seek(0)
            super().load_bytes(read_item, safe)

    return SafeLoadPlanner()


def _load(state: dict[str, Any], folder: Where, group: dist.ProcessGroup | None = None, alone: bool = True) -> None:
    """dcp.load with the safe planner: each process on its own (``alone``), or collectively on group."""
    import torch.distributed.checkpoint as dcp

    no_dist = alone or not _distributed()
    dcp.load(state, storage_reader=_reader(folder), planner=_safe_planner(), process_group=group, no_dist=no_dist)


def _check(folder: Where) -> None:
    if reason := verify(folder):
        raise UsageError(f"checkpoint {folder} failed its integrity check: {reason}; use an earlier one")


def load(
    folder: Where,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None,
    verified: bool = False,
) -> dict[str, Any]:
    """Collective on group when distributed: read the folder into model and optimizer; return the
    rest. ``verified``: the caller has just checked the folder against its marker."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not verified:
        _check(folder)
    model_state, optim_state = get_state_dict(model, optimizer)
    template: dict[str, Any] = {"model": model_state, "optimizer": optim_state, "extra": io.BytesIO()}
    try:
        _load(template, folder, group, alone=False)
    except (Exception, CheckpointException) as exc:  # a key or shape the model lacks, unreadable files
        raise _unreadable(folder, exc, "does not fit the model or is unreadable") from None
    set_state_dict(model, optimizer, model_state_dict=template["model"], optim_state_dict=template["optimizer"])
    template["extra"].seek(0)
    extra: dict[str, Any] = _safe_load(template["extra"])
    return extra


def read_extra(folder: Where) -> dict[str, Any]:
    """One process: what a checkpoint holds besides the model and optimizer (progress, config, ...)."""
    template: dict[str, Any] = {"extra": io.BytesIO()}
    _load(template, folder)
    template["extra"].seek(0)
    extra: dict[str, Any] = _safe_load(template["extra"])
    return extra


def read_model(folder: Where, verified: bool = False) -> dict[str, torch.Tensor]:
    """The model weights of a DCP folder, as a plain state dict in host memory (each process reads
    all of them: what ``--init-from`` needs at any world size and under any wrapper)."""
    from torch.distributed.checkpoint import CheckpointException, TensorStorageMetadata

    if not verified:
        _check(folder)
    metadata = _reader(folder).read_metadata().state_dict_metadata
    weights = {
        key[len("model.") :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not weights:
        raise UsageError(f"{folder} holds no model weights")
    try:
        _load({"model": weights}, folder)
    except (Exception, CheckpointException) as exc:
        raise _unreadable(folder, exc, "is unreadable") from None
    return weights
