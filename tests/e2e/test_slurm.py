"""`sbatch slurm/train.sbatch` on a real 2-node Slurm cluster (slurmctld + 2 slurmd in namespaces)."""

import json
import re
import shutil
import subprocess

import pytest

from e2e import REPO, wait_for

pytestmark = pytest.mark.e2e


def sbatch(env, *args):
    out = subprocess.run(
        ["sbatch", "--parsable", "slurm/train.sbatch", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def job(env, job_id):
    out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def finished(env, job_id):
    state = job(env, job_id).get("JobState")
    return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else None


def run_dir(job_id):
    return REPO / "runs" / f"ddpjob-{job_id}"


def output(job_id):
    return (REPO / "runs" / f"ddpjob-{job_id}.out").read_text()


@pytest.fixture
def cleanup():
    jobs = []
    yield jobs
    for job_id in jobs:
        shutil.rmtree(run_dir(job_id), ignore_errors=True)
        (REPO / "runs" / f"ddpjob-{job_id}.out").unlink(missing_ok=True)


def test_sbatch_two_nodes_completes_with_a_checkpoint(slurm_env, cleanup):
    job_id = sbatch(slurm_env, "--epochs", "2")
    cleanup.append(job_id)
    state = wait_for(lambda: finished(slurm_env, job_id), 240, f"job {job_id}")
    assert state == "COMPLETED", output(job_id)[-3000:]
    assert job(slurm_env, job_id)["ExitCode"] == "0:0"
    out = output(job_id)
    assert "scheduler=slurm" in out and "rendezvous 198.19.0.11:" in out  # the head node's address, not its name
    assert (run_dir(job_id) / "checkpoints/step-44.pt").is_file()
    assert "done: step 44" in out


def test_sbatch_fails_with_the_bad_input_exit_code(slurm_env, cleanup):
    job_id = sbatch(slurm_env, "--lr", "fast")
    cleanup.append(job_id)
    assert wait_for(lambda: finished(slurm_env, job_id), 120, f"job {job_id}") == "FAILED"
    assert job(slurm_env, job_id)["ExitCode"] == "2:0"
    assert "--lr='fast' is not a number" in output(job_id)


def test_preemption_signal_checkpoints_requeues_and_resumes_to_completion(slurm_env, cleanup):
    job_id = sbatch(slurm_env, "--epochs", "40", "--log-every", "20", "--save-every", "0")
    cleanup.append(job_id)
    metrics = run_dir(job_id) / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and '"train"' in metrics.read_text(), 180, "training to start")
    # What --signal=B:USR1@120 does before the time limit: USR1 to the batch shell only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm_env, check=True)
    wait_for(lambda: job(slurm_env, job_id).get("Restarts") == "1", 120, "the job to requeue itself")
    # A requeued job starts again once its old credential expires (cred_expire, 10 s on this cluster).
    state = wait_for(lambda: finished(slurm_env, job_id), 300, f"job {job_id} after requeue")
    out = output(job_id)
    assert state == "COMPLETED", out[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    preempted = [r for r in records if r["event"] == "preempted"]
    starts = [r for r in records if r["event"] == "start"]
    assert len(preempted) == 1 and preempted[0]["signal"] == 10  # SIGUSR1
    assert len(starts) == 2 and starts[1]["step"] == preempted[0]["step"] > 0
    assert starts[1]["resumed_from"].endswith(f"step-{preempted[0]['step']}.pt")
    assert records[-2]["event"] == "final" and records[-2]["step"] == 40 * 22
    assert "requeueing job" in out and "(restart 1)" in out  # --open-mode=append kept both attempts
