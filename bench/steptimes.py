"""Per-step wall times inside a training process, taken the same way by both loops of a comparison.

A data-factory wrapper: the training set notes ``time.perf_counter()`` each time the DataLoader
fetches a batch from it (``__getitems__``: once per batch, at the start of each step, in the
training process itself, as num_workers is 0 on both sides), so the gap between fetches k and k+1
is step k's whole wall time: data, forward, backward, all-reduce waits, optimizer, schedule and
whatever else the loop does. Once fetch LAST+1 has started it writes the durations of steps
FIRST..LAST to OUT.RANK.json, with the wall-clock time (``time.time()``) of fetch 1, the start of
step 1, so that a launcher that noted its own launch time has the whole process's time to the
first step (bench/peers.py). Nothing depends on the model, so it times eager and compiled models
alike, and `ddpjob train` and a bare loop take it through the same code:

    ddpjob train --data "bench.steptimes:timed(data='ddpjob.plugins:synthetic()', out='/tmp/t', first=100, last=600)"
    train_set, val_set = timed("ddpjob.plugins:synthetic()", "/tmp/t", 100, 600)  # in a bare loop

(With gradient accumulation a step fetches several batches: the window then counts micro-batches.)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ddpjob.plugins import build_data
from ddpjob.train.rng import draws_random_numbers


class TimedSet(Dataset[Any]):
    """``base``, noting the time of each batch fetch from ``first`` to ``last + 1``."""

    def __init__(self, base: Dataset[Any], out: str, first: int, last: int) -> None:
        self.base, self.out, self.first, self.last = base, out, first, last
        self.fetches, self.stamps, self.first_fetch = 0, list[float](), 0.0
        self.fetch = getattr(base, "__getitems__", None) or (lambda indices: [base[i] for i in indices])
        self.draws_random_numbers = draws_random_numbers(base)  # seeded per sample by ddpjob exactly when base is

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.base[index]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        self.fetches += 1
        if self.fetches == 1:
            self.first_fetch = time.time()
        if self.first <= self.fetches <= self.last + 1:
            self.stamps.append(time.perf_counter())
            if self.fetches == self.last + 1:
                self.write()
        return self.fetch(indices)

    def write(self) -> None:
        seconds = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        record = {
            "rank": int(os.environ.get("RANK", 0)),
            "first": self.first,
            "last": self.last,
            "seconds": seconds,
            "first_fetch": self.first_fetch,
            "setting": setting(),
        }
        Path(f"{self.out}.{record['rank']}.json").write_text(json.dumps(record))


def timed(data: str, out: str, first: int = 100, last: int = 600, val: bool = True) -> Any:
    """The data factory ``data`` (a ddpjob spec), its training set timed; its validation set as is,
    or dropped (``val=False``: no evaluation after the timed steps, which would only add minutes)."""
    train, val_set = build_data(data)
    timed_train = TimedSet(train, out, first, last)
    return (timed_train, val_set) if val and val_set is not None else timed_train


def setting() -> dict[str, Any]:
    """What must be the same on both sides for a fair comparison: threads, world size, seeds' source."""
    return {
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
    }


def read(out: str | Path, rank: int = 0) -> dict[str, Any]:
    """What rank ``rank`` wrote to OUT.RANK.json: ``seconds`` (the step durations), ``first_fetch``
    (the wall-clock time step 1 began) and ``setting``."""
    return dict(json.loads(Path(f"{out}.{rank}.json").read_text()))
