"""Set-up and tear-down of one training process: everything the loop needs, built once into a ``Job``.

``job(cfg, env)`` is a context manager. On the way in, in this order: the checks that need no
network (``check_setup``), the device, the data and the loss (``Worker``); the phase watchdog; the
process group; the stop signal; then, once the group is up, the checkpoint chosen and loaded, the
model (weights from the checkpoint, --init-from or the seed) wrapped for its strategy, the feed,
optimizer and schedule, the progress restored, the metrics started (``Job``). On the way out: a
backend failure said in one line, the watchdog stopped, the process group destroyed.

The order is part of determinism: each step that draws random numbers draws them at the same point
of the process as before, so a resumed run reproduces an uninterrupted one bitwise on CPU.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ddpjob import log, optional
from ddpjob.checkpoint import storage
from ddpjob.checkpoint.choice import Loaded
from ddpjob.checkpoint.manager import Checkpointer
from ddpjob.checkpoint.weights import load_weights, model_state, shared_parameters, tie, unwrap
from ddpjob.config import Config, is_spec, print_config
from ddpjob.distenv import DistEnv
from ddpjob.errors import PeerLost, UsageError
from ddpjob.plugins import build_data, build_model, load_callable
from ddpjob.train import feeds, footprint, fsdp, optim, rng
from ddpjob.train.losses import Loss, StepMean
from ddpjob.train.metrics import Metrics, append_attempt, process_started
from ddpjob.train.phase_watchdog import Phases, start_watchdog
from ddpjob.train.process import backend_message, init_process_group, is_peer_failure, pick_device
from ddpjob.train.sampling import Batching
from ddpjob.train.schedule import Schedule
from ddpjob.train.stop_signal import StopSignal, exit_with_parent
from ddpjob.train.stragglers import Stragglers
from ddpjob.train.traces import Tracer, enable_nccl_dumps
from ddpjob.train.trackers import Tracker


@dataclass
class Progress:
    """Where training is: optimizer steps done, current epoch, samples of its order consumed (all ranks)."""

    step: int = 0
    epoch: int = 0
    sample: int = 0
    samples: int = 0  # the dataset's size: the permutation the cursor counts in

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("samples", self.samples) != self.samples:
            raise UsageError(
                f"the checkpoint was trained on a dataset of {state['samples']} samples, this --data has {self.samples}: "
                "its place in the epoch's order would not carry over; resume with the same data, or --resume never"
            )
        self.step, self.epoch, self.sample = state["step"], state["epoch"], state.get("sample", -1)


DISTRIBUTED = ("ddp", "fsdp2")  # strategies with a process group: one process per device
UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"  # DDP's words


@dataclass
class Worker:
    """This process before any network wait: its settings, device, loss, data, and the watchdog's
    phases and tracer."""

    cfg: Config
    env: DistEnv
    device: torch.device
    loss: Loss
    train_set: Dataset[Any]
    val_set: Dataset[Any] | None
    tracer: Tracer
    phases: Phases


@dataclass
class Job(Worker):
    """Everything the loop needs, once the process group is up and the checkpoint loaded."""

    stop: StopSignal
    model: nn.Module  # wrapped for the strategy (DDP, FSDP2 or DataParallel)
    runner: nn.Module  # what the forward pass calls: the model, compiled with --compile
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    feed: feeds.Indexed | feeds.Stream
    batching: Batching
    total_steps: int  # --max-steps, or the schedule's length
    progress: Progress
    checkpointer: Checkpointer
    metrics: Metrics
    stragglers: Stragglers  # this rank's own step times
    step_mean: StepMean  # the logged loss and extras: the step's mean over its micro-batches
    autocast: contextlib.AbstractContextManager[Any]
    lockstep: bool  # every forward is a collective (fsdp2): ranks evaluate in step

    def may_save_after(self, step: int) -> bool:
        """Whether a checkpoint may follow optimizer step ``step``: --save-every, a stop check, the last step."""
        every = self.cfg.save_every and step % self.cfg.save_every == 0
        return bool(every) or step % self.stop.check_every == 0 or step >= self.total_steps


def check_setup(cfg: Config, env: DistEnv) -> None:
    """Everything that can be checked before any network wait."""
    Batching.of(cfg, env.world_size)  # a global batch that does not split over these processes
    if cfg.strategy not in DISTRIBUTED and env.is_distributed:
        raise UsageError(
            f"--strategy {cfg.strategy} runs one process, but {env.source} started {env.world_size}; "
            "use --strategy ddp or fsdp2, or launch a single process"
        )
    if is_spec(cfg.shard_modules):
        load_callable(cfg.shard_modules)  # import errors surface here, before any network wait
    if cfg.precision == "bf16" and cfg.device == "cpu":
        raise UsageError("--precision bf16 needs CUDA; use --precision fp32 on CPU")
    if cfg.compile and (cfg.device == "cpu" or not torch.cuda.is_available()):
        optional.require_cpu_compiler("--compile")
    if storage.is_url(cfg.checkpoint_dir):  # an object store: probed by rank 0 at start (Checkpointer.begin)
        return
    ckpt_dir = cfg.checkpoint_path
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"cannot create checkpoint dir {ckpt_dir}: {exc.strerror}; choose a writable --checkpoint-dir"
        ) from None
    if not os.access(ckpt_dir, os.W_OK):
        raise UsageError(f"checkpoint dir {ckpt_dir} is not writable; fix its permissions or set --checkpoint-dir")


@contextlib.contextmanager
def job(cfg: Config, env: DistEnv) -> Iterator[Job]:
    """This process's Job; on the way out (finished, stopped or failed) the process is torn down."""
    check_setup(cfg, env)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        exit_with_parent()  # an agent killed with SIGKILL must not leave its workers training on
    device = pick_device(cfg, env)
    load_callable(cfg.model)  # import errors surface here, before any network wait
    loss = Loss(cfg.loss, replicas=torch.cuda.device_count() if cfg.strategy == "dp" else 1)
    optim.check_plugins(cfg)
    train_set, val_set = build_data(cfg.data)
    worker = Worker(cfg, env, device, loss, train_set, val_set, Tracer(cfg.run_dir, env.rank), Phases(cfg))
    watchdog = start_watchdog(worker.phases, worker.tracer, cfg.heartbeat, cfg.trace_after)
    job: Job | None = None  # dropped before the collection below: it must free DDP's reducer (loop.run)
    loader = None  # the training data's loader, once built: its workers end before that collection too
    try:  # from here every exit stops the watchdog (a failed start-up too: it would end the process)
        if cfg.strategy in DISTRIBUTED:
            if device.type == "cuda":
                enable_nccl_dumps(cfg.run_dir, env.rank)
            init_process_group(cfg, env, device)
        joined = time.time()  # the process group is up (after the rendezvous, on a restart)
        # From here a stop signal is kept, not fatal: loading a checkpoint (waiting for the dir's lock,
        # for shared storage, verifying) can take minutes, and a stop then still ends in a checkpoint.
        # (Before, a blocking rendezvous would hold a handled signal until it returned.)
        job = assemble(worker, StopSignal(cfg.stop_check_every, device), joined)
        loader = job.feed.loader
        yield job
    except RuntimeError as exc:
        if UNUSED_PARAMETERS in str(exc):
            raise UsageError(
                "DDP found parameters that got no gradient in a step (the model leaves some out of the loss); "
                "pass --find-unused-parameters, or remove or freeze (requires_grad=False) the unused ones"
            ) from None
        if dist.is_initialized() and is_peer_failure(exc):
            worker.tracer.dump(f"a collective failed: {backend_message(exc)}", keep=True)
            raise PeerLost(
                f"rank {env.rank}: a collective failed ({backend_message(exc)}); a peer died, hung longer than "
                f"{worker.phases.describe()} in {worker.phases.name} or lost its network: that peer's log says "
                "which; a restart (--max-restarts, requeue) resumes from the newest checkpoint"
            ) from None
        raise
    finally:
        watchdog.set()
        job = None
        if loader is not None:
            feeds.end_workers(loader)  # now, while its queues work (feeds.end_workers)
        # DDP's reducer sits in reference cycles; freed at interpreter exit, its pending gloo work
        # aborts the process ("terminate called without an active exception"). Free it now, on every
        # path: thawed first, as the loop and a forked start froze what they found (loop.train, worker_fork).
        gc.unfreeze()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def assemble(worker: Worker, stop: StopSignal, joined: float) -> Job:
    """The model, runner, optimizer, schedule, feed, progress, checkpointer and metrics of this run:
    weights from the checkpoint (resume), --init-from or the seed; the progress restored on a resume."""
    cfg, env, device, phases = worker.cfg, worker.env, worker.device, worker.phases
    if env.is_main:
        print_config(cfg)
    checkpointer = Checkpointer(cfg, env)
    with phases.enter("checkpoint"):
        loaded: Loaded | None = checkpointer.begin()  # rank 0 chooses; every rank verifies and loads
    model = wrapped(cfg, env, device, checkpointer, loaded)
    # Compiled after wrapping, as torch documents for DDP: its DDPOptimizer splits the graph at DDP's buckets.
    runner = cast(nn.Module, torch.compile(model)) if cfg.compile else model

    batching = Batching.of(cfg, env.world_size)
    feed = feeds.feed(worker.train_set, cfg, batching, env, device)  # map-style or IterableDataset (feeds.py)
    schedule_steps = feed.schedule_steps(cfg)  # the LR schedule ignores --max-steps, so stopping early
    total_steps = min(schedule_steps, cfg.max_steps or schedule_steps)  # and resuming changes nothing

    optimizer = optim.build_optimizer(cfg, unwrap(model), warn=env.is_main)
    schedule = optim.build_schedule(cfg, optimizer, schedule_steps)
    progress = Progress(samples=feed.samples)
    # its run id is checkpointed (and in tracker.json with the lineage): a restart continues the run
    tracker = Tracker.of(cfg, env.is_main, checkpointer.run, bool(loaded and loaded.resume))
    checkpointer.attach(
        model=model, optimizer=optimizer, scheduler=schedule, progress=progress, tracker=tracker, per_rank=feed.stateful
    )
    with phases.enter("checkpoint"):
        resumed = checkpointer.restore(loaded, env.world_size, env.rank) if loaded and loaded.resume else None
    if resumed:
        checkpointer.last_saved = progress.step
        if progress.sample < 0:  # written before the global cursor: micro-batches per rank
            legacy = resumed["progress"]["batch"] * resumed["config"]["batch_size"] * resumed["world_size"]
            progress.sample = legacy
    schedule.set(progress.step)  # the LR of this run's schedule at this step, whatever the checkpoint held

    metrics = Metrics(
        cfg.metrics_path, env.is_main, total_steps, batching.global_batch, cfg.log_every, cfg.tensorboard, tracker
    )
    metrics.start(
        progress.step,
        resumed_from=str(loaded.path) if resumed and loaded else None,
        world_size=env.world_size,
        global_batch=batching.global_batch,
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        process_started=round(process_started(), 3),  # with this record's time: start-up and load costs
        group_joined=round(joined, 3),
        strategy=cfg.strategy,
        **footprint.gathered(model, optimizer),  # gradients and fresh optimizer state: in the first step's "memory"
    )
    if resumed and resumed.get("world_size", env.world_size) != env.world_size:
        report_resize(cfg, env, metrics, resumed, batching, progress.step)
    bf16 = cfg.precision == "bf16" and device.type == "cuda" and cfg.strategy != "fsdp2"  # fsdp2: its policy
    worker.tracer.current_step = lambda: progress.step
    stragglers = Stragglers(env, device, cfg.straggler_factor, cfg.straggler_intervals)
    stragglers.attach(model)
    return Job(
        **{f.name: getattr(worker, f.name) for f in fields(Worker)},
        stop=stop,
        model=model,
        runner=runner,
        optimizer=optimizer,
        schedule=schedule,
        feed=feed,
        batching=batching,
        total_steps=total_steps,
        progress=progress,
        checkpointer=checkpointer,
        metrics=metrics,
        stragglers=stragglers,
        step_mean=StepMean(),
        autocast=torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext(),
        lockstep=fsdp.is_sharded(model),
    )


