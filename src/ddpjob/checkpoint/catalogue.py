"""What a checkpoint dir holds: the steps, which are complete and verified, the newest valid one,
pruning by lineage and the leftovers of killed saves. Pure reads and deletions, no collectives.
A dir is a local folder or an object store prefix (checkpoint.storage)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType

from ddpjob import log
from ddpjob.checkpoint import atomic_fs, storage
from ddpjob.checkpoint.formats import dcp_folder, hf_safetensors, single_file
from ddpjob.checkpoint.storage import ObjectPath, Where

_STEP = re.compile(
    r"^step-(\d+)(\.pt)?$"
)  # a file (ddpjob.checkpoint.formats.single_file), or a DCP folder (ddpjob.checkpoint.formats.dcp_folder)


def format_of(path: Where) -> ModuleType:
    """The format module that reads path: safetensors weights (a file, or a Hugging Face folder or
    index), else a folder is DCP and a file the single-file format. A ddpjob checkpoint (named
    ``step-N``) is never safetensors: only the other two can verify, remove or tell its run."""
    if isinstance(path, Path) and step_of(path) is None and hf_safetensors.is_weights(path):
        return hf_safetensors
    return dcp_folder if path.is_dir() else single_file


def unknown_folder(path: Where) -> str:
    """Why path, a folder, is none of the forms ddpjob reads ("" if it is one): neither safetensors
    weights nor a DCP checkpoint (DCP's .metadata, or ddpjob's marker of one)."""
    if (
        not path.is_dir()
        or format_of(path) is not dcp_folder
        or any((path / n).exists() for n in (".metadata", dcp_folder.MARKER))
    ):
        return ""
    found = sorted(p.name for p in path.iterdir())
    held = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "") if found else "nothing"
    torch_file = next((path / n for n in found if n.endswith((".bin", ".pt", ".pth"))), None)
    fix = f"name the torch file itself ({torch_file})" if torch_file else "name a weights file itself"
    return (
        f"{path} holds {held}: no safetensors weights ({hf_safetensors.SINGLE} or {hf_safetensors.INDEX}) and no DCP "
        f"checkpoint (.metadata); {fix}"
    )


def step_of(path: Where) -> int | None:
    return int(m.group(1)) if (m := _STEP.match(path.name)) else None


def list_steps(directory: Where) -> list[tuple[int, Where]]:
    """(step, path) of every step-<N>.pt file and step-<N> DCP folder in directory, newest first."""
    found = storage.of(directory).list(directory)
    return sorted(((s, p) for p in found if (s := step_of(p)) is not None), key=lambda sp: sp[0], reverse=True)


FULL: tuple[int, int] = (0, 1)  # verify every checksum; (part, parts) a share of them; None sizes only


def verify(path: Where, share: tuple[int, int] | None = FULL) -> str | None:
    return format_of(path).verify(path, share)


def latest_valid(
    directory: Where, share: tuple[int, int] | None = FULL, skip: frozenset[str] = frozenset()
) -> Where | None:
    """The newest checkpoint whose manifest matches (checked as far as ``share`` says), other than
    those named in ``skip``; each one skipped for a reason is named in a warning."""
    for _, path in list_steps(directory):
        if path.name in skip:
            continue
        reason = verify(path, share)
        if reason is None:
            return path
        log.warning(f"skipping checkpoint {path}: {reason}")
    return None


def has_manifest(path: Where) -> bool:
    """Whether path has ddpjob's integrity record (safetensors weights never do: ddpjob does not
    seal them, and a stray one beside them is not theirs)."""
    if format_of(path) is hf_safetensors:
        return False
    return (path / dcp_folder.MARKER if path.is_dir() else single_file.manifest_path(path)).exists()


def checkable(path: Where) -> bool:
    """Whether path is held to an integrity record: a DCP folder always (ddpjob's marker), a file
    when it has a manifest (a plain state dict or safetensors weights from elsewhere have none)."""
    return format_of(path) is dcp_folder or has_manifest(path)


def complete(directory: Where) -> list[tuple[int, Where]]:
    """Checkpoints whose save finished (they have a manifest), newest first, without reading them."""
    return [(s, p) for s, p in list_steps(directory) if has_manifest(p)]


def prune(directory: Where, keep: int, run: str, saved: int, mapped: Where | None = None) -> None:
    """Remove all but the newest ``keep`` complete checkpoints of lineage ``run`` up to step ``saved``
    (the one just written); nobody else's. Later ones of the run can only be corrupt ones that a
    resume skipped: they neither count nor go, and later saves overwrite them. ``mapped``, the file
    this process resumed from, stays while the process lives: tensors never written since are still
    backed by its pages (removed under a live mapping on NFS they turn stale: SIGBUS). The next start's
    saves prune it."""
    own = [p for s, p in complete(directory) if s <= saved and format_of(p).run_of(p) == run]
    for path in own[keep:]:
        if mapped is None or path.resolve() != mapped.resolve():
            format_of(path).remove(path)


def remove_temporaries(directory: Where) -> list[str]:
    """Remove what killed saves left (``.step-N.pt.tmp-*``, ``.step-N.tmp/``, ...). Only safe while
    holding the dir lock: then no live save of any job is writing them. In an object store: the
    steps that a save began (its ``.writing`` record) and never committed (no manifest), and incomplete
    multipart uploads; never a step-named object no save of ddpjob left (a user's, another tool's). An
    object store has no lock, so one job writes to a prefix at a time (docs/checkpoints.md)."""
    if isinstance(directory, ObjectPath):
        store, removed = directory.store, []
        for record in [p for p in store.list(directory) if p.name.endswith(storage.WRITING)]:
            begun = record.with_name(record.name.removesuffix(storage.WRITING))
            if step_of(begun) is not None and begun.exists() and not has_manifest(begun):
                format_of(begun).remove(begun)
                removed.append(begun.name)
            store.delete(record)
        aborted = store.abort_uploads(directory)
        return removed + ([f"{aborted} incomplete upload(s)"] if aborted else [])
    removed = []
    for path in directory.iterdir() if directory.is_dir() else []:
        if (final := atomic_fs.set_aside_from(path)) and not final.exists():
            os.replace(path, final)  # a swap died between its two renames: the old folder is the checkpoint
            continue
        if atomic_fs.is_temp(path.name):
            if path.is_dir():
                dcp_folder.remove(path)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
