"""Stop signals on Slurm's path, with real processes: `scancel`, preemption and train.sbatch's forward
signal every process of the step, so the workers get each signal directly as well as from torchrun's
agent in `ddpjob launch`, and the agent gets several. Workers checkpoint once and exit 75; launch
waits for them (within --shutdown-timeout) and reports 75 only when the checkpoint of the stop step
verifies on disk, else the workers' own code."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (
    alive,
    ddpjob,
    in_every_worker,
    injected_ranks,
    ok,
    records,
    spawn,
    trained_steps,
    wait_until,
    workers_of,
)
from ports import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.serial]

# 128 steps per epoch per rank; a stop is agreed at a multiple of --stop-check-every (within two):
# with 100, the workers take a second or more to stop after a signal, and further signals land then.
JOB = [
    "--device",
    "cpu",  # forked workers (a visible GPU would make them exec'd)
    "--nproc-per-node",
    "2",
    "--model",
    "ddpjob.plugins:synthetic_mlp(width=512)",
    "--data",
    "ddpjob.plugins:synthetic(samples=8192)",
    "--log-every",
    "5",
    "--save-every",
    "0",
]


def signal_step(pids: list[int], sig: signal.Signals) -> None:
    """What Slurm does to a job step: the signal to every process of it."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def start(work: Path, *args: str, **env: str) -> tuple[subprocess.Popen[str], list[int]]:
    agent = spawn(["launch", *JOB, *args], work, **env)
    wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 20, 120, "training to start")
    workers = workers_of(agent.pid)
    assert len(workers) == 2, workers
    return agent, workers


def saved_files(work: Path) -> list[str]:
    return sorted(p.name for p in (work / "runs/ddpjob/checkpoints").glob("step-*.pt"))


