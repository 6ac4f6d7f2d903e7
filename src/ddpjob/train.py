"""The training loop, readable top to bottom: set up, load or init, train, checkpoint, evaluate.

One process per device under torchrun (DDP), or one process with nn.DataParallel ("dp") or with
nothing ("none"). Resuming continues at the exact next sample with every RNG restored, so on CPU a
resumed run is bitwise equal to an uninterrupted one; at another world size (a node lost or added)
it continues with the same samples and LR per step (batching.py, schedule.py), within float tolerance.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ddpjob import optim, optional, rng, streams
from ddpjob.batches import forward, to_device
from ddpjob.batching import Batching
from ddpjob.checkpointer import Checkpointer, Loaded
from ddpjob.config import Config, print_config
from ddpjob.distenv import DistEnv
from ddpjob.errors import EXIT_OK, EXIT_PREEMPTED, PeerLost, UsageError, exit_code_for, first_line
from ddpjob.evaluation import evaluate
from ddpjob.losses import Loss
from ddpjob.metrics import Metrics, append_attempt, process_started
from ddpjob.plugins import build_data, build_model, load_callable
from ddpjob.preempt import StopSignal, exit_with_parent
from ddpjob.stragglers import Stragglers
from ddpjob.traces import Tracer, enable_nccl_dumps
from ddpjob.trackers import Tracker
from ddpjob.watchdog import Phases, start_watchdog
from ddpjob.weights import load_weights, model_state, shared_parameters, tie, unwrap


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


def pick_device(cfg: Config, env: DistEnv) -> torch.device:
    """This rank's device, made the current CUDA device before anything touches CUDA: NCCL's
    object collectives, pinned memory, autocast and the CUDA RNG all use the current device."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is visible; use --device cpu or check CUDA_VISIBLE_DEVICES")
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = 0 if cfg.strategy == "dp" else env.local_rank % torch.cuda.device_count()
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def check_setup(cfg: Config, env: DistEnv) -> None:
    """Everything that can be checked before any network wait."""
    Batching.of(cfg, env.world_size)  # a global batch that does not split over these processes
    if cfg.strategy != "ddp" and env.is_distributed:
        raise UsageError(
            f"--strategy {cfg.strategy} runs one process, but {env.source} started {env.world_size}; "
            "use --strategy ddp or launch a single process"
        )
    if cfg.precision == "bf16" and cfg.device == "cpu":
        raise UsageError("--precision bf16 needs CUDA; use --precision fp32 on CPU")
    if cfg.compile and (cfg.device == "cpu" or not torch.cuda.is_available()):
        optional.require_cpu_compiler("--compile")
    ckpt_dir = cfg.checkpoint_path
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"cannot create checkpoint dir {ckpt_dir}: {exc.strerror}; choose a writable --checkpoint-dir"
        ) from None
    if not os.access(ckpt_dir, os.W_OK):
        raise UsageError(f"checkpoint dir {ckpt_dir} is not writable; fix its permissions or set --checkpoint-dir")


def init_process_group(cfg: Config, env: DistEnv, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.startup_timeout)  # until the first step: watchdog.Phases
    if not env.is_distributed:  # DDP in one process: an in-memory store, no network
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if cfg.init_method == "env://":
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    try:
        dist.init_process_group(
            backend, init_method=cfg.init_method, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs
        )
    except dist.DistError as exc:  # a peer that is late, dead or unreachable: a restart may find it
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if cfg.init_method == "env://" else ""
        raise PeerLost(
            f"rank {env.rank}: the {env.world_size} processes did not meet within --startup-timeout "
            f"({cfg.startup_timeout:g} s) ({first_line(exc)}): one did not start or cannot reach "
            f"{where or cfg.init_method}; its log says which"
        ) from None


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


