"""`ddpjob doctor --all-nodes`: the verdict from measured figures, and the real check on three
"nodes" (network namespaces on a bridge) with one node's link rate-limited by tc."""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from ddpjob.plan import Plan
from ddpjob.preflight import assess, exclusion, preflight_plan, render, round_robin
from helpers import PY, clean_env, ddpjob, free_port

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="creates network namespaces (root)")
GB = 1e9


def figures(node, matmul=50 * GB, links=None, local_rank=0, host=None, rank=None, slurm_name="", k8s_name=""):
    return {
        "rank": node if rank is None else rank,
        "node": node,
        "local_rank": local_rank,
        "host": host or f"host-{node}",
        "slurm_name": slurm_name,
        "k8s_name": k8s_name,
        "matmul": matmul,
        "allreduce": {8: 1e-4, 1 << 20: 1e-3},
        "links": {f"{a}-{b}": [1e-4, bw] for (a, b), bw in (links or {}).items()},
    }


def test_round_robin_meets_every_pair_once_with_disjoint_pairs_per_round():
    for n in range(2, 9):
        rounds = round_robin(n)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
        for r in rounds:
            ends = [x for p in r for x in p]
            assert len(ends) == len(set(ends))
        assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_a_node_with_only_slow_links_is_named_and_its_peers_are_not():
    links = {(0, 1): 1.0 * GB, (0, 2): 0.006 * GB, (1, 2): 0.006 * GB, (0, 3): 1.1 * GB, (1, 3): 0.9 * GB}
    links[(2, 3)] = 0.006 * GB
    v = assess([figures(0, links=links), figures(1), figures(2), figures(3)], 0.5, 0)
    assert list(v.slow) == [2] and "best link" in v.slow[2][0]
    assert v.slow_links == [] and v.exit_code == 1


def test_a_slow_link_between_two_healthy_nodes_is_named_as_a_link():
    links = {(0, 1): 0.01 * GB, (0, 2): 1.0 * GB, (1, 2): 1.0 * GB}
    v = assess([figures(0, links=links), figures(1), figures(2)], 0.5, 0)
    assert v.slow == {} and v.slow_links and v.slow_links[0].startswith("link node 0 - node 1")
    assert v.exit_code == 1


def test_two_nodes_name_both_ends_only_below_the_absolute_floor():
    records = [figures(0, links={(0, 1): 0.006 * GB}), figures(1)]
    unflagged = assess(records, 0.5, 0)
    assert unflagged.slow == {} and unflagged.exit_code == 0 and "2 nodes" in unflagged.notes[0]
    floored = assess(records, 0.5, 100e6)
    assert sorted(floored.slow) == [0, 1] and "either end" in floored.slow[0][0]


def test_a_slow_rank_names_its_node_by_matmul():
    records = [figures(0), figures(1), figures(2, matmul=5 * GB), figures(3)]
    assert list(assess(records, 0.5, 0).slow) == [2]
    assert assess(records, 0.05, 0).slow == {}  # within a looser factor


def test_an_elastic_plan_is_checked_at_its_full_size():
    elastic = Plan("plain", "flags", 4, 0, "node-a:29500", "job", 1, min_nodes=1, max_restarts=3)
    plan = preflight_plan(elastic)
    assert plan.nodes == "4" and not plan.elastic  # torchrun --nnodes=4: no start on a subset
    assert plan.rdzv_id == "job-preflight" and plan.max_restarts == 0


def test_slow_gpu_on_an_fqdn_host_is_excluded_by_its_slurm_name_and_named_by_local_rank():
    """8 ranks per node, hosts named h<n>.cluster and Slurm nodes h<n>: node 1's GPU 5 is slow."""
    records = [
        figures(
            node,
            matmul=5 * GB if (node, local) == (1, 5) else 50 * GB,
            rank=8 * node + local,
            local_rank=local,
            host=f"h{node}.cluster",
            slurm_name=f"h{node}",
        )
        for node in range(3)
        for local in range(8)
    ]
    v = assess(records, 0.5, 0)
    assert list(v.slow) == [1] and "on rank 13 (local rank 5)" in v.slow[1][0]
    out = render(v, "nccl on cuda", "slurm")
    assert "SLOW node 1 (h1.cluster): matmul 5.0 GFLOP/s on rank 13 (local rank 5)" in "\n".join(out)
    assert "Slurm: leave them out with  sbatch --exclude=h1 ..." in out
    assert not any("kubectl" in line for line in out)