def test_slurm_preemption_signals_every_process_repeatedly_one_checkpoint_exit_75_and_resume(work):
    run_dir = work / "runs/ddpjob"
    agent, workers = start(work, "--epochs", "3", "--stop-check-every", "100")
    # --signal=B:USR1 forwarded by train.sbatch, then scancel / preemption's TERM and sbatch's forward
    # of it: each to the agent and to every worker, while the workers are still on their way to stop.
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM):
        signal_step([agent.pid, *workers], sig)
        time.sleep(0.2)
    out = agent.communicate(timeout=180)[0]
    left = [pid for pid in workers if alive(pid)]
    assert agent.returncode == 75, out[-3000:]
    assert not left, f"workers {left} outlived launch"
    (stop,) = [r for r in records(run_dir) if r["event"] == "preempted"]
    assert saved_files(work) == [f"step-{stop['step']}.pt"] and out.count("[ddpjob] saved ") == 1, out[-3000:]
    assert f"at step {stop['step']}, and its checkpoint" in out and "is verified (exit 75)" in out

    ok(ddpjob(["launch", *JOB, "--epochs", "3", "--max-steps", str(stop["step"] + 10)], work, timeout=300))
    starts = [r for r in records(run_dir) if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["step"] == stop["step"] and starts[1]["resumed_from"]


def test_a_stop_signal_repeated_until_launch_has_exited_leaves_its_exit_75(work):
    # CPython puts back each handled signal's default action as it exits: a TERM that reached launch
    # then (Slurm or train.sbatch forwarding it once more) killed it, after it had said "exit 75".
    agent, workers = start(work, "--epochs", "3", "--stop-check-every", "5")
    sent = 0
    while agent.poll() is None:
        signal_step([agent.pid, *workers], signal.SIGTERM)
        sent += 1
        time.sleep(0.02)
    out = agent.communicate(timeout=60)[0]
    assert agent.returncode == 75, (agent.returncode, sent, out[-3000:])
    assert "is verified (exit 75)" in out and out.count("[ddpjob] saved ") == 1, out[-3000:]
    assert not [pid for pid in workers if alive(pid)]


def test_workers_that_fail_to_checkpoint_on_a_stop_signal_give_launch_their_exit_code(work):
    agent, workers = start(work, "--epochs", "3", "--stop-check-every", "100")
    ckpt = work / "runs/ddpjob/checkpoints"
    ckpt.rename(ckpt.with_name("moved"))
    ckpt.write_text("the save at the stop cannot create a file here")  # works as root too, unlike chmod
    for _ in range(2):
        signal_step([agent.pid, *workers], signal.SIGTERM)
        time.sleep(0.2)
    out = agent.communicate(timeout=180)[0]
    assert agent.returncode == 3, out[-3000:]
    assert "cannot write checkpoint" in out and "exited with 3" in out, out[-3000:]
    assert not [pid for pid in workers if alive(pid)]


def test_workers_that_do_not_stop_are_killed_after_the_shutdown_timeout_and_launch_says_so(work):
    # A stop is only agreed every 10**6 steps: the workers train on after the signal.
    agent, workers = start(work, "--epochs", "100", "--stop-check-every", "1000000", "--shutdown-timeout", "4")
    sent = time.monotonic()
    for _ in range(3):  # later signals must not cut launch's wait short
        signal_step([agent.pid], signal.SIGTERM)
        time.sleep(0.5)
    out = agent.communicate(timeout=60)[0]
    waited = time.monotonic() - sent
    assert agent.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert 4 <= waited < 4 + 15, waited
    assert "--shutdown-timeout" in out and not [pid for pid in workers if alive(pid)], out[-3000:]


LATE_SIGNAL = """
import os
if "LOCAL_RANK" in os.environ:  # the workers, not launch
    import signal, time
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def late_signal_then_destroy(*args, **kwargs):  # called once the loop has stopped and saved
        os.kill(os.getpid(), signal.SIGTERM)  # the forward from train.sbatch, arriving late
        time.sleep(0.3)
        return destroy(*args, **kwargs)

    dist.destroy_process_group = late_signal_then_destroy
"""


def test_a_stop_signal_after_the_checkpoint_does_not_kill_the_worker(work, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    agent, workers = start(work, "--epochs", "3", "--stop-check-every", "5", **in_every_worker(site, LATE_SIGNAL))
    signal_step([agent.pid, *workers], signal.SIGTERM)
    out = agent.communicate(timeout=180)[0]
    assert agent.returncode == 75 and injected_ranks(site) == ["0", "1"], out[-3000:]
    assert out.count("[ddpjob] saved ") == 1 and not [pid for pid in workers if alive(pid)]


SLOW_EXIT = """
import os
if os.environ.get("RANK") == "1":  # one worker, not launch
    import time
    import torch.distributed as dist

    def slow_destroy(*args, **kwargs):  # after the stop's checkpoint is sealed and agreed
        time.sleep(60)

    dist.destroy_process_group = slow_destroy
"""


def test_a_worker_killed_after_the_stop_checkpoint_was_sealed_leaves_exit_75(work, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    env = in_every_worker(site, SLOW_EXIT)
    agent, workers = start(work, "--epochs", "3", "--stop-check-every", "5", "--shutdown-timeout", "3", **env)
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=180)[0]
    assert agent.returncode == 75 and injected_ranks(site) == ["0", "1"], out[-3000:]
    last = out.strip().splitlines()[-1]  # rank 1 killed (137); rank 0's exit may wait on it and be killed too
    assert re.search(r"is verified \(exit 75\); exit codes by local rank: (75|137), 137$", last), out[-3000:]
    assert not [pid for pid in workers if alive(pid)]


HELD_EXIT_ON_THIS_NODE = """
import os
if "LOCAL_RANK" in os.environ and os.environ.get("HELD_EXIT_ON_THIS_NODE"):  # this node's workers
    import time
    from pathlib import Path
    import torch.distributed as dist

    def held_destroy(*args, **kwargs):  # after the stop's checkpoint is sealed and agreed by every rank
        release = Path(os.environ["HELD_EXIT_ON_THIS_NODE"])
        for _ in range(6000):
            if release.exists():
                return
            time.sleep(0.01)

    dist.destroy_process_group = held_destroy
"""


def test_a_node_whose_store_host_left_first_after_a_stop_exits_75_though_node_0_was_replaced(work, tmp_path_factory):
    """A drain of node 0 (or any node) stops every rank at one step with a verified checkpoint. Node 0
    hosts the rendezvous store and may leave first, while another node's workers are still on their
    way out: that node's agent then finds the store gone. Its stop is still a stop (75, not counted
    by the scheduler), not a failure (1, counted against the Job's backoffLimit). Meanwhile node 0's
    replacement starts at once (the Job ignores its 75) in the same RUN_DIR: it must not take away the
    record of the stop that node 1 has yet to read. Forced: node 1's worker is held after the stop's
    checkpoint until the replacement's store listens."""
    site = tmp_path_factory.mktemp("site")
    env = in_every_worker(site, HELD_EXIT_ON_THIS_NODE)
    release = site / "release"
    port, replacement_port = free_ports(2)
    flags = ["--nnodes", "2", *JOB, "--nproc-per-node", "1"]
    flags += ["--epochs", "3", "--stop-check-every", "5", "--shutdown-timeout", "60"]
    at = ["--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [
        spawn(["launch", *flags, *at, "--node-rank", "0"], work, **env),
        spawn(["launch", *flags, *at, "--node-rank", "1"], work, HELD_EXIT_ON_THIS_NODE=str(release), **env),
    ]
    try:
        wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 20, 120, "training to start")
        nodes[0].send_signal(signal.SIGTERM)  # the drain of node 0
        outs = [nodes[0].communicate(timeout=180)[0]]
        assert nodes[0].returncode == 75 and nodes[1].poll() is None, outs[0][-3000:]
        at = ["--rdzv-endpoint", f"127.0.0.1:{replacement_port}"]  # its own port: node 1 must not join it
        nodes.append(spawn(["launch", *flags, *at, "--node-rank", "0"], work, **env))
        wait_until(lambda: listens(replacement_port), 120, "node 0's replacement to host its store")
        release.touch()
        outs.append(nodes[1].communicate(timeout=180)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    assert nodes[1].returncode == 75, outs[1][-3000:]
    last = outs[1].strip().splitlines()[-1]
    assert "ended as the nodes stopped" in last and "is verified (exit 75)" in last, outs[1][-3000:]
    assert sum(out.count("[ddpjob] saved ") for out in outs) == 1  # one checkpoint, by rank 0


def listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
