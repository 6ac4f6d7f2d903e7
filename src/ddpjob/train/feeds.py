"""The training data's loader and its place in the data: build it, walk an epoch, save and restore where it is.

Two kinds of dataset, two feeds, one interface for the loop (``epoch``, ``epoch_done``, ``stateful``):

- A map-style ``Dataset`` (``__len__`` and ``__getitem__``): ``Indexed``. An epoch is one permutation
  of the whole dataset and the place in it is one global sample count, the cursor in ``Progress``
  (sampling.py), so a resume continues exactly, at any world size; each fetch is seeded from (seed,
  epoch, index) (rng.PerSample), so random augmentation is reproduced too, whichever process fetches.
- An ``IterableDataset`` (a stream, e.g. sharded files): ``Stream``, on torchdata's
  ``StatefulDataLoader``, which asks each DataLoader worker's copy of the dataset for its
  ``state_dict()`` with every batch and gives it back through ``load_state_dict()`` on a resume.

The contract for an ``IterableDataset`` (README: "Streaming data"):

- Rank and world: ddpjob calls ``dataset.set_rank(rank, world_size)`` once, before the first pass
  (so it may narrow what it holds); the dataset yields only its rank's share (e.g. files ``rank::world_size``). Required when more
  than one process trains: without it every rank would read the same stream.
- Workers: in ``__iter__``, ``torch.utils.data.get_worker_info()`` gives the worker's id and
  count; each worker yields its own share of the rank's share. Worker w's batches are the loader's
  batches w, w + n, w + 2n, ... (torch's in-order round robin).
- Epochs: ddpjob calls ``dataset.set_epoch(epoch)`` (if defined) before each epoch's iteration;
  it starts the stream anew (and may reshuffle by epoch). An epoch ends when any rank's stream
  cannot fill a whole optimizer step; the others drop what they have left, as ``drop_last`` does.
  A stream has no length that ddpjob uses: ``--max-steps`` is required, and is the LR schedule's
  length. An endless stream is fine. A validation stream gets ``set_rank`` once and ``set_epoch(0)``
  before each evaluation pass (``begin_pass``, shared with training), so every pass sees the same
  samples in the same order; it must end.
- Position: ``state_dict()`` returns where this copy (rank, worker) is, in plain types and tensors
  (it is saved with ``weights_only``-loadable checkpoints), and ``load_state_dict(state)`` puts a
  fresh copy back there; the state is taken after each batch, so it names the next sample. Keep the
  stream's randomness in it too (a ``torch.Generator``'s state). Without them, a resume replays the
  worker's stream from the epoch's start up to the position (exact only for a deterministic stream).
  The loop keeps the loader's state only after the steps a checkpoint may follow (``due``): a deep
  copy of every worker's state each step would be a per-step cost for nothing.
- World size: the positions are per rank; a resume at another world size is refused in one line,
  since rank r's share of files at one size is not rank r's at another.

All ranks agree on where an epoch ends without a collective on the hot path's critical path: each
rank fetches the next step's micro-batches one step ahead, and whether every rank has a whole step
is all-reduced on a gloo group while the current step trains; the result is needed a step later.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from ddpjob.config import Config
from ddpjob.distenv import DistEnv
from ddpjob.errors import UsageError
from ddpjob.optional import require
from ddpjob.train import rng
from ddpjob.train.sampling import Batching, EpochSampler
from ddpjob.train.stop_signal import shield_worker


class Position(Protocol):
    """Where the loop is in training: optimizer steps done, the epoch and, for map-style data, the
    global sample cursor."""

    step: int
    epoch: int
    sample: int


_RANKED: weakref.WeakSet[Any] = weakref.WeakSet()  # streams told their rank: once each, as a
# user's set_rank may narrow what it holds (files[rank::world], split_dataset_by_node)


def begin_pass(dataset: Any, env: DistEnv, epoch: int) -> None:
    """Before a pass over a stream (a training epoch, an evaluation): its rank's share (told once),
    from the start of ``epoch``."""
    if hasattr(dataset, "set_rank") and dataset not in _RANKED:
        dataset.set_rank(env.rank, env.world_size)
        _RANKED.add(dataset)
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)


def every_step(step: int) -> bool:
    return True


def end_workers(loader: DataLoader[Any]) -> None:
    """Ends LOADER's live iterator's workers now, while its queues work. Left to the garbage collector
    (setup.job collects DDP's cycles), the loader, its iterator and their queues go in one sweep, in
    any order: a queue finalized first never delivers the workers' end, and torch waits out its 5 s
    join for each worker before it kills it (10 s more for every stream job's end or stop)."""
    live = getattr(loader, "_iterator", None)
    shutdown = getattr(live, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


class Indexed:
    """A map-style dataset: this rank's samples of the epoch's permutation, from the global cursor on."""

    def __init__(self, dataset: Dataset[Any], cfg: Config, batching: Batching, rank: int, pin: bool) -> None:
        self.stateful: dict[str, Any] = {}  # the place is Progress's cursor, the same on every rank
        self.samples = len(dataset)  # type: ignore[arg-type]
        self.batching, self.seed = batching, cfg.seed
        self.steps_per_epoch = batching.steps_per_epoch(self.samples)
        if self.steps_per_epoch == 0:
            raise UsageError(
                f"a global batch of {batching.global_batch} samples (--batch-size {cfg.batch_size} x "
                f"{batching.grad_accum} micro-batches x {batching.world_size} processes) exceeds the "
                f"{self.samples} samples of an epoch; lower it"
            )
        self.sampler = EpochSampler(self.samples, batching, rank, cfg.seed)
        self.loader_rng = torch.Generator()  # the workers' base seed, drawn without touching the global RNG
        seeded, keys = rng.per_sample(dataset, self.sampler, cfg.seed)  # each sample's randomness: (seed, epoch, index)
        self.loader = DataLoader(
            seeded,
            batch_size=cfg.batch_size,
            sampler=keys,
            drop_last=True,
            generator=self.loader_rng,
            num_workers=cfg.num_workers,
            persistent_workers=cfg.num_workers > 0,
            pin_memory=pin,
            worker_init_fn=shield_worker,
        )

    def schedule_steps(self, cfg: Config) -> int:
        return self.steps_per_epoch * cfg.epochs

    def epoch(self, at: Position, due: Callable[[int], bool] = every_step) -> Iterator[Any]:
        self.sampler.set_epoch(at.epoch)
        self.sampler.cursor = at.sample
        self.loader_rng.manual_seed((self.seed * 100_003 + at.epoch) % rng.SEEDS)
        return iter(self.loader)

    def epoch_done(self, at: Position) -> bool:
        return not self.batching.steps_left(self.samples, at.sample)


class Stream:
    """An IterableDataset through torchdata's StatefulDataLoader; its position is saved per rank."""

    samples = 0  # no length: Progress's cursor stays 0 and the schedule runs over --max-steps

    def __init__(self, dataset: IterableDataset[Any], cfg: Config, batching: Batching, env: DistEnv, pin: bool) -> None:
        stateful = require("torchdata.stateful_dataloader", "an IterableDataset (--data)", "torchdata")
        self.dataset, self.batching, self.seed, self.env = dataset, batching, cfg.seed, env
        name = type(dataset).__name__
        if not hasattr(dataset, "set_rank") and env.world_size > 1:
            raise UsageError(
                f"the IterableDataset {name} has no set_rank(rank, world_size), so each of the {env.world_size} "
                "processes would read the same stream; define it to yield only the rank's share (README: Streaming data)"
            )
        self.generator = torch.Generator()
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated since
            warnings.filterwarnings("ignore", "'set_vital' is deprecated")
            self.loader = stateful.StatefulDataLoader(
                dataset,
                batch_size=cfg.batch_size,
                drop_last=True,
                generator=self.generator,
                num_workers=cfg.num_workers,
                pin_memory=pin,
                worker_init_fn=shield_worker,
            )  # no persistent workers: each epoch's workers copy the dataset after its set_epoch
        timeout = timedelta(seconds=cfg.collective_timeout)  # a rank that stopped fetching: as a step's collectives
        together = dist.is_initialized() and env.world_size > 1
        self.group = dist.new_group(backend="gloo", timeout=timeout) if together else None
        self.position: dict[str, Any] | None = None  # the loader's state after the last whole step; None: epoch start
        self.position_step: int | None = None  # the step self.position follows; None: an epoch's start or end
        self.at: Position | None = None
        self.exhausted = False
        self.stateful = {"stream": self}

    def schedule_steps(self, cfg: Config) -> int:
        if not cfg.max_steps:
            raise UsageError(
                f"the training data is an IterableDataset ({type(self.dataset).__name__}): it has no length to "
                "make epochs and an LR schedule of; give --max-steps N"
            )
        return cfg.max_steps

    def epoch(self, at: Position, due: Callable[[int], bool] = every_step) -> Iterator[Any]:
        """The epoch's micro-batches, from the saved position on, in whole steps that every rank has;
        ``due(step)``: whether a checkpoint may follow optimizer step ``step`` (only then is the
        loader's state kept)."""
        begin_pass(self.dataset, self.env, at.epoch)
        self.generator.manual_seed(rng.derived_seed(self.seed, at.epoch, self.env.rank))  # worker seeds
        if self.position is not None:
            self.loader.load_state_dict(self.position)
        self.exhausted, self.at, self.position_step = False, at, at.step if self.position is not None else None
        return self._whole_steps(iter(self.loader), at, due)

    def _whole_steps(self, batches: Iterator[Any], at: Position, due: Callable[[int], bool]) -> Iterator[Any]:
        accum = self.batching.grad_accum
        ahead = [b for _, b in zip(range(accum), batches, strict=False)]
        agreed = self._all_have(len(ahead) == accum)
        while agreed():
            step, done = ahead, at.step + 1  # `step` is optimizer step `done`
            # before fetching ahead: the place after `step`, copied (the loader's live state moves on)
            after = copy.deepcopy(self.loader.state_dict()) if due(done) else None
            ahead = [b for _, b in zip(range(accum), batches, strict=False)]
            agreed = self._all_have(len(ahead) == accum)  # overlaps with training `step`
            yield from step[:-1]
            self.position, self.position_step = after, done  # the loop saves only after a step's last micro-batch
            yield step[-1]
        self.exhausted, self.position, self.position_step = True, None, None

    def _all_have(self, mine: bool) -> Callable[[], bool]:
        """A callable that says whether every rank has a whole step; the all-reduce runs in between."""
        if self.group is None:
            return lambda: mine
        flag = torch.tensor([int(mine)])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True)

        def result() -> bool:
            work.wait()
            return bool(flag.item())

        return result

    def epoch_done(self, at: Position) -> bool:
        return self.exhausted

    # ---- checkpoint: one state per rank (Checkpointer gathers them) ----------------------------
    def state_dict(self) -> dict[str, Any]:
        kept = self.position is not None and self.at is not None and self.position_step == self.at.step
        if self.position_step is not None and not kept:
            step = self.at.step if self.at is not None else self.position_step
            raise RuntimeError(f"the stream's position after step {step} was not kept: due() missed it")
        return {"loader": self.position, "workers": self.loader.num_workers}

    def load_rank_states(self, states: list[dict[str, Any]] | None) -> None:
        if states is None:
            raise UsageError(
                "the checkpoint holds no stream position (it was written with map-style --data); "
                "resume with the same data, or start anew with --resume never"
            )
        if len(states) != self.env.world_size:
            raise UsageError(
                f"the checkpoint holds the stream positions of {len(states)} ranks, this run has {self.env.world_size}: "
                "an IterableDataset's per-rank shares do not carry over to another world size; resume at "
                f"{len(states)} processes, or start anew with --resume never"
            )
        mine = states[self.env.rank]
        if mine["workers"] != self.loader.num_workers:
            raise UsageError(
                f"the checkpoint holds the stream positions of {mine['workers']} DataLoader workers per rank, this "
                f"run has --num-workers {self.loader.num_workers}: each worker's share of the stream is its own; "
                f"resume with --num-workers {mine['workers']}, or start anew with --resume never"
            )
        self.position = mine["loader"]


def feed(
    dataset: Dataset[Any], cfg: Config, batching: Batching, env: DistEnv, device: torch.device
) -> Indexed | Stream:
    """The training loader for this kind of dataset."""
    pin = device.type == "cuda"
    if isinstance(dataset, IterableDataset):
        return Stream(dataset, cfg, batching, env, pin)
    return Indexed(dataset, cfg, batching, env.rank, pin)


def eval_shard(dataset: Dataset[Any], env: DistEnv) -> Dataset[Any]:
    """This rank's part of the validation set: every world_size-th sample, or the stream's rank share."""
    if isinstance(dataset, IterableDataset):
        begin_pass(dataset, env, 0)  # every pass the same samples, in the same order
        return dataset
    return Subset(dataset, range(env.rank, len(dataset), env.world_size))  # type: ignore[arg-type]
