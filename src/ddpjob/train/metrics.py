"""What rank 0 reports: JSON-lines metrics (appended across restarts), optionally the same as
TensorBoard scalars (``--tensorboard DIR``) and tracker metrics (``--tracker``, trackers.py), and
progress on stdout: one line per logging interval, the same on a terminal as in a log file.

Losses are accumulated on the device and read back only at logging intervals, so the loop has
no per-step host sync.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpjob import log, optional
from ddpjob.train.trackers import Tracker


class Metrics:
    def __init__(
        self,
        path: Path,
        enabled: bool,
        total_steps: int,
        samples_per_step: int,
        log_every: int,
        tensorboard: str = "",
        tracker: Tracker | None = None,
    ) -> None:
        self.enabled, self.total, self.log_every = enabled, total_steps, log_every
        self.tracker = tracker if tracker is not None and tracker.enabled else None
        self.samples_per_step = samples_per_step
        self.file = None
        self.tb: Any = None
        if enabled and tensorboard:  # the same records, as TensorBoard scalars
            board = optional.require("torch.utils.tensorboard", f"--tensorboard {tensorboard}", "tensorboard")
            self.tb = board.SummaryWriter(tensorboard)
        self.loss_sum: torch.Tensor | None = None
        self.sums: dict[str, torch.Tensor | float] = {}
        self.count, self.last_time, self.last_step = 0, time.perf_counter(), 0
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def start(self, step: int, **fields: Any) -> None:
        self.last_step, self.last_time = step, time.perf_counter()
        if self.tracker is not None:
            self.tracker.start()
        self.write(event="start", step=step, **fields)

    def write(self, **record: Any) -> None:
        if self.file:
            self.file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        if "step" not in record or (self.tb is None and self.tracker is None):
            return
        values = {
            f"{record['event']}/{key}": float(value)
            for key, value in record.items()
            if key not in ("step", "epoch") and isinstance(value, int | float) and not isinstance(value, bool)
        }
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, record["step"])
        if self.tracker is not None:  # queued for its thread: never waits
            self.tracker.log(record["event"], record["step"], values)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a logging interval (the same answer on every rank)."""
        return step % self.log_every == 0 or step == self.total

    def step(
        self,
        step: int,
        epoch: int,
        loss: torch.Tensor,
        lr: float,
        averaged: Mapping[str, torch.Tensor | float] | None = None,
        **extra: Any,
    ) -> None:
        """Called every optimizer step with the step's loss tensor (not read back here), the LR it
        used, ``averaged`` values (a user loss's extras, grad_norm) that the record gives as their
        mean over the interval like the loss, and at logging intervals ``extra`` fields for the record."""
        if not self.enabled:
            return
        if self.loss_sum is None:
            self.loss_sum = loss.detach().to(torch.float32, copy=True)  # summed in bf16 it would lose its low bits
        else:
            self.loss_sum.add_(loss.detach())  # in place: no new tensor per step
        for name, value in (averaged or {}).items():
            value = value.detach().double() if isinstance(value, torch.Tensor) else value
            self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.count += 1
        if not self.due(step):
            return
        now = time.perf_counter()
        assert self.loss_sum is not None
        loss_value = self.loss_sum.item() / self.count
        extra = {name: float(total) / self.count for name, total in self.sums.items()} | extra
        self.sums = {}
        rate = (step - self.last_step) / max(now - self.last_time, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else 0.0
        if torch.cuda.is_available():  # a host-side counter: no device sync
            extra["gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        self.write(
            event="train",
            step=step,
            epoch=epoch,
            loss=loss_value,
            lr=lr,
            steps_per_s=rate,
            samples_per_s=rate * self.samples_per_step,
            **extra,
        )
        log.info(
            f"step {step}/{self.total} epoch {epoch} loss {loss_value:.4f} "
            f"{rate * self.samples_per_step:.0f} samples/s eta {eta:.0f}s"
        )
        self.loss_sum, self.count, self.last_step, self.last_time = None, 0, step, now

    def close(self, **fields: Any) -> None:
        if fields:
            self.write(event="end", **fields)
        if self.file:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.tracker is not None:
            self.tracker.close(int(fields.get("exit_code", 0)))
            self.tracker = None


def read_records(path: Path, reader: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (metrics.jsonl, attempts.jsonl); a line cut by a crash is
    skipped, and ``reader`` (the command) says so."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.info(f"{reader}: skipping unreadable line {number} of {path}")
    return records


def append_attempt(run_dir: str, **fields: Any) -> None:
    """A line in RUN_DIR/attempts.jsonl, the record of every node's attempts and membership changes
    (appended by every node, never truncated): time, host and ``fields``."""
    os.makedirs(run_dir, exist_ok=True)
    record = {"time": round(time.time(), 3), "host": socket.gethostname(), **fields}
    with open(os.path.join(run_dir, "attempts.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def read_attempts(run_dir: str) -> list[dict[str, Any]]:
    """The records of RUN_DIR/attempts.jsonl, oldest first; none when there is no file or it cannot
    be read now. A line that is not a JSON object (cut short by a node that died while writing it)
    is skipped."""
    try:
        with open(os.path.join(run_dir, "attempts.jsonl"), errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def process_started() -> float:
    """When this process started (seconds since the epoch, to 10 ms), from /proc; now where there is no /proc."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
