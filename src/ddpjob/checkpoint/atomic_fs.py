"""File-system steps that make checkpoint writes safe on local disks and shared (NFS) storage:
exclusive creation that never follows a link, durable renames, an atomic folder swap, and the
names of temporaries so that they can be found and removed after a killed save."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
from pathlib import Path

_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def temp_name(final: Path, kind: str = "tmp") -> Path:
    """``.NAME.tmp-HOST-PID`` next to final: unique per writer, hidden, and recognisable as a temporary."""
    return final.with_name(f".{final.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


def is_temp(name: str) -> bool:
    """A temporary of a checkpoint save (file, manifest or folder) or a folder set aside by a swap."""
    return name.startswith(".step-") and (".tmp" in name or ".old-" in name)


def set_aside_from(path: Path) -> Path | None:
    """For a folder that replace_folder set aside (``.step-N.old-HOST-PID``), the folder it was."""
    name = path.name
    return path.with_name(name[1 : name.index(".old-")]) if name.startswith(".step-") and ".old-" in name else None


def create_exclusive(path: Path) -> int:
    """Open a new file for writing; never an existing file, and never through a symlink.
    A leftover at that name (a writer that died with our PID, or a planted link) is removed first."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        path.unlink()  # removes a link itself, never its target
        return os.open(path, flags, 0o644)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE). False where the system lacks it (NFS)."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))


def replace_folder(tmp: Path, final: Path) -> None:
    """Move folder tmp to final durably. An existing final is swapped out atomically where the file
    system can (readers see the old folder or the new one, never neither), else set aside first."""
    if not final.exists():
        os.replace(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp)  # now the old folder
    else:
        old = temp_name(final, "old")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    fsync_dir(final.parent)
