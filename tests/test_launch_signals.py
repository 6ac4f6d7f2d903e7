"""Stop signals on Slurm's path, with real processes: `scancel`, preemption and train.sbatch's forward
signal every process of the step, so the workers get each signal directly as well as from torchrun's
agent in `ddpjob launch`, and the agent gets several. Workers checkpoint once and exit 75; launch
waits for them (within --shutdown-timeout) and reports 75 only when they did, else their own code."""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, ddpjob, ok, spawn

pytestmark = pytest.mark.slow

# 128 steps per epoch per rank; a stop is agreed at a multiple of --stop-check-every (within two):
# with 100, the workers take a second or more to stop after a signal, and further signals land then.
JOB = [
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


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trained_steps(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir) if r["event"] == "train"), default=0)


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def workers_of(agent_pid: int) -> list[int]:
    """The `ddpjob train` processes whose parent is the agent (torchrun runs inside launch)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent_pid and b"train" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
    assert "workers checkpointed and stopped" in out

    ok(ddpjob(["launch", *JOB, "--epochs", "3", "--max-steps", str(stop["step"] + 10)], work, timeout=300))
    starts = [r for r in records(run_dir) if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["step"] == stop["step"] and starts[1]["resumed_from"]


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
    (site / "sitecustomize.py").write_text(LATE_SIGNAL)
    agent, workers = start(work, "--epochs", "3", "--stop-check-every", "5", PYTHONPATH=f"{site}:{REPO}")
    signal_step([agent.pid, *workers], signal.SIGTERM)
    out = agent.communicate(timeout=180)[0]
    assert agent.returncode == 75, out[-3000:]
    assert out.count("[ddpjob] saved ") == 1 and not [pid for pid in workers if alive(pid)]
