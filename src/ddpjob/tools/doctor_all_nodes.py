"""``ddpjob doctor --all-nodes``: a short job on every node that names the slow ones.

It starts through launch's own path (the scheduler's env, torchrun agents, the c10d rendezvous
on node 0), with this module as the worker instead of ``ddpjob train``. Each rank measures:

- matmul speed: GPU ranks all at once (each has its own device, and the node is measured under full
  load); CPU ranks on one machine one after another, machines at once (ranks that share cores
  would count each other's threads as their own slowness);
- all-reduce time, algorithm and bus bandwidth (busbw = algbw x 2(n-1)/n, as nccl-tests) at a
  few sizes: a collective figure, the same for every node;
- point-to-point links between the nodes' local rank 0s, every pair once (round-robin, pairs of
  a round at once): latency (8-byte ping-pong) and bandwidth. A node's link figure is its *best*
  link: a node with a slow NIC has only slow links; a healthy node still has a fast one. That
  needs 3+ nodes; with 2 there is one link and no reference, so only ``--min-link-mbps`` can flag
  it, and then both ends are named.

Every rank gets every rank's figures and reaches the same verdict; rank 0 prints the tables, the
slow nodes and the line that leaves them out for the detected scheduler (Slurm ``--exclude``,
Kubernetes cordon/affinity, both as hints elsewhere); then all ranks meet at a barrier, so that
none exits (and has torchrun stop the others) before the report is out. Every rank exits 1 when a
node or link is named, 0 otherwise; a rendezvous that never formed (a node that did not come or
cannot reach node 0) is a failed check too, exit 1, not launch's 69 that schedulers retry. The
rendezvous is bounded by --rdzv-timeout, forming the group and its first collective (NCCL's set-up)
by --startup-timeout, every later collective by --collective-timeout.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpjob import log
from ddpjob.config import Config
from ddpjob.errors import EXIT_FAILED, EXIT_NO_RENDEZVOUS, EXIT_OK, UsageError, run_guarded
from ddpjob.launch.plan import Plan

ALLREDUCE_SIZES = {"cpu": (8, 1 << 20, 8 << 20), "cuda": (8, 1 << 20, 64 << 20)}
P2P_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
MATMUL_N = {"cpu": 512, "cuda": 8192}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """doctor's flags for the all-node check (not Config fields: they only shape this report)."""
    parser.add_argument(
        "--all-nodes",
        action="store_true",
        help="run a short job on every node through the launcher (same rendezvous as training): all-reduce "
        "bandwidth and latency, links between nodes, matmul speed; name slow nodes and exit 1",
    )
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=0.5,
        help="--all-nodes: a node below this fraction of the nodes' median is named (default 0.5)",
    )
    parser.add_argument(
        "--min-link-mbps",
        type=float,
        default=0.0,
        help="--all-nodes: name a node whose best link to another node is below this many MB/s (0: off; "
        "the only test of a 2-node job's link)",
    )


def check_flags(args: argparse.Namespace) -> None:
    if not 0 < args.slow_factor < 1:
        raise UsageError(f"--slow-factor {args.slow_factor:g} must be between 0 and 1, e.g. 0.5 (half the median)")
    if args.min_link_mbps < 0:
        raise UsageError(f"--min-link-mbps {args.min_link_mbps:g} must be 0 (off) or a bandwidth in MB/s, e.g. 1000")


# ---- the agent side: through launch's torchrun path ------------------------------------------


def preflight_plan(plan: Plan) -> Plan:
    """The training plan for the check: its own rendezvous id (a training job may follow on the same
    endpoint), no restarts (a named node is an answer, not a failure to retry) and a fixed size, the
    most nodes of an elastic MIN:MAX: a check that started on a subset would pass the rest unseen."""
    return dataclasses.replace(plan, rdzv_id=f"{plan.rdzv_id}-preflight", max_restarts=0, min_nodes=plan.nnodes)


