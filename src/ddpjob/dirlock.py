"""One live writing job per checkpoint directory: an advisory lock held by the writing rank for
as long as its process lives, released by the kernel when it dies (SIGKILL and OOM included).

The lock is ``flock`` on ``CHECKPOINT_DIR/.ddpjob.lock``. On NFS, Linux clients turn ``flock``
into NFS byte-range locks (NFSv4, or v3 with lockd), which the server releases when the holder's
lease expires: a job on a node that vanished holds the dir for up to the lease time (90 s by
default). The file also names the holder (host, pid, job) for the message a second job prints.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from ddpjob.errors import UsageError

LOCK_NAME = ".ddpjob.lock"


def _job() -> str:
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "HOSTNAME"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return "-"


def acquire(directory: Path, wait: float) -> int:
    """The open, locked file descriptor (keep it open: closing it releases the lock). Waits up to
    ``wait`` seconds for a dying predecessor (a restart, a requeue), then raises UsageError."""
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise UsageError(
                    f"checkpoint dir {directory} is in use by another live job ({holder}); stop that job, "
                    "or give this one its own --checkpoint-dir"
                ) from None
            time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()} {_job()}\n".encode(), 0)
    return fd
