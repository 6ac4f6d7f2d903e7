"""Phase timeouts (start-up, steps, evaluation) and the watchdog that fails a rank without progress."""

import subprocess
import time
from pathlib import Path

import pytest

from helpers import ddpjob, ok, plain_env_ranks, spawn
from ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.serial]

JOB = ["--epochs", "1", "--log-every", "1000", "--save-every", "0"]


def outputs(procs: list[subprocess.Popen[str]], timeout: float = 300) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_a_loader_that_never_returns_fails_the_rank_with_exit_1_past_the_step_timeout(work: Path) -> None:
    """One process, no collective to time out: only the watchdog can end this job."""
    proc = ddpjob(
        ["train", *JOB, "--data", "tests.plugins.stalls:hanging", "--collective-timeout", "2"], work, timeout=300
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = "rank 0: no progress for 1"  # the limit 2 s + the grace 10 s: 12 s
    assert line in proc.stderr and "in step, past --collective-timeout (2 s): exiting 1" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    stack = (work / "runs/ddpjob/traces/stack_0.txt").read_text()
    assert "__getitem__" in stack, stack  # where it stopped, for `ddpjob diagnose`
    verdict = ok(ddpjob(["diagnose", "runs/ddpjob"], work)).splitlines()
    assert verdict[0].startswith("no rank is waiting in a collective"), verdict
    assert verdict[1].startswith("rank(s) 0 (") and "stalls.py" in verdict[1] and "in __getitem__" in verdict[1]


def test_a_rank_stuck_in_c_holding_the_gil_is_still_ended_by_the_c_timer(work: Path) -> None:
    """The watchdog thread cannot run; faulthandler's timer (a C thread) dumps the stacks and exits 1."""
    proc = ddpjob(
        ["train", *JOB, "--data", "tests.plugins.stalls:gil_held", "--collective-timeout", "2"], work, timeout=300
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Timeout (0:00:" in proc.stderr and "in hold" in proc.stderr, proc.stderr[-2000:]


def test_a_peer_that_arrives_late_is_waited_for_by_startup_not_by_the_step_timeout(work: Path) -> None:
    port, args = free_port(), ["train", *JOB, "--collective-timeout", "3"]
    procs = [spawn(args, work, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))]
    time.sleep(8)  # rank 1 starts 8 s later: longer than a step may wait, well within start-up
    procs.append(spawn(args, work, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    outs = outputs(procs)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:]


def test_a_peer_later_than_the_startup_timeout_fails_in_one_line(work: Path) -> None:
    port = free_port()
    proc = spawn(
        ["train", *JOB, "--startup-timeout", "3"],
        work,
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    out = outputs([proc])[0]
    assert proc.returncode == 1, out[-2000:]
    assert "rank 0: the 2 processes did not meet within --startup-timeout (3 s)" in out, out[-2000:]
    assert f"cannot reach 127.0.0.1:{port}" in out and "Traceback" not in out


@pytest.mark.parametrize(("eval_timeout", "code"), [("60", 0), ("3", 1)])
def test_a_slow_evaluation_is_bounded_by_the_eval_timeout_not_the_step_timeout(
    work: Path, eval_timeout: str, code: int
) -> None:
    """Rank 1's evaluation takes 8 s longer; rank 0 waits for it in the evaluation's all-reduce."""
    args = [*JOB, "--data", "tests.plugins.stalls:slow_eval", "--collective-timeout", "3"]
    procs = plain_env_ranks([*args, "--eval-timeout", eval_timeout], work, free_port())
    outs = outputs(procs)
    assert procs[0].returncode == code, outs[0][-2000:]
    if code:
        assert "rank 0: a collective failed (" in outs[0] and "--eval-timeout (3 s) in eval" in outs[0], outs[0][-2000:]
