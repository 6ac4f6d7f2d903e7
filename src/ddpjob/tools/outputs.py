"""Where a tool may write (``ddpjob ckpt convert``, ``ddpjob plot``): never over what the user has.

One rule for every command that writes a path the user names, checked before anything is read or
written: the destination does not overlap an input (the same path, inside it, or holding it); a
folder output goes to a new path or an empty folder; a file output goes to a new path, unless the
command says it replaces a file it wrote itself (``replaceable``); the files written next to it
(``companions``, e.g. a checkpoint's manifest) are new too; and the destination can be created
(its nearest existing parent is a writable folder). A destination that is a symbolic link is
refused (what it points to is not the user's to lose); ``.`` and ``x/..`` name the folder they
resolve to; only a regular file can be replaced (never a FIFO, socket or device). Each refusal is a
UsageError: one line, exit 2.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ddpjob.errors import UsageError


def check(
    dest: Path,
    inputs: Sequence[Path],
    folder: bool,
    what: str,
    companions: Sequence[Path] = (),
    replaceable: Callable[[Path], bool] | None = None,
) -> Path:
    """UsageError unless ``what`` (the command and its output, e.g. "--to dcp writes a folder") may
    write dest: see the module's rule. Returns dest resolved: the path to write."""
    if dest.is_symlink():
        raise UsageError(f"{dest} is a symbolic link; {what}: give a new path (or the path it points to)")
    dest = dest.resolve()  # ".", "x/..": the folder they name
    _check_overlap(dest, inputs)
    if dest.is_dir():
        if not folder:
            raise UsageError(f"{dest} is a folder; {what}: give a new file path")
        if held := sorted(p.name for p in dest.iterdir()):
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            raise UsageError(
                f"{dest} is not empty (it holds {', '.join(held[:3])}{more}): what is written there would replace or "
                "mix with what it holds; choose an empty folder or remove it"
            )
    elif dest.exists():
        if folder:
            raise UsageError(f"{dest} is a file; {what}: choose a new folder path")
        if not dest.is_file():
            raise UsageError(f"{dest} is not a regular file (a FIFO, socket or device); {what}: choose a new path")
        if replaceable is None or not replaceable(dest):
            raise UsageError(f"{dest} exists; {what} and never overwrites a file: choose a new path or remove it")
    for companion in companions:
        if companion.exists() or companion.is_symlink():
            raise UsageError(f"{companion} exists and would be overwritten by {dest}'s; choose another path")
    _check_creatable(dest)
    return dest


def _check_overlap(dest: Path, inputs: Sequence[Path]) -> None:
    target = dest.resolve()
    for path in inputs:
        source = path.resolve()
        if target == source or target in source.parents:
            raise UsageError(f"{dest} is (or holds) the input {path}; write the output elsewhere")
        if source in target.parents:
            raise UsageError(f"{dest} is inside the input {path}; write the output elsewhere")


def _check_creatable(dest: Path) -> None:
    """The nearest existing parent of dest is a folder this process may write into."""
    parent = dest.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{parent} is a file, so {dest} cannot be created; choose a path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{parent} is not writable, so {dest} cannot be created; choose a writable place")
