"""The checkpoint interface the training loop calls: where to start from, save, and prune.

``Checkpointer.begin`` (collective): rank 0 locks the checkpoint dir (one live writing job per
dir), removes the temporaries of killed saves, and chooses what to start from: the newest valid
checkpoint (``--resume auto``), a given one, or ``--init-from`` weights. It refuses, in one line
(exit 2), a start that would overwrite or mix with checkpoints it did not write. It broadcasts
its choice; each other rank waits (``--fs-timeout``) until the file is visible on its own view of
shared storage and matches, so a lagging NFS client is a retriable failure (exit 1), not bad input.

Each run has a lineage id (``run``), kept in every manifest: a resume continues its checkpoint's
lineage, a fresh start begins one. ``--keep`` prunes only the run's own lineage.

Saves (``save``) go through one of the two formats, which do not know about each other:
``ddpjob.checkpoint`` (one file, rank 0 writes) and ``ddpjob.sharded`` (DCP, every rank writes).
Every checkpoint collective runs on a gloo group of its own with ``--save-timeout``, so a long
save on slow storage never looks like a dead peer to the training group's ``--collective-timeout``.
``--save-mode async`` copies the state to host memory (reusing the copy between saves; tied
tensors stay tied) and writes it from a thread: no fork, one extra host copy of the state.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ddpjob import checkpoint, dirlock, fsutil, hfweights, optim, rng, sharded, weights
from ddpjob.config import Config
from ddpjob.distenv import DistEnv
from ddpjob.errors import Retriable, StorageError, UsageError, first_line

_STEP = re.compile(r"^step-(\d+)(\.pt)?$")  # a file (ddpjob.checkpoint), or a DCP folder (ddpjob.sharded)


def format_of(path: Path) -> ModuleType:
    """The format module that reads path: safetensors weights (a file, or a Hugging Face folder or
    index), else a folder is DCP and a file the single-file format. A ddpjob checkpoint (named
    ``step-N``) is never safetensors: only the other two can verify, remove or tell its run."""
    if step_of(path) is None and hfweights.is_weights(path):
        return hfweights
    return sharded if path.is_dir() else checkpoint


def unknown_folder(path: Path) -> str:
    """Why path, a folder, is none of the forms ddpjob reads ("" if it is one): neither safetensors
    weights nor a DCP checkpoint (DCP's .metadata, or ddpjob's marker of one)."""
    if (
        not path.is_dir()
        or format_of(path) is not sharded
        or any((path / n).exists() for n in (".metadata", sharded.MARKER))
    ):
        return ""
    found = sorted(p.name for p in path.iterdir())
    held = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "") if found else "nothing"
    torch_file = next((path / n for n in found if n.endswith((".bin", ".pt", ".pth"))), None)
    fix = f"name the torch file itself ({torch_file})" if torch_file else "name a weights file itself"
    return (
        f"{path} holds {held}: no safetensors weights ({hfweights.SINGLE} or {hfweights.INDEX}) and no DCP "
        f"checkpoint (.metadata); {fix}"
    )


def step_of(path: Path) -> int | None:
    return int(m.group(1)) if (m := _STEP.match(path.name)) else None


def list_steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-<N>.pt file and step-<N> DCP folder in directory, newest first."""
    if not directory.is_dir():
        return []
    return sorted(((s, p) for p in directory.iterdir() if (s := step_of(p)) is not None), reverse=True)


FULL: tuple[int, int] = (0, 1)  # verify every checksum; (part, parts) a share of them; None sizes only


def verify(path: Path, share: tuple[int, int] | None = FULL) -> str | None:
    return format_of(path).verify(path, share)


