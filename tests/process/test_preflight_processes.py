"""`ddpjob doctor --all-nodes`: the verdict from measured figures, and the real check on three
"nodes" (network namespaces on a bridge) with one node's link rate-limited by tc.

(The tests of test_preflight.py that start processes.)
"""

import itertools
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PY, clean_env, ddpjob, in_every_worker
from ports import free_port

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="creates network namespaces (root)")


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
@pytest.mark.serial
@pytest.mark.alone  # it times links
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
@pytest.mark.serial
@pytest.mark.alone  # it times links
def test_all_nodes_on_equal_links_names_no_node_and_exits_0(work, three_hosts):
    codes, out = run_nodes(work, three_hosts, "--slow-factor", "0.25")
    assert codes == [0, 0, 0], out[-3000:]
    assert "preflight: ok: no node or link below 0.25x the median" in out and "SLOW" not in out


MATMUL_TIMES = """
import os, time, torch

_mm = torch.mm


def _timed(*args, **kwargs):
    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    out = _mm(*args, **kwargs)
    with open(os.path.join(os.environ["MATMUL_TIMES"], os.environ["RANK"]), "a") as f:
        f.write(f"{start} {time.monotonic()}\\n")
    return out


torch.mm = _timed
"""


@pytest.mark.slow
def test_cpu_ranks_on_one_machine_measure_their_matmul_one_after_another(work, tmp_path):
    """Ranks that share cores and measure at once count each other's threads as their own slowness
    (two emulated Slurm nodes on one host read 29.5 and 156 GFLOP/s, and the first was named SLOW)."""
    times = tmp_path / "times"
    times.mkdir()
    env = {**in_every_worker(tmp_path / "site", MATMUL_TIMES), "MATMUL_TIMES": str(times)}
    proc = ddpjob(["doctor", "--all-nodes", "--nproc-per-node", "3"], work, timeout=180, **env)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]  # 1: a slow rank on a busy host
    calls = {
        int(f.name): [tuple(map(float, line.split())) for line in f.read_text().splitlines()] for f in times.iterdir()
    }
    assert sorted(calls) == [0, 1, 2] and all(len(c) == 3 * 21 for c in calls.values()), calls.keys()
    spans = sorted((start, end, rank) for rank, c in calls.items() for start, end in c)
    overlaps = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1] and a[2] != b[2]]
    assert overlaps == []


@pytest.mark.serial  # against the rendezvous deadline
def test_a_missing_node_fails_within_the_rendezvous_timeout_in_one_line(work):
    flags = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "6"]
    start = time.monotonic()
    proc = ddpjob(["doctor", "--all-nodes", *flags], work, timeout=90)
    out = proc.stdout + proc.stderr
    # 1, not launch's 69: the Job retries 69 without counting, and a node that cannot join is the answer
    assert proc.returncode == 1 and "for 2 nodes failed" in out and "1 of 2 nodes joined" in out, out[-2000:]
    assert "check failed: rendezvous at" in out, out[-2000:]
    assert "Traceback" not in out and time.monotonic() - start < 6 + 60  # + start-up on a busy host
