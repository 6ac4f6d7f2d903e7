"""Test plug-ins: an IterableDataset of sharded sample files, as a user would write one (train/feeds.py's contract).

``write_shards(folder, sizes)`` writes the digits training samples into files of the given sizes;
``sharded(folder)`` streams them: rank r reads files r, r + world, ...; within a rank, worker w its
w-th, (w + workers)-th, ... file; each file's samples in an order drawn from (seed, epoch, file).
Shares differ in length on purpose, so ranks run out at different steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddpjob import plugins
from ddpjob.train import rng


class ShardedFiles(IterableDataset):
    def __init__(
        self,
        files: list[Path],
        endless: bool = False,
        seed: int = 0,
        delay: float = 0.0,
        narrowing: bool = False,
        until: str = "",
    ) -> None:
        self.files, self.endless, self.seed, self.delay, self.narrowing = files, endless, seed, delay, narrowing
        self.until = until
        self.rank, self.world, self.epoch = 0, 1, 0
        self.pass_, self.file, self.offset = 0, 0, 0  # the position: next sample of this copy's share

    def set_rank(self, rank: int, world_size: int) -> None:
        if self.narrowing:  # keeps only its share, as split_dataset_by_node does: not to be told twice
            self.files = self.files[rank::world_size]
        else:
            self.rank, self.world = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pass_, self.file, self.offset = epoch, 0, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"pass": self.pass_, "file": self.file, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pass_, self.file, self.offset = state["pass"], state["file"], state["offset"]

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        index, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        share = self.files[self.rank :: self.world][index::workers]
        while share and (self.endless or self.pass_ == 0):
            while self.file < len(share):
                x, y = torch.load(share[self.file], weights_only=True)
                seed = rng.derived_seed(self.seed, self.epoch, self.pass_, self.files.index(share[self.file]))
                order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed)).tolist()
                while self.offset < len(order):
                    i = order[self.offset]
                    self.offset += 1  # before the yield: the state names the next sample
                    if self.delay and self.until and os.path.exists(self.until):
                        self.delay = 0.0  # released: the rest of the run at full speed
                    time.sleep(self.delay)
                    yield x[i], y[i]
                self.file, self.offset = self.file + 1, 0
            self.pass_, self.file = self.pass_ + 1, 0


def write_shards(folder: Path, sizes: list[int]) -> None:
    train, _ = plugins.digits()
    x, y = train.tensors
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for n, size in enumerate(sizes):
        torch.save((x[start : start + size].clone(), y[start : start + size].clone()), folder / f"shard-{n:03d}.pt")
        start += size


def sharded(
    folder: str = "shards",
    endless: bool = False,
    delay: float = 0.0,
    val_stream: bool = False,
    narrowing: bool = False,
    until: str = "",
) -> tuple[ShardedFiles, Any]:
    """The files under ``folder`` (relative to the working directory), with digits' validation set
    (``val_stream``: the first two files as a stream instead); ``delay``: seconds of sleep per
    sample, so a test can act mid-run, until a file ``until`` (relative to the working directory)
    exists, which the test makes once it acted; ``narrowing``: set_rank drops the other ranks' files."""
    files = sorted(Path(folder).glob("shard-*.pt"))
    if not files:
        raise FileNotFoundError(f"no shard-*.pt files in {os.path.abspath(folder)}")
    val = ShardedFiles(files[:2]) if val_stream else plugins.digits()[1]
    return ShardedFiles(files, endless, delay=delay, narrowing=narrowing, until=until), val


def empty_validation(folder: str = "shards") -> tuple[ShardedFiles, ShardedFiles]:
    """The files under ``folder``, and a validation stream that yields nothing."""
    return ShardedFiles(sorted(Path(folder).glob("shard-*.pt"))), ShardedFiles([])


def unranked(folder: str = "shards") -> IterableDataset:
    """A stream without set_rank: ddpjob cannot give it its rank's share."""

    class Unranked(IterableDataset):
        def __iter__(self) -> Iterator[Any]:
            yield from ShardedFiles(sorted(Path(folder).glob("shard-*.pt")))

    return Unranked()
