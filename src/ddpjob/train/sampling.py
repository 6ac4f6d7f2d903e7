"""How an epoch's samples become optimizer steps, processes and micro-batches: the same at any world size.

An epoch's order is one permutation of the dataset, drawn from the seed and the epoch alone. Step k of
an epoch takes the permutation's samples [k*G, (k+1)*G), G being the global batch. Within a step,
micro-batch round j takes the next batch_size x world_size of them, and process r every
world_size-th of those from r on (the layout of torch's DistributedSampler, so a fixed world size
sees the order it always did). The place in an epoch is a count of samples, the cursor; a resume
continues at the cursor at any world size, with exactly the samples not yet seen.

    batching = Batching.of(cfg, world_size)      # grad accumulation derived from --global-batch-size
    sampler = EpochSampler(len(train_set), batching, rank, seed)
    sampler.set_epoch(epoch); sampler.cursor = samples_done
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from ddpjob.config import Config
from ddpjob.errors import UsageError
from ddpjob.train import rng


@dataclass(frozen=True)
class Batching:
    batch_size: int  # samples per process per micro-batch
    grad_accum: int  # micro-batches per optimizer step
    world_size: int

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over all processes."""
        return self.batch_size * self.grad_accum * self.world_size

    @property
    def round(self) -> int:
        """Samples per micro-batch round, over all processes."""
        return self.batch_size * self.world_size

    @classmethod
    def of(cls, cfg: Config, world_size: int) -> Batching:
        """From the flags at this world size; --global-batch-size G fixes G and derives grad accumulation."""
        if not cfg.global_batch_size:
            return cls(cfg.batch_size, cfg.grad_accum, world_size)
        accum, left = divmod(cfg.global_batch_size, cfg.batch_size * world_size)
        if left or not accum:
            raise UsageError(
                f"--global-batch-size {cfg.global_batch_size} cannot be split into micro-batches of --batch-size "
                f"{cfg.batch_size} on {world_size} processes; make it a multiple of {cfg.batch_size * world_size} "
                "(at every world size an elastic job may run at)"
            )
        if cfg.grad_accum not in (1, accum):
            raise UsageError(
                f"--grad-accum {cfg.grad_accum} contradicts --global-batch-size {cfg.global_batch_size} (which gives "
                f"{accum} at {world_size} processes of --batch-size {cfg.batch_size}); give only the global batch size"
            )
        return cls(cfg.batch_size, accum, world_size)

    def steps_per_epoch(self, samples: int) -> int:
        """Whole optimizer steps in an epoch of ``samples``; the remainder is left out (drop_last)."""
        return samples // self.global_batch

    def steps_left(self, samples: int, cursor: int) -> int:
        """Whole steps left in an epoch after ``cursor`` samples."""
        return max(self.steps_per_epoch(samples) * self.global_batch - cursor, 0) // self.global_batch


def epoch_order(samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's permutation: the seed and the epoch only, never the world size."""
    generator = torch.Generator()
    generator.manual_seed((seed + epoch) % rng.SEEDS)  # the same as seed + epoch within torch's range
    return torch.randperm(samples, generator=generator)


class EpochSampler(Sampler[int]):
    """This process's sample indices for the rest of the epoch, from the global cursor on, in whole steps."""

    def __init__(self, samples: int, batching: Batching, rank: int, seed: int) -> None:
        self.samples, self.batching, self.rank, self.seed = samples, batching, rank, seed
        self.epoch = self.cursor = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batching.steps_left(self.samples, self.cursor) * self.batching.grad_accum * self.batching.batch_size

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.samples, self.seed, self.epoch)
        batching, world = self.batching, self.batching.world_size
        rounds = self.batching.steps_left(self.samples, self.cursor) * batching.grad_accum
        for r in range(rounds):
            start = self.cursor + r * batching.round + self.rank
            yield from order[start : start + batching.round : world].tolist()
