"""Async saves: the state copied into reusable host buffers (tied tensors stay tied), and the
background write the loop waits for only at the next save or the end."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ddpjob.checkpoint import weights
from ddpjob.errors import StorageError


class _Pending:
    """A file save running in a thread; ``wait`` joins it and raises its StorageError."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, name="ddpjob-save", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()
        if isinstance(self.error, StorageError):
            raise self.error
        if self.error is not None:
            raise StorageError(f"cannot write checkpoint: {self.error}")


def stage(state: Any, buffers: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """A host copy of every tensor in state, made into buffers of the previous call where shapes
    and dtypes match (no allocation after the first save). Tensors that share memory (tied
    weights) share one copy, as they do in the model."""
    reuse, used = iter(buffers), []
    copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = weights.storage_key(t)
        if key in copies:
            return copies[key]
        buffer = next(reuse, None)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        buffer.copy_(t.detach(), non_blocking=t.is_cuda)
        used.append(buffer)
        copies[key] = buffer
        return buffer

    staged = weights.map_tensors(state, copy)
    if any(key[0].type == "cuda" for key in copies):
        torch.cuda.synchronize()  # the non-blocking copies into pinned memory are done
    return staged, used
