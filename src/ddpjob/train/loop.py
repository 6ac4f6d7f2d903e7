"""The training loop, readable top to bottom: ``train(job)``, then one way out, ``checkpoint_and_close``.

``run`` is ``ddpjob train``'s worker: set-up (setup.py) builds the Job, ``train`` runs the steps.
One process per device under torchrun (DDP, FSDP2), or one process with nn.DataParallel ("dp") or
with nothing ("none"). Resuming continues at the exact next sample with every RNG restored, so on
CPU a resumed run is bitwise equal to an uninterrupted one; at another world size (a node lost or
added) it continues with the same samples and LR per step (sampling.py, schedule.py), within float
tolerance. Every exit (the last step, a stop signal, a failure) goes through ``checkpoint_and_close``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpjob import log
from ddpjob.checkpoint import stop_record, storage
from ddpjob.checkpoint.weights import unwrap
from ddpjob.config import Config
from ddpjob.distenv import DistEnv
from ddpjob.errors import EXIT_OK, EXIT_PREEMPTED, StorageError, exit_code_for, first_line
from ddpjob.train import footprint, fsdp, setup
from ddpjob.train.batches import forward, to_device
from ddpjob.train.evaluation import evaluate
from ddpjob.train.process import backend_message
from ddpjob.train.setup import Job
from ddpjob.train.stop_signal import signal_name


def run(cfg: Config, env: DistEnv) -> int:
    """One worker of ``ddpjob train``: its exit code (0, or EXIT_PREEMPTED after a stop's checkpoint)."""
    with setup.job(cfg, env) as job:
        try:
            exit_code = train(job)
        except BaseException as exc:  # the loop's frames in its traceback hold the Job too: their locals go
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            del job  # garbage before the tear-down's gc.collect: DDP's reducer must not outlive the process group
    return exit_code


def train(job: Job) -> int:
    """Each optimizer step: its micro-batches forward and backward, the step, the LR, metrics; a
    checkpoint every --save-every steps; a stop signal agreed by every rank ends the run with a
    checkpoint. Each epoch ends with an evaluation. Then the last checkpoint and the final report."""
    cfg, progress, feed, stop = job.cfg, job.progress, job.feed, job.stop
    accum = job.batching.grad_accum
    exit_code, start_time, first_step = EXIT_OK, time.perf_counter(), progress.step
    gc.freeze()  # what set-up allocated is never garbage: keep the collector's passes in the loop short (setup.job thaws)

    try:
        while progress.epoch < cfg.epochs and progress.step < job.total_steps:
            micro = 0
            job.stragglers.start()
            for batch in feed.epoch(progress, job.may_save_after):  # a stream keeps its place for these steps
                micro += 1
                accumulate(job, batch, sync=micro == accum)
                if micro < accum:
                    continue
                micro = 0
                optimizer_step(job, first=progress.step == first_step)

                if cfg.save_every and progress.step % cfg.save_every == 0:
                    save(job)
                if stop.agreed(progress.step):  # a signal: checkpoint, then exit "requeue me"
                    exit_code = checkpoint_and_close(job, stopped=True)
                    return exit_code
                if progress.step >= job.total_steps:
                    break
                job.stragglers.start()
            if feed.epoch_done(progress):
                end_epoch(job)

        exit_code = checkpoint_and_close(job)
        report_final(job, start_time)
        return exit_code
    except BaseException as exc:
        exit_code = checkpoint_and_close(job, failure=exc)
        raise
    finally:
        try:
            with job.phases.enter("eval"):  # the tracker's last records may take --tracker-timeout
                job.metrics.close(step=progress.step, exit_code=exit_code)
        finally:  # also when the close raises
            stop.settle(finished=exit_code == EXIT_OK)


def accumulate(job: Job, batch: Any, sync: bool) -> None:
    """One micro-batch forward and backward; its gradients reach the other ranks only if ``sync``
    (the step's last micro-batch)."""
    model, accum = job.model, job.batching.grad_accum
    batch = to_device(batch, job.device)
    no_sync = model.no_sync() if isinstance(model, DDP) and not sync else contextlib.nullcontext()
    if accum > 1 and fsdp.is_sharded(model):  # reduce-scatter only after the last micro-batch
        fsdp.sync_gradients(model, sync)
    with no_sync:
        with job.autocast:
            result = job.loss(forward(job.runner, batch), batch)
        (result.value / accum if accum > 1 else result.value).backward()
    job.step_mean.add(result)
    job.phases.progress()  # the watchdog's clock; the first one ends start-up


def optimizer_step(job: Job, first: bool) -> None:
    """Clip, step and zero the gradients, count the step, log it, and set the next step's LR."""
    cfg, progress, model, optimizer, metrics = job.cfg, job.progress, job.model, job.optimizer, job.metrics
    step_loss, logged = job.step_mean.take()  # extras averaged over the logging interval, as the loss
    if cfg.grad_clip:  # averaged over ranks here (DDP); fsdp2: the norm of every shard together
        logged["grad_norm"] = fsdp.whole(nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    optimizer.step()
    if first:  # each rank's state, now that gradients and moments exist
        metrics.write(event="memory", step=progress.step + 1, **footprint.gathered(model, optimizer))
    job.stragglers.step_done()
    optimizer.zero_grad(set_to_none=True)
    progress.step += 1
    progress.sample += job.batching.global_batch
    shared = job.stragglers.share() if metrics.due(progress.step) else {}  # one gather per logging interval
    metrics.step(progress.step, progress.epoch, step_loss, job.schedule.lr, logged, **shared)
    job.schedule.set(progress.step)


def end_epoch(job: Job) -> None:
    """An epoch finished: evaluate (given validation data), move on to the next."""
    progress = job.progress
    if job.val_set is not None:
        with job.phases.enter("eval"):
            scores = validation(job)
        job.metrics.write(event="eval", step=progress.step, epoch=progress.epoch, **scores)
        if job.env.is_main:
            log.info(f"epoch {progress.epoch} {summary(scores)}")
    progress.epoch, progress.sample = progress.epoch + 1, 0


def save(job: Job, required: bool = False) -> None:
    with job.phases.enter("checkpoint"):
        job.checkpointer.save(job.progress.step, job.progress.epoch, required)


def checkpoint_and_close(job: Job, stopped: bool = False, failure: BaseException | None = None) -> int:
    """Every exit of the loop, the one place that writes the last checkpoint and closes the checkpointer;
    returns the exit code.

    - The last step: its checkpoint (unless just saved), closed; a failure to save raises.
    - ``stopped`` (a stop signal): the checkpoint of this step, whatever --on-save-error says, then
      EXIT_PREEMPTED ("requeue me") if it is verified on disk; otherwise say what is lost, exit 3.
      The step is recorded first (stop_record.py): `ddpjob launch` verifies its checkpoint once every
      worker has exited, as a rank that gave up waiting on rank 0 cannot know whether it was sealed.
    - ``failure``: nothing new is written (the step may be half done); a write in flight is let finish.
    """
    cfg, progress, checkpointer, stop = job.cfg, job.progress, job.checkpointer, job.stop
    if failure is not None:
        exit_code = exit_code_for(failure)
        checkpointer.drain()
        return exit_code
    if stopped:
        stop_record.record(cfg.run_dir, progress.step, stop.received)
        job.metrics.write(event="preempted", step=progress.step, signal=stop.received)
    else:
        stop.finish()
    try:
        if checkpointer.last_saved != progress.step:
            save(job, required=stopped)
        with job.phases.enter("checkpoint"):
            checkpointer.close(required=stopped)
    except (StorageError, RuntimeError) as exc:
        if not stopped:
            raise
        checkpointer.drain()  # a write of this rank's in flight ends before the verdict
        sealed, _ = stop_record.verified(storage.checkpoint_dir(cfg), progress.step)
        if sealed is not None:
            log.info(f"{first_line(exc)}; but {sealed} is verified on disk")
            return EXIT_PREEMPTED
        reason = (
            first_line(exc)
            if isinstance(exc, StorageError)
            else f"a rank took longer than --save-timeout ({cfg.save_timeout:g} s) or died: {backend_message(exc)}"
        )
        raise StorageError(
            f"stopped on {signal_name(stop.received)} after step {progress.step}, but its checkpoint was not "
            f"saved ({reason}); {stop_record.lost(progress.step, storage.checkpoint_dir(cfg))}"
        ) from None
    if stopped:
        return EXIT_PREEMPTED
    stop_record.record(cfg.run_dir, progress.step, 0)  # a signal from here on stops at this step
    return EXIT_OK


def report_final(job: Job, start_time: float) -> None:
    """After the last checkpoint: the final evaluation, every rank's weights checked equal, the done line."""
    with job.phases.enter("eval"):
        final = validation(job)
        params = check_replicas_equal(unwrap(job.model), job.env)
    if job.env.is_main:
        log.info(
            f"done: step {job.progress.step} {summary(final)} params {params} ({time.perf_counter() - start_time:.1f}s)"
        )
    job.metrics.write(event="final", step=job.progress.step, params=params, **final)


def validation(job: Job) -> dict[str, float]:
    """Evaluation's scores on the validation data; none without it."""
    if job.val_set is None:
        return {}
    return evaluate(unwrap(job.model), job.val_set, job.loss, job.env, job.device, job.cfg.batch_size, job.lockstep)


def summary(scores: dict[str, float]) -> str:
    """'val_loss 0.1234 accuracy 0.9600': evaluation's figures for a log line."""
    return " ".join(f"{name} {value:.4f}" for name, value in scores.items())


def fingerprint(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, shard in model.state_dict().items():
        tensor = fsdp.whole(shard)  # under fsdp2 a collective, tensor by tensor: every rank hashes the whole
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