def run_all_nodes(cfg: Config, plan: Plan, argv: Sequence[str]) -> int:
    """This node's part of the check: torchrun with the preflight worker, as ``launch`` runs training."""
    from ddpjob.launch import agent
    from ddpjob.tools import doctor

    plan = preflight_plan(plan)
    if not doctor.report(doctor.run(cfg, plan, brief=True), brief=True):
        raise UsageError("local check failed (see the fix above); `ddpjob doctor` shows every check")
    worker = ["-m", "ddpjob.tools.doctor_all_nodes"]
    cmd = agent.torchrun_args(cfg, plan, [*argv, "--scheduler", plan.scheduler], worker=worker)
    log.info(
        f"doctor: all nodes: node {'?' if plan.node_rank is None else plan.node_rank}/{plan.nodes}, "
        f"{plan.nproc_per_node} proc/node, "
        f"rendezvous {plan.endpoint or 'standalone'} ({plan.scheduler})"
    )
    code, reason = agent.run_torchrun(cmd, plan, cfg, training=False)
    if code == EXIT_NO_RENDEZVOUS:  # not "retry me" here: a node that cannot join is what this check is for
        code, reason = EXIT_FAILED, f"check failed: {reason}"
    if code:
        why = "a node or link was named (rank 0's report) or the check failed (the line above)"
        log.failure(f"doctor: node {agent.node_name(plan)}: {reason}: {why}")
    return code


# ---- the worker: measure -----------------------------------------------------------------------


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of n nodes once, in n-1 (n even) or n (n odd) rounds of disjoint pairs (circle method)."""
    ids: list[int | None] = [*range(n), *([None] if n % 2 else [])]
    rounds = []
    for _ in range(len(ids) - 1):
        pairs = [(ids[i], ids[-1 - i]) for i in range(len(ids) // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return rounds


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(device: Any, tries: int = 20) -> float:
    """FLOP/s of an n x n fp32 matmul on this rank's device: the best of many short tries, so that
    a moment of sharing a core (or the GPU) with another process does not count."""
    import torch

    n = MATMUL_N[device.type]
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    torch.mm(a, b)  # warm-up: kernels, allocator
    _sync(device)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def kernel_id() -> str:
    """The running kernel's boot id: one per machine, shared by its containers and network
    namespaces (a host name is not: each container has its own); "" where it cannot be read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def matmul_turn(everyone: Sequence[dict[str, Any]], rank: int) -> tuple[int, int]:
    """(this rank's turn, the number of turns) to measure matmul in. GPU ranks: one turn for all.
    CPU ranks: one turn per rank of a machine (a kernel), machines in parallel. Decided from what
    every rank gathered, so that every rank agrees on the number of turns (of barriers)."""
    if any(r["device"] != "cpu" for r in everyone):
        return 0, 1
    mine = everyone[rank]["kernel"]
    turn = sum(r["kernel"] == mine for r in everyone[:rank])
    return turn, max(collections.Counter(r["kernel"] for r in everyone).values())


def matmul_in_turns(device: Any, turn: int, turns: int) -> float:
    """matmul_flops measured in this rank's turn, with a barrier between turns."""
    import torch.distributed as dist

    flops = 0.0
    for t in range(turns):
        if t == turn:
            flops = matmul_flops(device)
        if turns > 1:
            dist.barrier()
    return flops


