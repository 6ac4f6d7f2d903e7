"""The checkpoint interface the training loop calls: where to start from, save, and prune.
(What a dir holds is checkpoint.catalogue's; which checkpoint a start uses, checkpoint.choice's; the
host copies of async saves, checkpoint.staging's.)

``Checkpointer.begin`` (collective): rank 0 locks the checkpoint dir (one live writing job per
dir), removes the temporaries of killed saves, and chooses what to start from: the newest valid
checkpoint (``--resume auto``), a given one, or ``--init-from`` weights. It refuses, in one line
(exit 2), a start that would overwrite or mix with checkpoints it did not write. It broadcasts
its choice; each other rank waits (``--fs-timeout``) until the file is visible on its own view of
shared storage and matches, so a lagging NFS client is a retriable failure (exit 1), not bad input.

Each run has a lineage id (``run``), kept in every manifest: a resume continues its checkpoint's
lineage, a fresh start begins one. ``--keep`` prunes only the run's own lineage.

Saves (``save``) go through one of the two formats, which do not know about each other:
``ddpjob.checkpoint.formats.single_file`` (one file, rank 0 writes) and ``ddpjob.checkpoint.formats.dcp_folder`` (DCP, every rank writes).
Every checkpoint collective runs on a gloo group of its own with ``--save-timeout``, so a long
save on slow storage never looks like a dead peer to the training group's ``--collective-timeout``.
``--save-mode async`` copies the state to host memory (reusing the copy between saves; tied
tensors stay tied) and writes it from a thread: no fork, one extra host copy of the state.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpjob import config, log
from ddpjob.checkpoint import dirlock, storage, weights
from ddpjob.checkpoint.catalogue import FULL, format_of, prune, remove_temporaries, step_of, verify
from ddpjob.checkpoint.choice import Choice, Loaded, _classify, choose, wait_visible
from ddpjob.checkpoint.formats import dcp_folder, hf_safetensors, single_file
from ddpjob.checkpoint.staging import _Pending, stage
from ddpjob.checkpoint.storage import Where
from ddpjob.config import Config
from ddpjob.distenv import DistEnv
from ddpjob.errors import Retriable, StorageError, UsageError, denied, first_line
from ddpjob.train import optim, rng


class Checkpointer:
    """Starts the run from the right checkpoint and saves the run's stateful objects.

    Rank 0 writes single files; every rank writes its part of a DCP folder. Every rank learns
    whether a save worked. ``attach`` names the objects to save (each with ``state_dict`` and
    ``load_state_dict``; ``model`` and ``optimizer`` at least).
    """

    def __init__(self, cfg: Config, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.distributed = dist.is_initialized() and env.world_size > 1
        self.stateful: dict[str, Any] = {}
        self.per_rank: dict[str, Any] = {}
        self.run = ""
        self.directory = storage.checkpoint_dir(cfg)  # a local folder or an object store prefix
        storage.set_retry_for(cfg.save_timeout)  # transient store failures are retried that long, then a save error
        self.mapped: Where | None = None  # the file the run started from, which its tensors may map
        self.last_saved = -1
        self.lock_fd: int | None = None
        self.pending: _Pending | dcp_folder.Pending | None = None
        self.staged: list[torch.Tensor] = []  # host copy reused between async file saves
        timeout = timedelta(seconds=cfg.save_timeout)
        # Checkpoint collectives: on a gloo group with the save timeout. Async DCP writes from a
        # thread on a second group, so the loop's save collectives never interleave with them.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self.writer_group, self.stager = None, None
        if cfg.checkpoint_format == "dcp" and cfg.save_mode == "async":
            self.stager = dcp_folder.reusable_stager()
            self.writer_group = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None

    # ---- start ---------------------------------------------------------------------------------
    def begin(self) -> Loaded | None:
        """Collective: lock, clean, choose (rank 0), verify together, then every rank loads what
        rank 0 chose. Where every rank reads the checkpoint, the ranks of each node check a share
        of its checksums each (so a node reads it once, in parallel); if the newest one then fails,
        rank 0 chooses again without it."""
        skip: frozenset[str] = frozenset()
        while isinstance(found := self._choose_and_verify(skip), str):
            skip |= {found}
        if (
            found is not None and not found.sharded and isinstance(found.path, Path)
        ):  # memory-mapped: never pruned under us
            self.mapped = found.path
        return found

    def _choose_and_verify(self, skip: frozenset[str]) -> Loaded | str | None:
        """What to start from; or the name of a checkpoint that failed the shared verification
        under --resume auto (to be skipped on the next choice)."""
        rank0_reads = self.cfg.load_mode == "rank0" and self.distributed
        together = self.distributed and not rank0_reads  # every rank reads it: verify it together
        choice = Choice(None, False, "")
        if self.env.is_main:
            try:
                if self.lock_fd is None:
                    self._prepare_dir()
                choice = choose(self.cfg, None if together else FULL, skip)
                if (
                    choice.path
                    and format_of(choice.path) is dcp_folder
                    and self.cfg.load_mode == "rank0"
                    and self.distributed
                ):
                    raise UsageError(f"{choice.path} is a DCP folder, which every rank reads; use --load-mode mmap")
            except Exception as exc:  # never leave the other ranks waiting for a choice
                choice.error, choice.retriable = _classify(exc)
        if self.distributed:
            box = [choice]
            dist.broadcast_object_list(box, src=0, group=self.group)
            choice = box[0]
        self._raise(choice.error, choice.retriable)
        self.run = choice.run
        path = choice.local(self.directory)
        if path is None:
            return None
        if rank0_reads:  # rank 0 reads, then tells the others whether it could, then sends
            state = self._together(lambda: self._read(path), self.env.is_main)
            return Loaded(weights.broadcast(state, self.group), path, choice.resume, identical=True)
        # Every rank sees rank 0's choice, or every rank stops.
        self._together(
            lambda: wait_visible(path, choice, self.cfg.fs_timeout, self.env.rank),
            not self.env.is_main,
        )
        if together and (reason := self._verify_shares(path, choice.sealed)):
            if choice.resume and self.cfg.resume == "auto":
                if self.env.is_main:
                    log.warning(f"skipping checkpoint {path}: {reason}")
                return path.name
            raise UsageError(f"checkpoint {path} failed its integrity check: {reason}; use an earlier one")
        if path.is_dir() and choice.resume:
            return Loaded(None, path, True)
        return Loaded(self._read(path), path, choice.resume, identical=True)

    def _verify_shares(self, path: Where, sealed: bool) -> str:
        """Collective: the ranks on each host split path's checksums between them (hosts are
        compared, not LOCAL_RANK taken on trust); the failure every host found, or "". A failure
        that only some hosts see, or an I/O error, is their view of the storage lagging or failing,
        not a corrupt checkpoint: Retriable."""
        host = socket.gethostname()
        hosts: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(hosts, host, group=self.group)
        peers = [r for r, h in enumerate(hosts) if h == host]
        reason, error, retriable = "", "", True
        try:
            reason = (verify(path, (peers.index(self.env.rank), len(peers))) or "") if sealed else ""
        except OSError as exc:
            error = f"rank {self.env.rank} on {host} cannot read {path}: {first_line(exc)}"
            if problem := denied(exc, str(path)):  # permission denied: no retry clears it
                error, retriable = str(problem), False
        found: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(found, (host, reason, error, retriable), group=self.group)
        if errors := [(e, r) for _, _, e, r in found if e]:
            self._raise(*errors[0])
        failing = {h for h, r, _, _ in found if r}
        if failing and failing != set(hosts):
            raise Retriable(
                f"checkpoint {path} fails its check on {', '.join(sorted(failing))} but not on the other hosts "
                f"({next(r for _, r, _, _ in found if r)}): their view of shared storage is stale; a restart retries"
            )
        return next((r for _, r, _, _ in found if r), "")

    def _prepare_dir(self) -> None:
        """Rank 0: take the dir's lock (an object store: probe that the prefix can be listed and
        written), then remove the temporaries of saves that were killed."""
        directory = self.directory
        if isinstance(directory, Path):
            self.lock_fd = dirlock.acquire(directory, wait=10.0)
        else:
            storage.of(directory).probe(directory)
            self.lock_fd = -1  # no lock on an object store: probed and cleaned once
        if removed := remove_temporaries(directory):
            log.info(f"removed {len(removed)} leftover(s) of killed saves: {', '.join(removed)}")

    def _together(self, work: Callable[[], Any], mine: bool) -> Any:
        """Run work where ``mine``; every rank learns whether it failed anywhere and raises, so no
        rank is left waiting in a collective for one that stopped. Returns work's result."""
        result, error, retriable = None, "", False
        try:
            if mine:
                result = work()
        except Exception as exc:
            error, retriable = _classify(exc)
        if self.distributed:
            outcomes: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(outcomes, (error, retriable), group=self.group)
            failed = [o for o in outcomes if o[0]]
            if failed:
                error, retriable = error or failed[0][0], any(o[1] for o in failed)
        self._raise(error, retriable)
        return result

    @staticmethod
    def _raise(error: str, retriable: bool) -> None:
        if error:
            raise Retriable(error) if retriable else UsageError(error)

    @staticmethod
    def _read(path: Where) -> Any:
        if (
            isinstance(path, Path) and format_of(path) is hf_safetensors
        ):  # a .safetensors file or a sharded set: memory-mapped, shard by shard
            return {"model": hf_safetensors.read(path)}
        if path.is_dir():  # --init-from a DCP folder: its model weights, like any state dict
            return {"model": dcp_folder.read_model(path, verified=True)}
        return single_file.read(path, verified=True)

    def explained(self, error: UsageError, loaded: Loaded) -> UsageError:
        """A checkpoint that does not fit the model: when --resume auto found it in the checkpoint dir
        and another job wrote it (other --model or --data), the error says so and names the fix."""
        if self.cfg.resume != "auto" or not loaded.resume:
            return error
        try:
            state = dcp_folder.read_extra(loaded.path) if loaded.sharded else loaded.state
            written = {k: str(state["config"][k]) for k in ("model", "data")}
        except Exception:  # no stored config to compare: the error as it was
            return error
        mine = {k: v for k, v in self.cfg.to_dict().items() if k in written}
        if written == mine:
            return error
        return UsageError(
            f"checkpoint dir {self.directory} holds another job's checkpoints ({loaded.path.name}: --model "
            f"{written['model']} --data {written['data']}; this job: --model {mine['model']} --data {mine['data']}), "
            "which do not fit this model; give each job its own --run-dir (or --checkpoint-dir)"
        )

    def attach(self, per_rank: dict[str, Any] | None = None, **stateful: Any) -> None:
        """``per_rank``: objects whose state differs by rank (a stream's position): each rank's
        ``state_dict()`` is gathered into a list, given back whole to ``load_rank_states(list)``."""
        self.stateful, self.per_rank = stateful, per_rank or {}

    def restore(self, loaded: Loaded, world_size: int, rank: int) -> dict[str, Any]:
        """Resume: load the optimizer, scheduler and progress, and this rank's RNG (at another world
        size, where no saved stream is this rank's, seed it from seed, step and rank); the rest of the state.
        The optimizer must be the checkpoint's kind and layout; its settings stay this run's (train/optim.py)."""
        optimizer = self.stateful["optimizer"]
        mine, settings = optim.layout(optimizer), optim.settings(optimizer)
        if loaded.sharded:  # DCP: read into the live model and optimizer, at any world size
            try:
                resumed = dcp_folder.load(loaded.path, self.stateful["model"], optimizer, self.group, verified=True)
            except UsageError as exc:
                raise self.explained(exc, loaded) from None
        else:
            resumed = loaded.state
        tracker = resumed.get("tracker") or {}  # a run of this --tracker: its project and name cannot change
        tracker_run = tracker.get("run_id", "") if tracker.get("kind") == self.cfg.tracker != "none" else ""
        config.check_resume(self.cfg, resumed.get("config"), str(loaded.path), tracker_run)
        optim.check_resume(resumed, mine, str(loaded.path))  # a file's before its optimizer state is loaded
        in_place = {"model", "optimizer"} if loaded.sharded else {"model"}
        for name, obj in self.stateful.items():
            if name not in in_place and name in resumed:
                obj.load_state_dict(resumed[name])
        for name, obj in self.per_rank.items():
            obj.load_rank_states(resumed.get("ranks", {}).get(name))
        optim.keep_settings(optimizer, settings)
        rng_states = resumed["rng"]
        if len(rng_states) == world_size:
            rng.set_state(rng_states[rank])
        else:  # no stream to continue: fresh ones, the same for every resume of this step at this size
            rng.seed_all(rng.derived_seed(self.cfg.seed, int(resumed.get("step", 0)), rank))
        return resumed

    # ---- save ----------------------------------------------------------------------------------
    def save(self, step: int, epoch: int, required: bool = False) -> None:
        """Collective: write a checkpoint of step. A failure raises StorageError, or, with
        ``--on-save-error warn`` and not ``required`` (a stop's checkpoint is), is logged."""
        # Rank 0's small states (progress, schedule, tracker) go to every rank: a DCP folder keeps
        # the extras of whichever rank its planner picks, and only rank 0 knows the tracker's run.
        per_rank = {name: obj.state_dict() for name, obj in self.per_rank.items()}
        mine = (rng.get_state(), per_rank, self._small_states(step) if self.env.is_main else {})
        gathered: list[Any] = [mine]
        if self.distributed:
            gathered = [None] * self.env.world_size
            dist.all_gather_object(gathered, mine, group=self.group)
        about = dict(
            format=single_file.FORMAT,
            step=step,
            epoch=epoch,
            run=self.run,
            rng=[state for state, _, _ in gathered],
            config=self.cfg.to_dict(),
            optimizer_layout=optim.layout(self.stateful["optimizer"]),
            world_size=self.env.world_size,
            torch_version=str(torch.__version__),
        )
        if self.per_rank:
            about["ranks"] = {name: [states[name] for _, states, _ in gathered] for name in self.per_rank}
        small = gathered[0][2]
        error = small if isinstance(small, str) else ""
        try:
            self.wait()  # at most one save in flight
            if error:
                pass
            elif self.cfg.checkpoint_format == "dcp":
                self._save_sharded(step, small | about)
            elif self.env.is_main:
                self._save_file(step, small | about)
        except StorageError as exc:
            error = str(exc)
        except Exception as exc:  # e.g. a stateful object that cannot be pickled: never leave the others waiting
            error = f"cannot write checkpoint for step {step}: {first_line(exc)}"
        if self._agree(error, required):
            self.last_saved = step

    def _small_states(self, step: int) -> dict[str, Any] | str:
        """Rank 0's states other than the model's and the optimizer's, or why they cannot be sent:
        all_gather_object pickles them, and a failure there must not leave the other ranks waiting."""
        try:
            states = {n: o.state_dict() for n, o in self.stateful.items() if n not in ("model", "optimizer")}
            pickle.dumps(states)
        except Exception as exc:  # e.g. a user's schedule holding a lambda
            return f"cannot write checkpoint for step {step}: {first_line(exc)}"
        return states

    def _save_file(self, step: int, extra: dict[str, Any]) -> None:
        """Rank 0 writes the whole state to one file (async: from a thread); extra: as for DCP.
        A save the other ranks gave up waiting for (--save-timeout) is still finished and sealed:
        whether a stop's checkpoint exists is decided by verifying it on disk (stop_record.py)."""
        state = {"optimizer": self.stateful["optimizer"].state_dict(), **extra}
        state["model"] = weights.unwrap(self.stateful["model"]).state_dict()
        path = single_file.path_for(self.directory, step)
        if self.cfg.save_mode == "async":
            state, self.staged = stage(state, self.staged)

            def write() -> None:
                single_file.save(state, path, self.run)
                self._done(path)

            self.pending = _Pending(write)
        else:
            single_file.save(state, path, self.run)
            self._done(path)

    def _save_sharded(self, step: int, extra: dict[str, Any]) -> None:
        """Every rank writes its part of a DCP folder (async: from a thread); extra: the same on every rank."""
        model, optimizer, directory = self.stateful["model"], self.stateful["optimizer"], self.directory
        if self.cfg.save_mode == "async":
            self.pending = dcp_folder.save_async(
                directory,
                step,
                model,
                optimizer,
                extra,
                self.group,
                self.writer_group,
                self._done,
                self.run,
                self.stager,
            )
            return
        path = dcp_folder.save(directory, step, model, optimizer, extra, self.group, self.run)
        if self.env.is_main:
            self._done(path)

    def close(self, required: bool = False) -> None:
        """Wait for a save in flight; every rank learns whether it worked (``required``: as in save)."""
        error = ""
        try:
            self.wait()
        except StorageError as exc:
            error = str(exc)
        if self.stager:
            self.stager.close()
        self._agree(error, required)
        if self.lock_fd is not None and self.lock_fd >= 0:
            dirlock.release(self.lock_fd)
            self.lock_fd = None

    def _done(self, path: Where) -> None:  # rank 0, once the checkpoint is complete
        prune(self.directory, self.cfg.keep, self.run, step_of(path) or 0, self.mapped)
        log.info(f"saved {path}")

    def drain(self) -> None:
        """On the way out after a failure: let a write in flight finish (sealed or not), never
        leaving a thread inside torch.save as the interpreter exits (that aborts the process)."""
        try:
            self.wait()
        except Exception as exc:
            log.failure(f"the save in flight failed too: {first_line(exc)}")

    def wait(self) -> None:
        """Until the save in flight (if any) is on disk; raises its StorageError."""
        pending, self.pending = self.pending, None
        if pending:
            pending.wait()

    def _agree(self, error: str, required: bool = False) -> bool:
        """Rank 0 tells everyone how its save went (also the barrier after a save). True if it
        worked; a failure raises, or (``--on-save-error warn``, not ``required``) is logged and
        returns False."""
        if self.distributed:
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self.group)
            error = box[0]
        if not error:
            return True
        if self.cfg.on_save_error == "fail" or required:
            raise StorageError(error)
        if self.env.is_main:
            log.warning(f"checkpoint NOT saved, training goes on (--on-save-error warn): {error}")
        return False