def latest_valid(
    directory: Path, share: tuple[int, int] | None = FULL, skip: frozenset[str] = frozenset()
) -> Path | None:
    """The newest checkpoint whose manifest matches (checked as far as ``share`` says), other than
    those named in ``skip``; each one skipped for a reason is named in a warning."""
    for _, path in list_steps(directory):
        if path.name in skip:
            continue
        reason = verify(path, share)
        if reason is None:
            return path
        print(f"[ddpjob] warning: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
    return None


def has_manifest(path: Path) -> bool:
    """Whether path has ddpjob's integrity record (safetensors weights never do: ddpjob does not
    seal them, and a stray one beside them is not theirs)."""
    if format_of(path) is hfweights:
        return False
    return (path / sharded.MARKER if path.is_dir() else checkpoint.manifest_path(path)).exists()


def checkable(path: Path) -> bool:
    """Whether path is held to an integrity record: a DCP folder always (ddpjob's marker), a file
    when it has a manifest (a plain state dict or safetensors weights from elsewhere have none)."""
    return format_of(path) is sharded or has_manifest(path)


def complete(directory: Path) -> list[tuple[int, Path]]:
    """Checkpoints whose save finished (they have a manifest), newest first, without reading them."""
    return [(s, p) for s, p in list_steps(directory) if has_manifest(p)]


def prune(directory: Path, keep: int, run: str, saved: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints of lineage ``run`` up to step ``saved``
    (the one just written); nobody else's. Later ones of the run can only be corrupt ones that a
    resume skipped: they neither count nor go, and later saves overwrite them."""
    own = [p for s, p in complete(directory) if s <= saved and format_of(p).run_of(p) == run]
    for path in own[keep:]:
        format_of(path).remove(path)


def remove_temporaries(directory: Path) -> list[str]:
    """Remove what killed saves left (``.step-N.pt.tmp-*``, ``.step-N.tmp/``, ...). Only safe while
    holding the dir lock: then no live save of any job is writing them."""
    removed = []
    for path in directory.iterdir() if directory.is_dir() else []:
        if (final := fsutil.set_aside_from(path)) and not final.exists():
            os.replace(path, final)  # a swap died between its two renames: the old folder is the checkpoint
            continue
        if fsutil.is_temp(path.name):
            if path.is_dir():
                sharded.remove(path)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _classify(exc: Exception) -> tuple[str, bool]:
    """(one-line message, retriable): storage trouble and lag may clear; anything else is input."""
    if isinstance(exc, UsageError | Retriable):
        return str(exc), isinstance(exc, Retriable)
    if isinstance(exc, OSError):
        return f"cannot read the checkpoint dir: {first_line(exc)}", True
    return f"unusable checkpoint: {first_line(exc)}", False


@dataclass
class Choice:
    """What rank 0 chose to start from, sent to every rank."""

    path: Path | None
    resume: bool
    run: str  # the lineage this job writes
    identity: str = ""  # content identity of path, to check every rank sees the same
    error: str = ""  # rank 0's error, raised on every rank: UsageError, else (``retriable``) Retriable
    retriable: bool = False
    in_dir: bool = False  # path is in rank 0's checkpoint dir
    sealed: bool = False  # path has a manifest (ddpjob's marker for a DCP folder) on rank 0

    def local(self, directory: Path) -> Path | None:
        """The chosen path as this rank names it: a checkpoint of rank 0's checkpoint dir is looked
        up in this rank's own (the same path on shared storage, or a node's local copy)."""
        return directory / self.path.name if self.path is not None and self.in_dir else self.path


@dataclass
class Loaded:
    """What a run starts from: a checkpoint to resume, or weights to initialise from.
    A DCP resume (``state`` None) is read later, into the live model and optimizer."""

    state: Any
    path: Path
    resume: bool
    identical: bool = False  # every rank provably holds the same weights: skip DDP's start-up broadcast

    @property
    def sharded(self) -> bool:
        return self.state is None


def choose(cfg: Config, share: tuple[int, int] | None = FULL, skip: frozenset[str] = frozenset()) -> Choice:
    """Rank 0: the checkpoint to start from and the lineage to write, or UsageError. Checksums are
    checked as far as ``share`` says (None: sizes only, when the ranks verify together after)."""
    directory = cfg.checkpoint_path
    path, resume = None, False
    if cfg.resume not in ("auto", "never"):
        path, resume = given(cfg.resume, "--resume", share), True
    elif cfg.resume == "auto" and (newest := latest_valid(directory, share, skip)):
        path, resume = newest, True
    run = format_of(path).run_of(path) if path and resume else uuid.uuid4().hex[:12]
    start = (step_of(path) or 0) if path and resume else 0
    # Later checkpoints that this run would overwrite or that --resume auto would prefer to it:
    # any of another lineage, and valid ones of its own (a corrupt newer one of its own is not).
    clash = [
        (s, p)
        for s, p in complete(directory)
        if s > start and (format_of(p).run_of(p) != run or (p.name not in skip and not verify(p)))
    ]
    if clash:
        names = f"{clash[-1][1].name} … {clash[0][1].name}" if len(clash) > 1 else clash[0][1].name
        what = f"resuming from {path.name} (step {start})" if path and resume else "a fresh start"
        raise UsageError(
            f"checkpoint dir {directory} holds {len(clash)} later checkpoint(s) ({names}) that {what} would "
            "overwrite or mix with; continue them with --resume auto, or start afresh in another "
            "--checkpoint-dir (or move them away)"
        )
    if not resume and cfg.init_from:
        path = given(cfg.init_from, "--init-from", share)
    in_dir = path is not None and path.parent.resolve() == directory.resolve()
    identity, sealed = (format_of(path).identity(path), has_manifest(path)) if path else ("", False)
    return Choice(path, resume, run, identity, in_dir=in_dir, sealed=sealed)


def given(name: str, flag: str, share: tuple[int, int] | None = FULL) -> Path:
    """A checkpoint named by the user: it exists and, where it has a manifest, matches it. A DCP
    folder needs its marker (ddpjob's integrity record); a plain file may have no manifest."""
    path = Path(name)
    if not path.exists():
        raise UsageError(f"{flag} {path} does not exist; check the path")
    if problem := unknown_folder(path):
        raise UsageError(f"{flag} {problem}")
    if flag == "--resume" and format_of(path) is hfweights:
        raise UsageError(f"--resume {path}: safetensors hold model weights only; start from them with --init-from")
    if checkable(path) and (reason := verify(path, share)):
        raise UsageError(f"checkpoint {path} failed its integrity check: {reason}; use an earlier one")
    return path


def wait_visible(path: Path, choice: Choice, timeout: float, rank: int) -> None:
    """Until path is complete and is what rank 0 chose (the same identity): a checkpoint, or the
    weights of --init-from. A file that does not show up in time, or is still being copied (another
    size), is a retriable failure; one that differs is bad input (storage not shared, other copies)."""
    deadline, told = time.monotonic() + timeout, False
    identity, sealed, in_dir = choice.identity, choice.sealed, choice.in_dir
    what = "checkpoint" if choice.resume else "--init-from weights"
    unshared = "--checkpoint-dir is not shared between nodes" if in_dir else f"{path} is not on storage all nodes share"
    while True:
        mine, reason = "", "not visible"
        if path.exists():  # sealed: rank 0 saw its manifest, so this rank waits for it too (NFS lag)
            reason = (verify(path, None) or "") if sealed else ""
            try:
                mine = "" if reason else format_of(path).identity(path)
            except UsageError:  # a sharded set whose shards are not all here yet
                reason = "incomplete (a shard is missing)"
        if mine == identity:
            return
        if mine and format_of(path) is not sharded and _sizes(mine) != _sizes(identity):
            mine, reason = "", "incomplete (a file is still being copied: its size is not rank 0's)"
        if mine:
            fix = "put --checkpoint-dir on shared storage" if in_dir else "give every node the same files at that path"
            pairs = zip(mine.split(";"), identity.split(";"), strict=False)
            ours, theirs = next(((a, b) for a, b in pairs if a != b), (mine, identity))
            raise UsageError(
                f"rank {rank} sees another {path} than rank 0 ({ours} vs {theirs}); {fix} or use --load-mode rank0"
            )
        if not told:
            print(f"[ddpjob] rank {rank}: waiting up to {timeout:g} s to see {path} ({reason})", flush=True)
            told = True
        if time.monotonic() >= deadline:
            raise Retriable(
                f"rank {rank}: {what} {path} that rank 0 chose is {reason} here after --fs-timeout "
                f"{timeout:g} s; shared storage is lagging (a restart retries), or {unshared} "
                "(then use --load-mode rank0)"
            )
        time.sleep(0.5)


def _sizes(identity: str) -> list[str]:
    """``name:size`` of each file in an identity made of ``name:size:digest`` parts joined by ``;``."""
    return [":".join(part.split(":")[:2]) for part in identity.split(";")]


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
        self.last_saved = -1
        self.lock_fd: int | None = None
        self.pending: _Pending | sharded.Pending | None = None
        self.staged: list[torch.Tensor] = []  # host copy reused between async file saves
        timeout = timedelta(seconds=cfg.save_timeout)
        # Checkpoint collectives: on a gloo group with the save timeout. Async DCP writes from a
        # thread on a second group, so the loop's save collectives never interleave with them.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self.writer_group, self.stager = None, None
        if cfg.checkpoint_format == "dcp" and cfg.save_mode == "async":
            self.stager = sharded.reusable_stager()
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
                    and format_of(choice.path) is sharded
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
        path = choice.local(self.cfg.checkpoint_path)
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
                    print(f"[ddpjob] warning: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
                return path.name
            raise UsageError(f"checkpoint {path} failed its integrity check: {reason}; use an earlier one")
        if path.is_dir() and choice.resume:
            return Loaded(None, path, True)
        return Loaded(self._read(path), path, choice.resume, identical=True)

    def _verify_shares(self, path: Path, sealed: bool) -> str:
        """Collective: the ranks on each host split path's checksums between them (hosts are
        compared, not LOCAL_RANK taken on trust); the failure every host found, or "". A failure
        that only some hosts see, or an I/O error, is their view of the storage lagging or failing,
        not a corrupt checkpoint: Retriable."""
        host = socket.gethostname()
        hosts: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(hosts, host, group=self.group)
        peers = [r for r, h in enumerate(hosts) if h == host]
        reason, error = "", ""
        try:
            reason = (verify(path, (peers.index(self.env.rank), len(peers))) or "") if sealed else ""
        except OSError as exc:
            error = f"rank {self.env.rank} on {host} cannot read {path}: {first_line(exc)}"
        found: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(found, (host, reason, error), group=self.group)
        if errors := [e for _, _, e in found if e]:
            raise Retriable(errors[0])
        failing = {h for h, r, _ in found if r}
        if failing and failing != set(hosts):
            raise Retriable(
                f"checkpoint {path} fails its check on {', '.join(sorted(failing))} but not on the other hosts "
                f"({next(r for _, r, _ in found if r)}): their view of shared storage is stale; a restart retries"
            )
        return next((r for _, r, _ in found if r), "")

    def _prepare_dir(self) -> None:
        """Rank 0: take the dir's lock, then remove the temporaries of saves that were killed."""
        directory = self.cfg.checkpoint_path
        self.lock_fd = dirlock.acquire(directory, wait=10.0)
        if removed := remove_temporaries(directory):
            print(f"[ddpjob] removed {len(removed)} leftover(s) of killed saves: {', '.join(removed)}", flush=True)

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
    def _read(path: Path) -> Any:
        if format_of(path) is hfweights:  # a .safetensors file or a sharded set: memory-mapped, shard by shard
            return {"model": hfweights.read(path)}
        if path.is_dir():  # --init-from a DCP folder: its model weights, like any state dict
            return {"model": sharded.read_model(path, verified=True)}
        return checkpoint.read(path, verified=True)

    def attach(self, per_rank: dict[str, Any] | None = None, **stateful: Any) -> None:
        """``per_rank``: objects whose state differs by rank (a stream's position): each rank's
        ``state_dict()`` is gathered into a list, given back whole to ``load_rank_states(list)``."""
        self.stateful, self.per_rank = stateful, per_rank or {}

    def restore(self, loaded: Loaded, world_size: int, rank: int) -> dict[str, Any]:
        """Resume: load the optimizer, scheduler and progress, and this rank's RNG (at another world
        size, where no saved stream is this rank's, seed it from seed, step and rank); the rest of the state.
        The optimizer must be the checkpoint's kind and layout; its settings stay this run's (optim.py)."""
        optimizer = self.stateful["optimizer"]
        mine, settings = optim.layout(optimizer), optim.settings(optimizer)
        if loaded.sharded:  # DCP: read into the live model and optimizer, at any world size
            resumed = sharded.load(loaded.path, self.stateful["model"], optimizer, self.group, verified=True)
        else:
            resumed = loaded.state
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
    def save(self, step: int, epoch: int) -> None:
        # Rank 0's small states (progress, schedule, tracker) go to every rank: a DCP folder keeps
        # the extras of whichever rank its planner picks, and only rank 0 knows the tracker's run.
        per_rank = {name: obj.state_dict() for name, obj in self.per_rank.items()}
        mine = (rng.get_state(), per_rank, self._small_states(step) if self.env.is_main else {})
        gathered: list[Any] = [mine]
        if self.distributed:
            gathered = [None] * self.env.world_size
            dist.all_gather_object(gathered, mine, group=self.group)
        about = dict(
            format=checkpoint.FORMAT,
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
        if self._agree(error):
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
        """Rank 0 writes the whole state to one file (async: from a thread); extra: as for DCP."""
        state = {"optimizer": self.stateful["optimizer"].state_dict(), **extra}
        state["model"] = weights.unwrap(self.stateful["model"]).state_dict()
        path = checkpoint.path_for(self.cfg.checkpoint_path, step)
        if self.cfg.save_mode == "async":
            state, self.staged = stage(state, self.staged)

            def write() -> None:
                checkpoint.save(state, path, self.run)
                self._done(path)

            self.pending = _Pending(write)
        else:
            checkpoint.save(state, path, self.run)
            self._done(path)

    def _save_sharded(self, step: int, extra: dict[str, Any]) -> None:
        """Every rank writes its part of a DCP folder (async: from a thread); extra: the same on every rank."""
        model, optimizer, directory = self.stateful["model"], self.stateful["optimizer"], self.cfg.checkpoint_path
        if self.cfg.save_mode == "async":
            self.pending = sharded.save_async(
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
        path = sharded.save(directory, step, model, optimizer, extra, self.group, self.run)
        if self.env.is_main:
            self._done(path)

    def close(self) -> None:
        """Wait for a save in flight; every rank learns whether it worked."""
        error = ""
        try:
            self.wait()
        except StorageError as exc:
            error = str(exc)
        if self.stager:
            self.stager.close()
        self._agree(error)
        if self.lock_fd is not None:
            dirlock.release(self.lock_fd)
            self.lock_fd = None

    def _done(self, path: Path) -> None:  # rank 0, once the checkpoint is complete
        prune(self.cfg.checkpoint_path, self.cfg.keep, self.run, step_of(path) or 0)
        print(f"[ddpjob] saved {path}", flush=True)

    def wait(self) -> None:
        """Until the save in flight (if any) is on disk; raises its StorageError."""
        pending, self.pending = self.pending, None
        if pending:
            pending.wait()

    def _agree(self, error: str) -> bool:
        """Rank 0 tells everyone how its save went (also the barrier after a save). True if it
        worked; a failure raises, or (``--on-save-error warn``) is logged and returns False."""
        if self.distributed:
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self.group)
            error = box[0]
        if not error:
            return True
        if self.cfg.on_save_error == "fail":
            raise StorageError(error)
        if self.env.is_main:
            print(
                f"[ddpjob] WARNING: checkpoint NOT saved, training goes on (--on-save-error warn): {error}",
                file=sys.stderr,
                flush=True,
            )
        return False


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