def test_the_exclusion_line_follows_the_detected_scheduler():
    records = [figures(0), figures(1, matmul=5 * GB, k8s_name="gpu-node-7"), figures(2)]
    named = assess(records, 0.5, 0).nodes[1:2]
    assert exclusion(named, "kubeflow") == [
        "Kubernetes: kubectl cordon gpu-node-7  (or a nodeAffinity: kubernetes.io/hostname NotIn [gpu-node-7])"
    ]
    plain = exclusion(named, "plain")  # compose, by hand: both, as hints
    assert plain[0] == "Slurm: leave them out with  sbatch --exclude=host-1 ..." and "cordon gpu-node-7" in plain[1]
    pod = assess([figures(0), figures(1, matmul=5 * GB), figures(2)], 0.5, 0).nodes[1:2]
    assert "set NODE_NAME from spec.nodeName" in exclusion(pod, "kubernetes")[-1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--slow-factor", "2"], "--slow-factor 2 must be between 0 and 1"),
        (["--min-link-mbps", "-1"], "--min-link-mbps -1 must be 0 (off)"),
        (["--slow-factor", "half"], "argument --slow-factor: invalid float value: 'half'"),
    ],
)
def test_bad_preflight_flags_are_one_line_and_exit_2(work, flags, message):
    proc = ddpjob(["doctor", "--all-nodes", *flags], work, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


NODES = [
    ("ddpjob-pf-a", "pf-a", "198.19.2.1"),
    ("ddpjob-pf-b", "pf-b", "198.19.2.2"),
    ("ddpjob-pf-c", "pf-c", "198.19.2.3"),
]
SWITCH = "ddpjob-pf-sw"


@pytest.fixture
def three_hosts(tmp_path):
    """Three network namespaces on a bridge (in a fourth, the switch, so that the host's
    iptables play no part): (ns, host name and interface, addr); /etc/hosts for their names."""
    sh = subprocess.run
    for ns in [SWITCH, *(n for n, _, _ in NODES)]:
        sh(["ip", "netns", "del", ns], capture_output=True)  # left over from an interrupted run
        sh(["ip", "netns", "add", ns], check=True)
        sh(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    sh(["ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge"], check=True)
    sh(["ip", "-n", SWITCH, "link", "set", "br0", "up"], check=True)
    for ns, name, addr in NODES:
        sh(["ip", "link", "add", name, "netns", ns, "type", "veth", "peer", "name", f"{name}-sw", "netns", SWITCH])
        sh(["ip", "-n", SWITCH, "link", "set", f"{name}-sw", "master", "br0", "up"], check=True)
        sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", name], check=True)
        sh(["ip", "-n", ns, "link", "set", name, "up"], check=True)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for _, name, addr in NODES))
    yield hosts
    for ns in [SWITCH, *(n for n, _, _ in NODES)]:
        sh(["ip", "netns", "del", ns], check=True)


def start_node(work: Path, hosts: Path, index: int, *flags: str) -> subprocess.Popen:
    """`ddpjob doctor --all-nodes` as node `index`: in its namespace, with its own host name and /etc/hosts."""
    ns, name, _ = NODES[index]
    script = f'hostname {name} && mount --bind {hosts} /etc/hosts && exec "$@"'
    cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script]
    args = ["doctor", "--all-nodes", "--nnodes", "3", "--node-rank", str(index), *flags]
    args += ["--rdzv-endpoint", f"{NODES[0][2]}:29500", "--rdzv-timeout", "60", "--collective-timeout", "60"]
    return subprocess.Popen(
        [*cmd, "_", PY, "-m", "ddpjob", *args],
        cwd=work,
        env=clean_env(GLOO_SOCKET_IFNAME=name),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def slow_down(index: int) -> None:
    """Rate-limit what node `index` sends to 50 Mbit/s (tbf: this kernel has no netem)."""
    ns, name, _ = NODES[index]
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            name,
            "root",
            "tbf",
            "rate",
            "50mbit",
            "burst",
            "32kbit",
            "latency",
            "400ms",
        ],
        check=True,
    )


def run_nodes(work: Path, hosts: Path, *flags: str) -> tuple[list[int], str]:
    nodes = [start_node(work, hosts, i, *flags) for i in range(3)]
    outs = [n.communicate(timeout=240)[0] for n in nodes]
    print(outs[0])
    return [n.returncode for n in nodes], outs[0]


@root_only
@pytest.mark.slow
def test_all_nodes_names_the_node_whose_link_is_slowed_and_no_other(work, three_hosts):
    slow_down(2)
    codes, out = run_nodes(work, three_hosts, "--slow-factor", "0.25")
    assert codes == [1, 1, 1], out[-3000:]
    slow = [line for line in out.splitlines() if "preflight: SLOW" in line]
    assert len(slow) == 1 and re.search(r"preflight: SLOW node \d \(pf-c\): its best link", slow[0]), out
    assert "sbatch --exclude=pf-c ..." in out and "kubectl cordon pf-c" in out
    assert re.search(r"all-reduce +8 MiB +[\d.]+ ms", out) and "busbw" in out


@root_only
@pytest.mark.slow
def test_all_nodes_on_equal_links_names_no_node_and_exits_0(work, three_hosts):
    codes, out = run_nodes(work, three_hosts, "--slow-factor", "0.25")
    assert codes == [0, 0, 0], out[-3000:]
    assert "preflight: ok: no node or link below 0.25x the median" in out and "SLOW" not in out


def test_a_missing_node_fails_within_the_rendezvous_timeout_in_one_line(work):
    flags = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "6"]
    start = time.monotonic()
    proc = ddpjob(["doctor", "--all-nodes", *flags], work, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "for 2 nodes failed" in out and "1 of 2 nodes joined" in out, out[-2000:]
    assert "Traceback" not in out and time.monotonic() - start < 6 + 60  # + start-up on a busy host
