"""The oldest torch that ddpjob runs on, checked when ``ddpjob train`` and ``ddpjob launch`` start.

torch 2.12 is the first release whose torchrun has ``--shutdown-timeout`` (launch passes it on
every start); the other recent APIs ddpjob uses are older: ``--signals-to-handle``, DCP's
``DefaultStager``/``StagingOptions`` and ``async_save(async_stager=..., no_dist=...)`` are in 2.11,
DDP's ``init_sync``, ``init_process_group(device_id=...)`` and ``torch.load(mmap=...)`` earlier still.
"""

from __future__ import annotations

import re

from ddpjob.errors import UsageError

MIN_TORCH = (2, 12)
CUDA_IMAGE = "pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime"  # docker/Dockerfile, compose.gpu.yaml


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string such as 2.13.0+cpu or 2.12.0a0+git1234; None if unreadable."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_torch(version: str | None = None) -> None:
    """Raise a one-line UsageError when the installed torch is older than MIN_TORCH."""
    if version is None:
        import torch

        version = str(torch.__version__)
    found = release(version)
    if found is not None and found >= MIN_TORCH:
        return
    need = ".".join(map(str, MIN_TORCH))
    raise UsageError(
        f"ddpjob needs torch >= {need}, found {version}; install a newer one (pip install 'torch>={need}') "
        f"or use an image that has one (e.g. {CUDA_IMAGE})"
    )