def wrapped(
    cfg: Config, env: DistEnv, device: torch.device, checkpointer: Checkpointer, loaded: Loaded | None
) -> nn.Module:
    """The model with its weights, on its device, wrapped for --strategy; then per-rank RNG streams."""
    state = model_state(loaded.state, str(loaded.path)) if loaded and not loaded.sharded else None
    source = str(loaded.path) if loaded else ""
    try:
        if cfg.strategy == "fsdp2":
            if loaded and loaded.resume and not loaded.sharded:
                raise UsageError(
                    f"{loaded.path} is a single-file checkpoint, whose optimizer state --strategy fsdp2 cannot shard; "
                    f"resume it with --strategy ddp, or start an fsdp2 run from its weights: --init-from {loaded.path} "
                    "in a new --checkpoint-dir"
                )
            model: nn.Module = fsdp.build(cfg, device, state, source, warn=env.is_main, fresh=loaded is None)
        else:
            model = build(cfg.model, cfg.seed, state, source).to(device)
    except UsageError as exc:
        raise checkpointer.explained(exc, loaded) if loaded else exc from None
    rng.seed_all(cfg.seed + env.rank)  # per-rank streams (dropout) from here on
    if cfg.strategy == "ddp":  # skip the start-up broadcast when all ranks loaded the same verified file
        identical = loaded is not None and loaded.identical
        if identical and loaded and env.is_main and env.is_distributed:
            log.info(f"every rank holds the weights of {loaded.path.name}: DDP start-up broadcast skipped")
        return DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            init_sync=not identical,
            find_unused_parameters=cfg.find_unused_parameters,
        )
    if cfg.strategy == "dp":
        return nn.DataParallel(model)
    return model