def fingerprint(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_replicas_equal(model: nn.Module, env: DistEnv) -> str:
    """sha256 of the parameters; raises if any rank's differs from rank 0's."""
    mine = fingerprint(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        all_prints: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(all_prints, mine)
        if len(set(all_prints)) != 1:
            raise RuntimeError(f"replicas diverged: parameter fingerprints by rank {all_prints}")
    return mine


def summary(scores: dict[str, float]) -> str:
    """'val_loss 0.1234 accuracy 0.9600': evaluation's figures for a log line."""
    return " ".join(f"{name} {value:.4f}" for name, value in scores.items())


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
    line = f"[ddpjob] world size {old} -> {env.world_size} at step {step}: "
    if old_batch == batching.global_batch:
        print(
            line + f"global batch {batching.global_batch} kept ({batching.grad_accum} micro-batch(es) per step)",
            flush=True,
        )
    else:
        print(
            line + f"warning: the global batch changes {old_batch} -> {batching.global_batch}, and with it the steps "
            "per epoch and the LR schedule's length; set --global-batch-size to keep the run the same at any world size",
            file=sys.stderr,
            flush=True,
        )


UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"  # DDP's words
_PEER_FAILURE = re.compile(r"gloo|nccl|connection (reset|closed|refused)|pair closure|timed out", re.IGNORECASE)


def is_peer_failure(exc: RuntimeError) -> bool:
    """Gloo and NCCL report a dead, hung or cut-off peer as a RuntimeError (or DistError) from a
    collective: "[.../gloo/...] Timed out waiting ...", "Application timeout caused pair closure"."""
    return isinstance(exc, dist.DistError) or bool(_PEER_FAILURE.search(str(exc)))


def backend_message(exc: RuntimeError) -> str:
    """The backend's first sentence, without its source location: 'Timed out waiting 10000ms ...'."""
    return re.sub(r"^\[[^\]]*\]\s*", "", first_line(exc)).split(". This is typically")[0].rstrip(".")


def run(cfg: Config, env: DistEnv) -> int:
    check_setup(cfg, env)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        exit_with_parent()  # an agent killed with SIGKILL must not leave its workers training on
    device = pick_device(cfg, env)
    load_callable(cfg.model)  # import errors surface here, before any network wait
    loss = Loss(cfg.loss, replicas=torch.cuda.device_count() if cfg.strategy == "dp" else 1)
    optim.check_plugins(cfg)
    train_set, val_set = build_data(cfg.data)
    tracer, phases = Tracer(cfg.run_dir, env.rank), Phases(cfg)
    watchdog = start_watchdog(phases, tracer, cfg.heartbeat, cfg.trace_after)
    try:  # from here every exit stops the watchdog (a failed start-up too: it would end the process)
        if cfg.strategy == "ddp":
            if device.type == "cuda":
                enable_nccl_dumps(cfg.run_dir, env.rank)
            init_process_group(cfg, env, device)
        joined = time.time()  # the process group is up (after the rendezvous, on a restart)
        # From here a stop signal is kept, not fatal: loading a checkpoint (waiting for the dir's lock,
        # for shared storage, verifying) can take minutes, and a stop then still ends in a checkpoint.
        # (Before, a blocking rendezvous would hold a handled signal until it returned.)
        stop = StopSignal(cfg.stop_check_every, device)
        return train(cfg, env, device, stop, train_set, val_set, loss, joined, tracer, phases)
    except RuntimeError as exc:
        if UNUSED_PARAMETERS in str(exc):
            raise UsageError(
                "DDP found parameters that got no gradient in a step (the model leaves some out of the loss); "
                "pass --find-unused-parameters, or remove or freeze (requires_grad=False) the unused ones"
            ) from None
        if dist.is_initialized() and is_peer_failure(exc):
            tracer.dump(f"a collective failed: {backend_message(exc)}", keep=True)
            raise PeerLost(
                f"rank {env.rank}: a collective failed ({backend_message(exc)}); a peer died, hung longer than "
                f"{phases.describe()} in {phases.name} or lost its network: that peer's log says which; a restart "
                "(--max-restarts, requeue) resumes from the newest checkpoint"
            ) from None
        raise
    finally:
        watchdog.set()
        # DDP's reducer sits in reference cycles; freed at interpreter exit, its pending gloo work
        # aborts the process ("terminate called without an active exception"). Free it now.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def train(
    cfg: Config,
    env: DistEnv,
    device: torch.device,
    stop: StopSignal,
    train_set: Dataset[Any],
    val_set: Dataset[Any] | None,
    loss: Loss,
    joined: float,
    tracer: Tracer,
    phases: Phases,
) -> int:
    if env.is_main:
        print_config(cfg)

    # Model: weights come from the checkpoint (resume), --init-from, or the seed. Wrap last.
    checkpointer = Checkpointer(cfg, env)
    with phases.enter("checkpoint"):
        loaded: Loaded | None = checkpointer.begin()  # rank 0 chooses; every rank verifies and loads
    state = model_state(loaded.state, str(loaded.path)) if loaded and not loaded.sharded else None
    model: nn.Module = build(cfg.model, cfg.seed, state, str(loaded.path) if loaded else "").to(device)
    rng.seed_all(cfg.seed + env.rank)  # per-rank streams (dropout) from here on
    if cfg.strategy == "ddp":  # skip the start-up broadcast when all ranks loaded the same verified file
        identical = loaded is not None and loaded.identical
        if identical and loaded and env.is_main and env.is_distributed:
            print(f"[ddpjob] every rank holds the weights of {loaded.path.name}: DDP start-up broadcast skipped")
        model = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            init_sync=not identical,
            find_unused_parameters=cfg.find_unused_parameters,
        )
    elif cfg.strategy == "dp":
        model = nn.DataParallel(model)
    # Compiled after wrapping, as torch documents for DDP: its DDPOptimizer splits the graph at DDP's buckets.
    runner = cast(nn.Module, torch.compile(model)) if cfg.compile else model

    batching = Batching.of(cfg, env.world_size)
    feed = streams.feed(train_set, cfg, batching, env, device)  # map-style or IterableDataset (streams.py)
    schedule_steps = feed.schedule_steps(cfg)  # the LR schedule ignores --max-steps, so stopping early
    total_steps = min(schedule_steps, cfg.max_steps or schedule_steps)  # and resuming changes nothing

    optimizer = optim.build_optimizer(cfg, unwrap(model), warn=env.is_main)
    schedule = optim.build_schedule(cfg, optimizer, schedule_steps)
    progress = Progress(samples=feed.samples)
    tracker = Tracker.of(cfg, env.is_main)  # its run id is checkpointed: a restart continues the run
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
    )
    if resumed and resumed.get("world_size", env.world_size) != env.world_size:
        report_resize(cfg, env, metrics, resumed, batching, progress.step)
    bf16 = cfg.precision == "bf16" and device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    tracer.current_step = lambda: progress.step
    own = Stragglers(env, device, cfg.straggler_factor, cfg.straggler_intervals)  # each rank's own step time
    own.attach(model)
    accum = batching.grad_accum

    def may_save_after(step: int) -> bool:
        """Whether a checkpoint may follow optimizer step ``step``: --save-every, a stop check, the last step."""
        every = cfg.save_every and step % cfg.save_every == 0
        return bool(every) or step % stop.check_every == 0 or step >= total_steps

    def save() -> None:
        with phases.enter("checkpoint"):
            checkpointer.save(progress.step, progress.epoch)

    exit_code, start_time = EXIT_OK, time.perf_counter()
    gc.freeze()  # what set-up allocated is never garbage: keep the collector's passes in the loop short

    try:
        while progress.epoch < cfg.epochs and progress.step < total_steps:
            micro = 0
            own.start()
            for batch in feed.epoch(progress, may_save_after):  # a stream keeps its place for these steps
                batch = to_device(batch, device)
                micro += 1
                sync_now = micro == accum
                no_sync = model.no_sync() if isinstance(model, DDP) and not sync_now else contextlib.nullcontext()
                with no_sync:
                    with autocast:
                        result = loss(forward(runner, batch), batch)
                    (result.value / accum if accum > 1 else result.value).backward()
                phases.progress()  # the watchdog's clock; the first one ends start-up
                if not sync_now:
                    continue
                micro = 0
                logged = dict(result.extras)  # averaged over the logging interval, as the loss
                if cfg.grad_clip:  # DDP's gradients are already averaged over ranks here
                    logged["grad_norm"] = nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                own.step_done()
                optimizer.zero_grad(set_to_none=True)
                progress.step += 1
                progress.sample += batching.global_batch
                shared = own.share() if metrics.due(progress.step) else {}  # one gather per logging interval
                metrics.step(progress.step, progress.epoch, result.value, schedule.lr, logged, **shared)
                schedule.set(progress.step)

                if cfg.save_every and progress.step % cfg.save_every == 0:
                    save()
                if stop.agreed(progress.step):  # a signal: checkpoint, then exit "requeue me"
                    if checkpointer.last_saved != progress.step:
                        save()
                    with phases.enter("checkpoint"):
                        checkpointer.close()
                    metrics.write(event="preempted", step=progress.step, signal=stop.received)
                    exit_code = EXIT_PREEMPTED
                    return exit_code
                if progress.step >= total_steps:
                    break
                own.start()
            if feed.epoch_done(progress):
                if val_set is not None:  # epoch finished: evaluate, move on
                    with phases.enter("eval"):
                        scores = evaluate(unwrap(model), val_set, loss, env, device, cfg.batch_size)
                    metrics.write(event="eval", step=progress.step, epoch=progress.epoch, **scores)
                    if env.is_main:
                        print(f"[ddpjob] epoch {progress.epoch} {summary(scores)}", flush=True)
                progress.epoch, progress.sample = progress.epoch + 1, 0

        stop.finish()
        if checkpointer.last_saved != progress.step:
            save()
        with phases.enter("checkpoint"):
            checkpointer.close()
        with phases.enter("eval"):
            final = evaluate(unwrap(model), val_set, loss, env, device, cfg.batch_size) if val_set is not None else {}
            params = check_replicas_equal(unwrap(model), env)
        if env.is_main:
            print(
                f"[ddpjob] done: step {progress.step} {summary(final)} params {params} "
                f"({time.perf_counter() - start_time:.1f}s)",
                flush=True,
            )
        metrics.write(event="final", step=progress.step, params=params, **final)
        return exit_code
    except BaseException as exc:
        exit_code = exit_code_for(exc)
        raise
    finally:
        with phases.enter("eval"):  # the tracker's last records may take --tracker-timeout
            metrics.close(step=progress.step, exit_code=exit_code)
        stop.settle()
        gc.unfreeze()
