"""Which checkpoint a start uses: rank 0's choice (--resume auto, a given path, --init-from), the
refusals of a dir that is not this run's, and each other rank's wait to see the chosen one."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ddpjob import log
from ddpjob.checkpoint import storage
from ddpjob.checkpoint.catalogue import (
    FULL,
    checkable,
    complete,
    format_of,
    has_manifest,
    latest_valid,
    step_of,
    unknown_folder,
    verify,
)
from ddpjob.checkpoint.formats import dcp_folder, hf_safetensors
from ddpjob.checkpoint.storage import Where
from ddpjob.config import Config
from ddpjob.errors import Retriable, UsageError, denied, first_line


def _classify(exc: Exception) -> tuple[str, bool]:
    """(one-line message, retriable): storage trouble and lag may clear; anything else is input."""
    if isinstance(exc, UsageError | Retriable):
        return str(exc), isinstance(exc, Retriable)
    if problem := denied(exc, "the checkpoint dir"):
        return str(problem), False
    if isinstance(exc, OSError) or storage.retriable(exc):  # a store down past its retries (botocore's errors)
        return f"cannot read the checkpoint dir: {first_line(exc)}", True
    return f"unusable checkpoint: {first_line(exc)}", False


@dataclass
class Choice:
    """What rank 0 chose to start from, sent to every rank."""

    path: Where | None
    resume: bool
    run: str  # the lineage this job writes
    identity: str = ""  # content identity of path, to check every rank sees the same
    error: str = ""  # rank 0's error, raised on every rank: UsageError, else (``retriable``) Retriable
    retriable: bool = False
    in_dir: bool = False  # path is in rank 0's checkpoint dir
    sealed: bool = False  # path has a manifest (ddpjob's marker for a DCP folder) on rank 0

    def local(self, directory: Where) -> Where | None:
        """The chosen path as this rank names it: a checkpoint of rank 0's checkpoint dir is looked
        up in this rank's own (the same path on shared storage, or a node's local copy)."""
        return directory / self.path.name if self.path is not None and self.in_dir else self.path


@dataclass
class Loaded:
    """What a run starts from: a checkpoint to resume, or weights to initialise from.
    A DCP resume (``state`` None) is read later, into the live model and optimizer."""

    state: Any
    path: Where
    resume: bool
    identical: bool = False  # every rank provably holds the same weights: skip DDP's start-up broadcast

    @property
    def sharded(self) -> bool:
        return self.state is None


def choose(cfg: Config, share: tuple[int, int] | None = FULL, skip: frozenset[str] = frozenset()) -> Choice:
    """Rank 0: the checkpoint to start from and the lineage to write, or UsageError. Checksums are
    checked as far as ``share`` says (None: sizes only, when the ranks verify together after)."""
    directory = storage.checkpoint_dir(cfg)
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
    elif cfg.init_from and not skip:  # once, though a failed shared verification chooses again
        log.warning(f"--init-from {cfg.init_from} ignored: resuming from step {start}")
    in_dir = path is not None and path.parent.resolve() == directory.resolve()
    identity, sealed = (format_of(path).identity(path), has_manifest(path)) if path else ("", False)
    return Choice(path, resume, run, identity, in_dir=in_dir, sealed=sealed)


def given(name: str, flag: str, share: tuple[int, int] | None = FULL) -> Where:
    """A checkpoint named by the user: it exists and, where it has a manifest, matches it. A DCP
    folder needs its marker (ddpjob's integrity record); a plain file may have no manifest."""
    path = storage.location(name)
    if isinstance(path, storage.ObjectPath):  # a typo in AWS_ENDPOINT_URL: said at once, not retried
        storage.resolve_endpoint(path)
    if not path.exists():
        raise UsageError(f"{flag} {path} does not exist; check the path")
    if problem := unknown_folder(path):
        raise UsageError(f"{flag} {problem}")
    if flag == "--resume" and format_of(path) is hf_safetensors:
        raise UsageError(f"--resume {path}: safetensors hold model weights only; start from them with --init-from")
    if checkable(path) and (reason := verify(path, share)):
        raise UsageError(f"checkpoint {path} failed its integrity check: {reason}; use an earlier one")
    return path


def _sizes(identity: str) -> list[str]:
    """``name:size`` of each file in an identity made of ``name:size:digest`` parts joined by ``;``."""
    return [":".join(part.split(":")[:2]) for part in identity.split(";")]


def wait_visible(path: Where, choice: Choice, timeout: float, rank: int) -> None:
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
        if mine and format_of(path) is not dcp_folder and _sizes(mine) != _sizes(identity):
            mine, reason = "", "incomplete (a file is still being copied: its size is not rank 0's)"
        if mine:
            fix = "put --checkpoint-dir on shared storage" if in_dir else "give every node the same files at that path"
            pairs = zip(mine.split(";"), identity.split(";"), strict=False)
            ours, theirs = next(((a, b) for a, b in pairs if a != b), (mine, identity))
            raise UsageError(
                f"rank {rank} sees another {path} than rank 0 ({ours} vs {theirs}); {fix} or use --load-mode rank0"
            )
        if not told:
            log.info(f"rank {rank}: waiting up to {timeout:g} s to see {path} ({reason})")
            told = True
        if time.monotonic() >= deadline:
            raise Retriable(
                f"rank {rank}: {what} {path} that rank 0 chose is {reason} here after --fs-timeout "
                f"{timeout:g} s; shared storage is lagging (a restart retries), or {unshared} "
                "(then use --load-mode rank0)"
            )
        time.sleep(0.5)