def allreduce_times(device: Any) -> dict[int, float]:
    """Size in bytes -> seconds per all-reduce on this rank (after a warm-up)."""
    import torch
    import torch.distributed as dist

    times = {}
    for size in ALLREDUCE_SIZES[device.type]:
        buf = torch.ones(max(size // 4, 2), device=device)
        iters = 5 if size <= 1 << 20 else 2
        dist.all_reduce(buf)
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        _sync(device)
        times[size] = (time.perf_counter() - start) / iters
    return times


def ping_pong(peer: int, first: bool, buf: Any, tries: int) -> float:
    """The best round trip of `buf` to rank `peer` and back, in seconds (after one warm-up)."""
    import torch.distributed as dist

    best = float("inf")
    for attempt in range(tries + 1):
        start = time.perf_counter()
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        _sync(buf.device)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def link_figures(device: Any, leaders: dict[int, int], rank: int) -> dict[str, list[float]]:
    """'a-b' -> [latency s, bandwidth B/s] for the links this rank measured (as node a's leader)."""
    import torch
    import torch.distributed as dist

    small = torch.zeros(2, device=device)
    large = torch.zeros(P2P_BYTES[device.type] // 4, device=device)
    links = {}
    for pairs in round_robin(len(leaders)):
        for a, b in pairs:
            if rank not in (leaders[a], leaders[b]):
                continue
            first, peer = rank == leaders[a], leaders[b] if rank == leaders[a] else leaders[a]
            latency = ping_pong(peer, first, small, 5) / 2
            bandwidth = 2 * large.numel() * 4 / ping_pong(peer, first, large, 4)
            if first:
                links[f"{a}-{b}"] = [latency, bandwidth]
        dist.barrier()  # one round at a time: a node is in one pair only
    return links


def measure(device: Any, rank: int, node: int, local_rank: int) -> list[dict[str, Any]]:
    """Every rank's figures, on every rank."""
    import torch.distributed as dist

    me = {
        "rank": rank,
        "node": node,
        "local_rank": local_rank,
        "host": socket.gethostname(),
        "slurm_name": os.environ.get("SLURMD_NODENAME", ""),
        "k8s_name": os.environ.get("NODE_NAME", ""),  # the downward API's spec.nodeName, where set
        "kernel": kernel_id(),
        "device": device.type,
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    leaders = {r["node"]: r["rank"] for r in everyone if r["local_rank"] == 0}
    turn = matmul_turn(everyone, rank)
    flops = [matmul_in_turns(device, *turn)]  # three bursts seconds apart: a busy moment on a shared host passes
    me["allreduce"] = allreduce_times(device)
    flops.append(matmul_in_turns(device, *turn))
    me["links"] = link_figures(device, leaders, rank)
    flops.append(matmul_in_turns(device, *turn))
    me["matmul"] = max(flops)
    dist.all_gather_object(everyone, me)
    return everyone


# ---- the verdict -------------------------------------------------------------------------------


@dataclasses.dataclass
class NodeFigures:
    index: int
    host: str
    slurm_name: str
    k8s_name: str
    ranks: list[int]
    matmul: float  # its slowest rank's FLOP/s
    slowest: tuple[int, int]  # that rank: (rank, local rank, the GPU index on a GPU node)
    best_link: tuple[int, float, float] | None  # (other node, latency s, bandwidth B/s), the fastest


@dataclasses.dataclass
class Verdict:
    nodes: list[NodeFigures]
    links: dict[tuple[int, int], tuple[float, float]]  # (a, b) -> (latency s, bandwidth B/s)
    allreduce: dict[int, float]  # size -> seconds, the slowest rank's
    world: int
    slow: dict[int, list[str]]  # node -> why
    slow_links: list[str]
    notes: list[str]
    factor: float

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.slow or self.slow_links else EXIT_OK


def assess(records: Sequence[dict[str, Any]], factor: float, min_link: float) -> Verdict:
    """Name the nodes far below the others (factor x the median) or below --min-link-mbps (B/s)."""
    links: dict[tuple[int, int], tuple[float, float]] = {}
    for r in records:
        for key, (latency, bandwidth) in r["links"].items():
            a, b = map(int, key.split("-"))
            links[(a, b)] = (latency, bandwidth)
    nodes = []
    for index in sorted({r["node"] for r in records}):
        mine = [r for r in records if r["node"] == index]
        leader = min(mine, key=lambda r: r["local_rank"])
        slowest = min(mine, key=lambda r: r["matmul"])
        own = [(b if a == index else a, lat, bw) for (a, b), (lat, bw) in links.items() if index in (a, b)]
        nodes.append(
            NodeFigures(
                index,
                leader["host"],
                leader["slurm_name"] or leader["host"],
                leader["k8s_name"] or leader["host"],
                sorted(r["rank"] for r in mine),
                slowest["matmul"],
                (slowest["rank"], slowest["local_rank"]),
                max(own, key=lambda link: link[2]) if own else None,
            )
        )
    slow: dict[int, list[str]] = {}
    notes = []
    median_flops = statistics.median(r["matmul"] for r in records)
    for n in nodes:
        if n.matmul < factor * median_flops:
            slow.setdefault(n.index, []).append(
                f"matmul {n.matmul / 1e9:.1f} GFLOP/s on rank {n.slowest[0]} (local rank {n.slowest[1]}), "
                f"{n.matmul / median_flops:.2f}x the median "
                f"{median_flops / 1e9:.1f} of the ranks"
            )
    with_links = [n for n in nodes if n.best_link]
    if len(with_links) >= 3:
        median_best = statistics.median(n.best_link[2] for n in with_links if n.best_link)
        for n in with_links:
            assert n.best_link
            if n.best_link[2] < factor * median_best:
                slow.setdefault(n.index, []).append(
                    f"its best link (to node {n.best_link[0]}) {rate(n.best_link[2])}, "
                    f"{n.best_link[2] / median_best:.2f}x the median {rate(median_best)} of the nodes' best links"
                )
        median_link = statistics.median(bw for _, bw in links.values())
        slow_links = [
            f"link node {a} - node {b}: {rate(bw)}, {bw / median_link:.2f}x the median link {rate(median_link)}"
            for (a, b), (_, bw) in sorted(links.items())
            if bw < factor * median_link and a not in slow and b not in slow
        ]
    else:
        slow_links = []
        if len(nodes) == 2:
            notes.append(
                "2 nodes: one link and no third node to compare with, so a slow end cannot be told; "
                "--min-link-mbps sets a floor (both ends are named below it)"
            )
    if min_link:
        for n in with_links:
            assert n.best_link
            if n.best_link[2] < min_link and not any("best link" in why for why in slow.get(n.index, [])):
                both = " (the only link: either end may be the slow one)" if len(nodes) == 2 else ""
                slow.setdefault(n.index, []).append(
                    f"its best link (to node {n.best_link[0]}) {rate(n.best_link[2])}, below --min-link-mbps "
                    f"{min_link / 1e6:g}{both}"
                )
    allreduce = {size: max(r["allreduce"][size] for r in records) for size in sorted(records[0]["allreduce"], key=int)}
    return Verdict(nodes, links, allreduce, len(records), slow, slow_links, notes, factor)


def rate(bps: float) -> str:
    if bps >= 1e9:
        return f"{bps / 1e9:.2f} GB/s"
    return f"{bps / 1e6:.1f} MB/s" if bps >= 1e6 else f"{bps / 1e3:.1f} kB/s"


def size_text(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size} B"


def render(v: Verdict, backend: str, scheduler: str) -> list[str]:
    n = v.world
    lines = [
        f"{len(v.nodes)} nodes, {n} ranks, {backend}",
        f"{'all-reduce':<10} {'size':>7} {'time':>12} {'algbw':>12} {'busbw':>12}",
    ]
    for size, seconds in v.allreduce.items():
        algbw = int(size) / seconds
        busbw = algbw * 2 * (n - 1) / n
        lines.append(
            f"{'all-reduce':<10} {size_text(int(size)):>7} {seconds * 1e3:9.2f} ms {rate(algbw):>12} {rate(busbw):>12}"
        )
    lines.append(
        f"{'node':>4}  {'host':<20} {'ranks':<7} {'matmul':>17}  {'best link':>12} {'to':<7} {'latency':>10}  verdict"
    )
    for node in v.nodes:
        link = node.best_link
        bw, to, latency = (rate(link[2]), f"node {link[0]}", f"{link[1] * 1e3:.2f} ms") if link else ("-", "", "-")
        ranks = ",".join(map(str, node.ranks)) if len(node.ranks) <= 3 else f"{node.ranks[0]}-{node.ranks[-1]}"
        lines.append(
            f"{node.index:>4}  {node.host[:20]:<20} {ranks:<7} {node.matmul / 1e9:9.1f} GFLOP/s  {bw:>12} {to:<7} "
            f"{latency:>10}  {'SLOW' if node.index in v.slow else 'ok'}"
        )
    if len(v.links) > 1:
        lines.append(
            "links: "
            + ", ".join(f"{a}-{b} {rate(bw)} {lat * 1e3:.2f} ms" for (a, b), (lat, bw) in sorted(v.links.items()))
        )
    lines += v.notes
    for index, why in sorted(v.slow.items()):
        node = v.nodes[[x.index for x in v.nodes].index(index)]
        lines.append(f"SLOW node {index} ({node.host}): {'; '.join(why)}")
    lines += [f"SLOW {text}" for text in v.slow_links]
    if v.slow:
        lines += exclusion([x for x in v.nodes if x.index in v.slow], scheduler)
    if not v.slow and not v.slow_links:
        lines.append(f"ok: no node or link below {v.factor:g}x the median")
    return lines


KUBERNETES = ("kubernetes", "kubeflow")


def exclusion(named: Sequence[NodeFigures], scheduler: str) -> list[str]:
    """The line that leaves the named nodes out, for the scheduler the agent detected; without one
    (compose, by hand) both, as hints."""
    lines = []
    if scheduler not in KUBERNETES:
        lines.append(f"Slurm: leave them out with  sbatch --exclude={','.join(x.slurm_name for x in named)} ...")
    if scheduler != "slurm":
        k8s = [x.k8s_name for x in named]
        lines.append(
            f"Kubernetes: kubectl cordon {' '.join(k8s)}  (or a nodeAffinity: kubernetes.io/hostname NotIn "
            f"[{', '.join(k8s)}])"
        )
    if scheduler in KUBERNETES and any(x.k8s_name == x.host for x in named):
        lines.append("Kubernetes: those are pod names; set NODE_NAME from spec.nodeName (downward API) for nodes")
    return lines


def main(argv: Sequence[str]) -> int:
    import torch
    import torch.distributed as dist

    from ddpjob import config, distenv
    from ddpjob.train import phase_watchdog, process

    parser = config.make_parser("python -m ddpjob.tools.doctor_all_nodes", "The worker of `ddpjob doctor --all-nodes`.")
    config.add_config_flags(parser)
    add_flags(parser)
    parser.add_argument("--scheduler", default="plain", help="what the agent detected")
    args = parser.parse_args(argv)
    check_flags(args)
    cfg = config.load(args)
    env = distenv.resolve(os.environ, torch.cuda.device_count())
    device = process.pick_device(cfg, env)
    process.init_process_group(cfg, env, device)  # its timeout: --startup-timeout
    phases = phase_watchdog.Phases(cfg)  # the flag in force, for the message
    try:
        dist.barrier()  # the first collective: NCCL sets up its communicators, still under --startup-timeout
        phases.switch("step")  # every later collective: --collective-timeout
        records = measure(device, env.rank, env.node_rank, env.local_rank)
        verdict = assess(records, args.slow_factor, args.min_link_mbps * 1e6)
        if env.rank == 0:
            backend = f"{'nccl' if device.type == 'cuda' else 'gloo'} on {device.type}"
            for line in render(verdict, backend, args.scheduler):
                log.info(f"preflight: {line}")
        # A rank that exits 1 first would have torchrun stop its node's others, rank 0 among
        # them, perhaps before the report is out: every rank waits here until it is.
        dist.barrier()
    except RuntimeError as exc:  # gloo and NCCL time out or lose a peer with a RuntimeError (DistError)
        log.failure(
            f"preflight: rank {env.rank}: a collective failed ({process.backend_message(exc)}); a peer died, hung past "
            f"{phases.describe()} or lost its network"
        )
        return EXIT_FAILED
    dist.destroy_process_group()
    return verdict.exit_code


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
