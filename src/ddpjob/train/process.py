"""This process's device and process group: the device a rank uses (made current before anything
touches CUDA), joining the process group, and how a backend's failure reads.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpjob.config import Config
from ddpjob.distenv import DistEnv
from ddpjob.errors import PeerLost, UsageError, first_line


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


_PEER_FAILURE = re.compile(r"gloo|nccl|connection (reset|closed|refused)|pair closure|timed out", re.IGNORECASE)


def is_peer_failure(exc: RuntimeError) -> bool:
    """Gloo and NCCL report a dead, hung or cut-off peer as a RuntimeError (or DistError) from a
    collective: "[.../gloo/...] Timed out waiting ...", "Application timeout caused pair closure"."""
    return isinstance(exc, dist.DistError) or bool(_PEER_FAILURE.search(str(exc)))


def backend_message(exc: RuntimeError) -> str:
    """The backend's first sentence, without its source location: 'Timed out waiting 10000ms ...'."""
    return re.sub(r"^\[[^\]]*\]\s*", "", first_line(exc)).split(". This is typically")[0].rstrip(".")