def build(spec: str, seed: int, state: dict[str, torch.Tensor] | None, source: str) -> nn.Module:
    """The user's model, initialised from seed, or built on the meta device and given weights."""
    if state is None:
        rng.seed_all(seed)  # identical initial weights on every rank
        return build_model(spec)
    with torch.device("meta"):
        model = build_model(spec)
    tied = shared_parameters(model)  # assign=True gives each use of a tied weight a Parameter of its own:
    tie(load_weights(model, state, source), tied)  # tied again, as built, to the one loaded tensor
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):  # buffers outside the state dict
        rng.seed_all(seed)  # as a fresh start would: random buffers outside the state dict match it
        model = load_weights(build_model(spec), state, source)
    return model


def report_resize(
    cfg: Config, env: DistEnv, metrics: Metrics, resumed: dict[str, Any], batching: Batching, step: int
) -> None:
    """A resume at another world size (a node lost or added): one line, and a record in metrics.jsonl
    and attempts.jsonl with the old and new world size and the step."""
    old, saved = int(resumed["world_size"]), resumed.get("config", {})
    old_batch = saved.get("global_batch_size") or saved.get("batch_size", 0) * saved.get("grad_accum", 1) * old
    metrics.write(
        event="resize", step=step, old_world_size=old, world_size=env.world_size, global_batch=batching.global_batch
    )
    if not env.is_main:
        return
    append_attempt(cfg.run_dir, event="resize", step=step, old_world_size=old, world_size=env.world_size)
    line = f"world size {old} -> {env.world_size} at step {step}"
    if old_batch == batching.global_batch:
        log.info(f"{line}: global batch {batching.global_batch} kept ({batching.grad_accum} micro-batch(es) per step)")
    else:
        log.warning(
            f"{line}: the global batch changes {old_batch} -> {batching.global_batch}, and with it the steps per epoch "
            "and the LR schedule's length; set --global-batch-size to keep the run the same at any world size"
        )
