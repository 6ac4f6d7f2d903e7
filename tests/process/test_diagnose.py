"""`ddpjob diagnose` on real stuck jobs (gloo, torchrun): every rank that can still act writes its
collectives and stacks to RUN_DIR/traces, and the verdict names the rank that stopped the job."""

import os
import shutil
import signal
from pathlib import Path

import pytest

from helpers import ddpjob, rank_of, spawn, trained_steps, wait_until, workers_of

pytestmark = [pytest.mark.slow, pytest.mark.serial]

JOB = ["--data", "ddpjob.plugins:digits", "--epochs", "50", "--log-every", "1", "--save-every", "0"]
JOB += ["--trace-after", "2", "--collective-timeout", "60"]


def stuck_job(work: Path, *model: str):  # type: ignore[no-untyped-def]
    agent = spawn(["launch", "--nproc-per-node", "2", *JOB, *model], work)
    wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 3, 120, "training")
    # A slow start-up (a fresh clone's first run) leaves every rank's traces of that stall: the test
    # wants each rank's traces of the stall it makes next, or none, and diagnose reads what is there.
    shutil.rmtree(work / "runs/ddpjob/traces", ignore_errors=True)
    return agent, {rank_of(pid): pid for pid in workers_of(agent.pid)}


def verdict_once_traced(work: Path, ranks: list[int]) -> str:
    folder = work / "runs/ddpjob/traces"
    wait_until(lambda: all((folder / f"meta_{r}.json").exists() for r in ranks), 60, f"traces of ranks {ranks}")
    proc = ddpjob(["diagnose", str(work / "runs/ddpjob")], work)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_rank_stopped_with_sigstop_is_named_as_the_one_that_wrote_no_trace(tmp_path):
    agent, pids = stuck_job(tmp_path)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        out = verdict_once_traced(tmp_path, [0])
    finally:
        agent.kill()
        os.kill(pids[1], signal.SIGKILL)
        agent.communicate(timeout=60)
    assert "rank(s) 1 wrote no trace (stopped, e.g. SIGSTOP" in out, out
    assert "gloo:" in out and "which rank(s) 0 (" in out and "are waiting in" in out, out


def test_a_rank_that_never_reaches_the_collective_is_named_with_its_stack(tmp_path):
    agent, _ = stuck_job(tmp_path, "--model", "tests.plugins.stuck:model(at=6)")
    try:
        out = verdict_once_traced(tmp_path, [0, 1])
    finally:
        agent.kill()
        agent.communicate(timeout=60)
    first = out.splitlines()[0]
    assert first.startswith("rank 1 (") and "never entered gloo:" in first and "which rank(s) 0 (" in first, out
    assert "its last stack: File" in first and "stuck.py" in first and "in forward" in first, out
