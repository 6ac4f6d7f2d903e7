"""A slow rank is named: real torchrun workers, one of them held to a CPU quota by the test (stopped
for 10 ms of every 15 ms, as a cgroup quota or a noisy neighbour would)."""

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from helpers import PY, REPO, clean_env, ok, rank_of, spawn, wait_until, workers_of

pytestmark = pytest.mark.slow

# A step's own time (about 13 ms at width 2048) exceeds the quota's 5 ms running window, so that every
# own window spans a stop. At width 256 (under 1 ms a step) the steps could fall in step with the
# quota, whole intervals passing with no stop inside an own window and rank 1 not the slowest.
JOB = ["--data", "ddpjob.plugins:synthetic(samples=8192)", "--model", "ddpjob.plugins:synthetic_mlp(width=2048)"]
JOB += ["--epochs", "50", "--max-steps", "100", "--log-every", "5", "--save-every", "0"]


def torchrun_script(cwd, script, nproc):  # type: ignore[no-untyped-def]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=120)


def quota(pid: int, done: threading.Event, run_s: float = 0.005, stop_s: float = 0.01) -> None:
    while not done.is_set():
        time.sleep(run_s)
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return


@pytest.mark.serial
@pytest.mark.alone  # it measures step times
def test_a_rank_held_to_a_cpu_quota_is_named_as_the_straggler_with_its_host(tmp_path):
    agent = spawn(["launch", "--nproc-per-node", "2", *JOB], tmp_path)
    wait_until(lambda: len(workers_of(agent.pid)) == 2, 60, "two workers")
    slow = next(pid for pid in workers_of(agent.pid) if rank_of(pid) == 1)
    done = threading.Event()
    threading.Thread(target=quota, args=(slow, done), daemon=True).start()
    try:
        out = agent.communicate(timeout=300)[0]
    finally:
        done.set()
    assert agent.returncode == 0, out[-3000:]
    warnings = [line for line in out.splitlines() if "is a straggler" in line]
    assert len(warnings) == 1 and "warning: rank 1 (" in warnings[0], warnings or out[-3000:]  # named, once
    records = [json.loads(line) for line in (tmp_path / "runs/ddpjob/metrics.jsonl").read_text().splitlines()]
    intervals = [r for r in records if r["event"] == "train" and "slowest_rank" in r]
    assert len(intervals) == 20 and all(r["slowest_host"] and r["own_ms_spread"] >= 1 for r in intervals)
    assert sum(r["slowest_rank"] == 1 for r in intervals) >= 16


def test_the_timing_hooks_leave_ddp_training_bitwise_as_it_was_at_3_ranks(tmp_path):
    # the hooks only count gradients: DDP's own reduction (scaled by 1/3 as it fills a bucket) stays
    out = ok(torchrun_script(tmp_path, REPO / "tests/plugins/hook_bitwise.py", nproc=3))
    assert "bitwise equal: True" in out
