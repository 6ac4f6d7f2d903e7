"""One live writing job per checkpoint directory: an advisory lock held by the writing rank for
as long as its process lives, released by the kernel when it dies (SIGKILL and OOM included).

The lock is a POSIX record lock (``lockf``) on ``CHECKPOINT_DIR/.ddpjob.lock``: owned by the
process, so DataLoader workers forked later do not hold it on after their parent died. NFS
carries these locks (NFSv4, or v3 with lockd); the server releases a vanished client's lock when
its lease expires (90 s by default). So a holder that cannot be seen to be alive (another host)
makes the new job fail retriably, while a live holder on this host is bad input. A file system
that does not support locks (ENOLCK, EOPNOTSUPP: some FUSE or Lustre ``noflock`` mounts) gets a
warning and no lock. The file also names the holder (host, pid, job) for the messages.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from ddpjob import log
from ddpjob.errors import Retriable, UsageError

LOCK_NAME = ".ddpjob.lock"


def _job() -> str:
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "HOSTNAME"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return "-"


def _alive_here(holder: str) -> bool:
    """Whether the holder line names a live process on this host."""
    words = holder.split()
    try:
        host, pid = words[words.index("host") + 1], int(words[words.index("pid") + 1])
    except (ValueError, IndexError):
        return False
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(directory: Path, wait: float) -> int:
    """The open, locked file descriptor (keep it open: closing it releases the lock). Waits up to
    ``wait`` seconds for a dying predecessor (a restart, a requeue), then raises: UsageError for a
    live job on this host, Retriable for a holder elsewhere (it may be a dead node's lease)."""
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                log.warning(
                    f"{directory} does not support file locks ({exc.strerror}): "
                    "nothing stops a second job from writing there"
                )
                return fd
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
        if time.monotonic() >= deadline:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if _alive_here(holder):
                raise UsageError(
                    f"checkpoint dir {directory} is in use by another live job ({holder}); stop that job, "
                    "or give this one its own --checkpoint-dir"
                )
            raise Retriable(
                f"checkpoint dir {directory} is locked by {holder}, not seen alive from here after {wait:g} s; "
                "if that job is gone its lock ends with its NFS lease (90 s by default) and a retry proceeds, "
                "else give this job its own --checkpoint-dir"
            )
        time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()} {_job()}\n".encode(), 0)
    return fd


def release(fd: int) -> None:
    os.close(fd)
