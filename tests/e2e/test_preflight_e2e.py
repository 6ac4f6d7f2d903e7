"""`ddpjob doctor --all-nodes` through the real launchers: slurm/preflight.sbatch on the 2-node
Slurm cluster and compose.yaml's preflight profile on 3 containers, with one node's link
rate-limited on the host side of its veth (tc tbf; no privileges inside the node)."""

import contextlib
import re
import shutil
import subprocess

import pytest
from test_slurm import finished, job, sbatch

from e2e import REPO, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.serial]  # it times links and nodes: run alone (make e2e-serial)
RATE = ["tbf", "rate", "50mbit", "burst", "32kbit", "latency", "400ms"]  # 6 MB/s; the kernel here has no netem


@contextlib.contextmanager
def slowed(device: str):
    """What goes out of `device` (the host end of a node's veth: into the node) limited to 50 Mbit/s."""
    subprocess.run(["tc", "qdisc", "add", "dev", device, "root", *RATE], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", device, "root"], capture_output=True)


def preflight_job(env, *flags):
    job_id = sbatch(env, *flags, script="slurm/preflight.sbatch")
    try:
        state = wait_for(lambda: finished(env, job_id), 240, f"preflight job {job_id}")
        out = (REPO / "runs" / f"ddpjob-preflight-{job_id}.out").read_text()
        return state, job(env, job_id)["ExitCode"], out
    finally:
        subprocess.run(["scancel", job_id], env=env)
        (REPO / "runs" / f"ddpjob-preflight-{job_id}.out").unlink(missing_ok=True)
        shutil.rmtree(REPO / "runs" / f"ddpjob-preflight-{job_id}", ignore_errors=True)


def test_slurm_preflight_names_both_ends_of_a_slowed_two_node_link(slurm_env):
    with slowed("ve-node2"):
        state, code, out = preflight_job(slurm_env, "--min-link-mbps", "20")
    print(out)
    assert state == "FAILED" and code == "1:0", out[-3000:]
    slow = re.findall(  # a node may also be named for its matmul first (a loaded machine): "...; its best link"
        r"preflight: SLOW node \d \((node\d)\): (?:[^;\n]*; )?its best link .* below --min-link-mbps 20 \(the only", out
    )
    assert sorted(slow) == ["node1", "node2"], out[-3000:]
    excluded = re.search(r"sbatch --exclude=(\S+) \.\.\.", out)
    assert excluded and sorted(excluded.group(1).split(",")) == ["node1", "node2"], out[-3000:]


def test_slurm_preflight_passes_on_healthy_links(slurm_env):
    state, code, out = preflight_job(slurm_env, "--min-link-mbps", "20")
    assert state == "COMPLETED" and code == "0:0", out[-3000:]
    assert "preflight: ok: no node or link below 0.5x the median" in out and "SLOW" not in out
    assert re.search(r"all-reduce +8 MiB +[\d.]+ ms", out), out[-3000:]


def host_veth(docker_env, container: str) -> str:
    """The host end of a container's eth0 (its peer's ifindex, looked up in the host's links)."""
    pid = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Pid}}", container], env=docker_env, capture_output=True, text=True
    ).stdout.strip()
    inside = subprocess.run(
        ["nsenter", "-t", pid, "-n", "ip", "-o", "link", "show", "eth0"], capture_output=True, text=True
    )
    peer = re.search(r"eth0@if(\d+)", inside.stdout)
    assert peer, inside.stdout + inside.stderr
    host = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return re.search(rf"^{peer.group(1)}: ([^@:]+)", host, re.M).group(1)


def running(docker_env, container: str) -> bool:
    out = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Running}}", container], env=docker_env, capture_output=True, text=True
    )
    return out.stdout.strip() == "true"


def test_compose_preflight_profile_names_the_container_whose_link_is_slowed(tmp_path, docker_env):
    name = "ddpjob-e2e-pf"
    shutil.copy(REPO / "compose.yaml", tmp_path / "compose.yaml")
    (tmp_path / ".env").write_text("DDPJOB_NNODES=3\nPREFLIGHT_SLOW_FACTOR=0.25\n")
    env = {**docker_env, "COMPOSE_PROJECT_NAME": name}
    cmd = ["docker", "compose", "--project-directory", str(tmp_path), "-p", name, "--profile", "preflight"]
    containers = [f"{name}-preflight-{i}" for i in (1, 2, 3)]

    def compose(*args):
        return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=180, check=True)

    try:
        # Two of the three nodes first: they wait at the rendezvous, so the link is slowed before
        # anything is measured; then the third joins and the check runs.
        compose("up", "-d", "--no-build", "--scale", "preflight=2", "preflight")
        wait_for(lambda: all(running(docker_env, c) for c in containers[:2]), 60, "two preflight containers")
        slow_host = subprocess.run(
            ["docker", "inspect", "-f", "{{.Config.Hostname}}", containers[1]], env=env, capture_output=True, text=True
        ).stdout.strip()
        with slowed(host_veth(docker_env, containers[1])):
            compose("up", "-d", "--no-build", "--no-recreate", "--scale", "preflight=3", "preflight")
            codes = [
                subprocess.run(
                    ["docker", "wait", c], env=env, capture_output=True, text=True, timeout=300
                ).stdout.strip()
                for c in containers
            ]
        out = compose("logs", "--no-color", "preflight").stdout
        print(out)
    finally:
        subprocess.run([*cmd, "down", "--volumes", "--timeout", "5"], env=env, capture_output=True)
    assert codes == ["1", "1", "1"], out[-4000:]
    slow = re.findall(r"preflight: SLOW node \d \((\w+)\): its best link", out)
    assert slow == [slow_host], out[-4000:]
    assert f"kubectl cordon {slow_host}" in out
