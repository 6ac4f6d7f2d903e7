"""Who am I in the job: rank, local rank, world size, node rank and master address.

Resolved from the process environment, first match wins:
1. torchrun / torchelastic (``RANK`` and ``LOCAL_RANK``, plus ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``),
2. a plain environment with ``RANK`` and ``WORLD_SIZE`` (Kubeflow PyTorchJob, hand launch),
3. Slurm ``srun`` tasks (``SLURM_PROCID``, ``SLURM_NTASKS``, ...),
4. nothing: a single process (a ``WORLD_SIZE`` above 1 without ``RANK`` is refused).
Every value is validated here, before any network wait.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ddpjob.errors import UsageError

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "env", "slurm" or "single"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise UsageError(f"{name} is not set; export it as a whole number")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer; set it to a whole number") from None


def _hostlist_items(nodelist: str) -> list[str]:
    """Split a Slurm host list at the commas outside brackets; brackets must pair up, unnested."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            break
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    else:
        items.append(nodelist[start:])
        if depth == 0 and all(items):
            return items
    raise UsageError(f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm host list")


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    """``01-03,7`` -> ``01 02 03 7``: the lower bound's zero padding is kept, as Slurm does."""
    values = []
    for piece in ranges.split(","):
        lo, dash, hi = piece.partition("-")
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise UsageError(
                f"SLURM_JOB_NODELIST={nodelist!r}: [{ranges}] is not a list of numbers and ranges like [01-04,7]"
            )
        values += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi if dash else lo) + 1)]
    return values


def expand_hostlist(nodelist: str) -> list[str]:
    """Every host of a Slurm host list, in the order ``scontrol show hostnames`` prints them.

    Brackets may stand anywhere in a name and more than once: ``node[01-02]-ib`` -> ``node01-ib
    node02-ib``; ``a[1-2,5],b-[01-02]-x`` -> ``a1 a2 a5 b-01-x b-02-x``; ``r[1-2]n[1-2]`` -> ``r1n1
    r1n2 r2n1 r2n2`` (the first bracket varies slowest)."""
    hosts: list[str] = []
    for item in _hostlist_items(nodelist.strip()):
        parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        names = [parts[0]]
        for ranges, text in zip(parts[1::2], parts[2::2], strict=True):
            names = [name + value + text for name in names for value in _expand_ranges(ranges, nodelist)]
        hosts += names
    return hosts


def first_host(nodelist: str) -> str:
    """First host of a Slurm host list: ``gpu[03-05,9]-ib,cpu1`` -> ``gpu03-ib``."""
    return expand_hostlist(nodelist)[0]


def resolve(env: Mapping[str, str], cuda_devices: int = 0) -> DistEnv:
    """Resolve the distributed environment; raise UsageError naming the bad variable."""
    if "RANK" in env and "LOCAL_RANK" in env:
        source = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
        node_rank = _int(env, "GROUP_RANK", rank // max(local_world, 1))
    elif "RANK" in env:
        source = "env"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        # No LOCAL_RANK: one process per node unless told otherwise, or one per visible GPU.
        local_world = _int(env, "LOCAL_WORLD_SIZE", cuda_devices or 1)
        local_rank, node_rank = rank % max(local_world, 1), rank // max(local_world, 1)
    elif "SLURM_PROCID" in env:
        source = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID", 0)
        node_rank = _int(env, "SLURM_NODEID", 0)
        nnodes = _int(env, "SLURM_NNODES", 1)
        local_world = max(world // max(nnodes, 1), 1)
    else:
        if _int(env, "WORLD_SIZE", 1) != 1:  # a launcher that set the world but not this process's place in it
            raise UsageError(
                f"WORLD_SIZE={env['WORLD_SIZE']} is set but RANK is not: this process would train alone; export RANK "
                "(and MASTER_ADDR) for each process, or start them with `ddpjob launch`"
            )
        return DistEnv(0, 0, 1, 1, 0, "127.0.0.1", DEFAULT_MASTER_PORT, "single")

    if world < 1:
        raise UsageError(f"world size {world} from {source} env must be at least 1")
    if not 0 <= rank < world:
        name = "SLURM_PROCID" if source == "slurm" else "RANK"
        raise UsageError(f"{name}={rank} is outside the world of {world} processes (0..{world - 1})")
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise UsageError(
            f"LOCAL_RANK={local_rank} is outside the node's {local_world} processes; "
            "check LOCAL_RANK / LOCAL_WORLD_SIZE"
        )

    master_addr = env.get("MASTER_ADDR", "")
    if not master_addr and source == "slurm" and env.get("SLURM_JOB_NODELIST"):
        master_addr = first_host(env["SLURM_JOB_NODELIST"])
    if world > 1 and not master_addr:
        raise UsageError(
            f"MASTER_ADDR is not set but the world has {world} processes; export MASTER_ADDR=<host of rank 0>"
        )
    port = _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
    if not 0 < port < 65536:
        raise UsageError(f"MASTER_PORT={port} is not a TCP port; use 1..65535")
    return DistEnv(rank, local_rank, world, local_world, node_rank, master_addr or "127.0.0.1", port, source)
