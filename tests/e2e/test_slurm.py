"""`sbatch slurm/train.sbatch` (and slurm/train-elastic.sbatch) on a real 2-node Slurm cluster (slurmctld +
2 slurmd in namespaces)."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from ddpjob.checkpoint import catalogue
from ddpjob.distenv import expand_hostlist
from ddpjob.launch import agent
from ddpjob.train.stop_signal import STOP_SIGNALS
from e2e import REPO, wait_for

pytestmark = pytest.mark.e2e


# This cluster's nodes have no GPUs; the batch scripts ask for 8 per node (sbatch's options win).
CPU_NODES = ("--gpus-per-node=0",)


def sbatch(env, *args, options=(), script="slurm/train.sbatch"):
    out = subprocess.run(
        ["sbatch", "--parsable", *CPU_NODES, *options, script, *args],
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


def all_finished(env, job_id):
    """Whether the job, or every task of an array job, has ended."""
    out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], env=env, capture_output=True, text=True).stdout
    states = re.findall(r"JobState=(\S+)", out)
    return all(state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") for state in states)


def run_dir(job_id):
    return REPO / "runs" / f"ddpjob-{job_id}"


def output(job_id):
    return (REPO / "runs" / f"ddpjob-{job_id}.out").read_text()


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def processes_of(job_id):
    """Pids of live processes that belong to Slurm job `job_id` (by SLURM_JOB_ID in their environment)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ:
            pids.append(int(proc.name))
    return pids


def scancel(env, *args):
    subprocess.run(["scancel", *args], env=env, check=True)


def end_for_good(env, job_id):
    """docs/clusters.md's way to end a job that requeues on TERM: not requeueable, then scancel."""
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "Requeue=0"], env=env, capture_output=True)
    subprocess.run(["scancel", job_id], env=env)


@pytest.fixture
def cleanup(slurm_env):
    jobs = []
    yield jobs
    for job_id in jobs:
        end_for_good(slurm_env, job_id)  # every task of an array; a no-op once it ended
        wait_for(lambda j=job_id: all_finished(slurm_env, j), 120, f"job {job_id} to end after scancel")
        for name in {job_id, *job_tasks(slurm_env, job_id).values()}:
            shutil.rmtree(run_dir(name), ignore_errors=True)
            (REPO / "runs" / f"ddpjob-{name}.out").unlink(missing_ok=True)


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


LM_ARGS = ("--model", "examples.lm:tiny_lm", "--data", "examples.lm:stdlib_text", "--epochs", "1")


@pytest.mark.parametrize(
    ("args", "options", "final_step"),
    [
        (("--epochs", "40", "--log-every", "20"), (), 40 * 22),
        (  # one torch thread per node: both nodes share this host's 2 cores
            (*LM_ARGS, "--max-steps", "40", "--batch-size", "4", "--log-every", "1", "--stop-check-every", "1"),
            ("--export=ALL,OMP_NUM_THREADS=1",),
            40,
        ),
    ],
    ids=["digits", "lm"],
)
def test_preemption_signal_checkpoints_requeues_and_resumes_to_completion(
    slurm_env, cleanup, args, options, final_step
):
    job_id = sbatch(slurm_env, *args, "--save-every", "0", options=options)
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
    assert records[-2]["event"] == "final" and records[-2]["step"] == final_step and "val_loss" in records[-2]
    assert "requeueing job" in out and "(restart 1)" in out  # --open-mode=append kept both attempts


def job_tasks(env, array_id):
    """{task id: job id} of the started tasks of an array job (of a plain job: {})."""
    out = subprocess.run(["scontrol", "show", "job", array_id, "-o"], env=env, capture_output=True, text=True).stdout
    tasks = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines()]
    return {t["ArrayTaskId"]: t["JobId"] for t in tasks if t.get("ArrayTaskId", "").isdigit()}


def training(job_id, timeout=180):
    metrics = run_dir(job_id) / "metrics.jsonl"
    wait_for(lambda: '"train"' in (metrics.read_text() if metrics.is_file() else ""), timeout, f"job {job_id} to train")
    return metrics


def assert_one_checkpoint_at_the_stop(job_id, records_before_stop=()):
    """Exactly one preempted record after `records_before_stop`, and exactly one checkpoint, at its step."""
    new = records(run_dir(job_id) / "metrics.jsonl")[len(records_before_stop) :]
    preempted = [r for r in new if r["event"] == "preempted"]
    assert len(preempted) == 1, new
    step = preempted[0]["step"]
    saved = sorted(p.name for p in (run_dir(job_id) / "checkpoints").iterdir() if re.fullmatch(r"step-\d+\.pt", p.name))
    assert saved == [f"step-{step}.pt"], saved
    return preempted[0]


@pytest.mark.parametrize("nodelist", ["a[1-3,5],b-[01-02]", "r[1-2]n[08-10],solo,x-[7]", "node01-ib,node02-ib"])
def test_the_host_list_parser_agrees_with_scontrol_show_hostnames(slurm_env, nodelist):
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], env=slurm_env, capture_output=True, text=True, check=True
    )
    assert expand_hostlist(nodelist) == out.stdout.split()


def test_a_suffix_this_scontrol_rejects_falls_back_to_the_parser(slurm_env, monkeypatch):
    """Slurm 22.05's scontrol says "Invalid hostlist" (exit 0) for `node[01-02]-ib`; launch then parses it."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    assert agent.slurm_first_host("node[01-02]-ib") == "node01-ib"
    assert agent.slurm_first_host("node[2-3],node1") == "node2"


def test_scancel_term_to_every_process_checkpoints_once_and_exits_75(slurm_env, cleanup):
    """TERM to the batch script, which forwards it to every process of the step (scancel), and TERM
    from Slurm to every process of the step (workers and agents) directly: each worker gets TERM
    from Slurm twice and from its agent. They checkpoint once and exit 75; launch waits for them
    and reports 75. (Not `--full`: srun answers a TERM of its own by killing the step.)"""
    job_id = sbatch(slurm_env, "--epochs", "40", "--log-every", "20", "--save-every", "0")
    cleanup.append(job_id)
    training(job_id)
    scancel(slurm_env, "--signal=TERM", "--batch", job_id)
    scancel(slurm_env, "--signal=TERM", job_id)
    state = wait_for(lambda: finished(slurm_env, job_id), 240, f"job {job_id} to stop")
    out = output(job_id)
    assert (state, job(slurm_env, job_id)["ExitCode"]) == ("FAILED", "75:0"), out[-3000:]
    assert "got TERM, forwarding" in out  # the batch script's second TERM reached the workers too
    assert "requeueing" not in out and job(slurm_env, job_id)["Restarts"] == "0"
    preempted = assert_one_checkpoint_at_the_stop(job_id)
    assert preempted["signal"] == 15 and preempted["step"] > 0
    assert out.count("[ddpjob] saved ") == 1, out[-3000:]
    ends = [r for r in records(run_dir(job_id) / "attempts.jsonl") if r["event"] == "end"]
    assert sorted(r["node_rank"] for r in ends) == [0, 1], ends
    assert all(r["exit_code"] == 75 for r in ends), ends
    # launch waited for its workers: it ended after rank 0 had written its checkpoint and record
    assert all(r["time"] >= preempted["time"] for r in ends), (ends, preempted)
    wait_for(lambda: not processes_of(job_id), 30, f"every process of job {job_id} to exit")


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_scancel_with_each_stop_signal_exits_75_with_a_verified_checkpoint_of_the_stop(slurm_env, cleanup, sig):
    """The stop-path table's Slurm rows (tests/test_stop_paths.py): `scancel --signal=SIG JOB` to every
    process of the step, for each signal ddpjob stops on: one verified checkpoint of the stop step,
    exit 75 on every node, and attempts.jsonl agrees."""
    job_id = sbatch(slurm_env, "--epochs", "40", "--log-every", "20", "--save-every", "0")
    cleanup.append(job_id)
    training(job_id)
    scancel(slurm_env, f"--signal={sig.name.removeprefix('SIG')}", job_id)
    wait_for(lambda: finished(slurm_env, job_id), 240, f"job {job_id} to stop")
    out = output(job_id)
    assert job(slurm_env, job_id)["ExitCode"] == "75:0", out[-3000:]
    preempted = assert_one_checkpoint_at_the_stop(job_id)
    assert preempted["signal"] == sig
    assert catalogue.verify(run_dir(job_id) / f"checkpoints/step-{preempted['step']}.pt") is None
    ends = [r for r in records(run_dir(job_id) / "attempts.jsonl") if r["event"] == "end"]
    assert sorted(r["node_rank"] for r in ends) == [0, 1] and all(r["exit_code"] == 75 for r in ends), ends


def test_preemption_usr1_to_the_script_and_term_to_every_process_checkpoints_once_and_resumes(slurm_env, cleanup):
    """A preemption warning (USR1 to the batch script, as --signal=B:USR1 sends it) followed at once by
    TERM to every process of the step: one checkpoint, exit 75, requeue, resume at that step."""
    job_id = sbatch(slurm_env, "--epochs", "40", "--log-every", "20", "--save-every", "0")
    cleanup.append(job_id)
    metrics = training(job_id)
    scancel(slurm_env, "--signal=USR1", "--batch", job_id)
    scancel(slurm_env, "--signal=TERM", job_id)
    wait_for(lambda: job(slurm_env, job_id).get("Restarts") == "1", 180, "the job to requeue itself")
    preempted = assert_one_checkpoint_at_the_stop(job_id)
    wait_for(lambda: [r for r in records(metrics) if r["event"] == "start"][1:], 300, "the requeued job to start")
    resumed = [r for r in records(metrics) if r["event"] == "start"][1]
    assert resumed["step"] == preempted["step"] > 0
    end_for_good(slurm_env, job_id)  # a plain scancel would requeue it again (TERM)
    wait_for(lambda: job(slurm_env, job_id).get("JobState") == "CANCELLED", 120, "the job to end, cancelled")
    assert job(slurm_env, job_id)["Restarts"] == "1"
    assert resumed["resumed_from"].endswith(f"step-{preempted['step']}.pt")
    assert "requeueing job" in output(job_id)


def test_a_cluster_that_only_sends_term_requeues_with_requeue_on_term(slurm_env, cleanup):
    env = {**slurm_env, "DDPJOB_REQUEUE_ON_TERM": "1"}  # a batch-script setting: ddpjob itself must not see it
    job_id = sbatch(env, "--epochs", "40", "--log-every", "20", "--save-every", "0")
    cleanup.append(job_id)
    metrics = training(job_id)
    scancel(slurm_env, "--signal=TERM", "--batch", job_id)  # TERM, no USR1, to the batch script
    wait_for(lambda: job(slurm_env, job_id).get("Restarts") == "1", 180, "the job to requeue itself on TERM")
    preempted = assert_one_checkpoint_at_the_stop(job_id)
    assert preempted["signal"] == 15
    wait_for(lambda: [r for r in records(metrics) if r["event"] == "start"][1:], 300, "the requeued job to start")
    resumed = [r for r in records(metrics) if r["event"] == "start"][1]
    assert resumed["step"] == preempted["step"] > 0
    end_for_good(slurm_env, job_id)  # a plain scancel would requeue it again (TERM)
    wait_for(lambda: job(slurm_env, job_id).get("JobState") == "CANCELLED", 120, "the job to end, cancelled")
    assert job(slurm_env, job_id)["Restarts"] == "1"


def test_an_array_task_requeues_only_itself(slurm_env, cleanup):
    array_id = sbatch(
        slurm_env, "--epochs", "40", "--log-every", "20", "--save-every", "0", options=["--array=0-1", "--nodes=1"]
    )
    cleanup.append(array_id)
    tasks = wait_for(lambda: len(job_tasks(slurm_env, array_id)) == 2 and job_tasks(slurm_env, array_id), 120, "tasks")
    # The task whose job id is the array's own id: a bare `scontrol requeue $SLURM_JOB_ID` there
    # requeues every task of the array.
    hit = next(task for task, job_id in tasks.items() if job_id == array_id)
    spared = next(task for task in tasks if task != hit)
    for job_id in tasks.values():
        training(job_id)
    scancel(slurm_env, "--signal=USR1", "--batch", f"{array_id}_{hit}")
    wait_for(lambda: job(slurm_env, f"{array_id}_{hit}").get("Restarts") == "1", 180, f"task {hit} to requeue itself")
    assert f"requeueing job {array_id}_{hit}" in output(array_id)
    other = job(slurm_env, f"{array_id}_{spared}")
    assert other["Restarts"] == "0" and other["JobState"] in ("RUNNING", "COMPLETED"), other
    assert not [r for r in records(run_dir(tasks[spared]) / "metrics.jsonl") if r["event"] == "preempted"]


def node_of(pid):
    """SLURM_NODEID of a process, from its environment ('' if gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    return next((v[len(b"SLURM_NODEID=") :].decode() for v in environ if v.startswith(b"SLURM_NODEID=")), "")


def test_elastic_sbatch_trains_on_when_a_node_dies_and_exits_with_node_0s_code(slurm_env, cleanup):
    """slurm/train-elastic.sbatch on 2 nodes (1:2; cons_tres grants the minimum of a range here): both train (world size 2); every process of the
    second node's task is SIGKILLed, as a node failure leaves the step there; node 0 re-forms the
    group alone from the newest checkpoint and completes, and the job ends COMPLETED with node 0's 0,
    not with srun's status (which counts the dead node)."""
    env = {**slurm_env, "PYTHONPATH": str(REPO / "tests/e2e/plugins")}  # slow_digits: ~1.5 s a step at 2 nodes
    flags = ["--global-batch-size", "96", "--batch-size", "8", "--epochs", "2", "--save-every", "3"]
    flags += ["--log-every", "1", "--data", "slow_digits:digits(delay=0.03)"]
    job_id = sbatch(env, *flags, options=["--nodes=2"], script="slurm/train-elastic.sbatch")  # both nodes here
    cleanup.append(job_id)
    metrics = run_dir(job_id) / "metrics.jsonl"

    def saved_at_2():  # trained on 2 nodes, with a checkpoint to resume from (--save-every 3)
        started = any(r["event"] == "start" and r["world_size"] == 2 for r in records(metrics))
        return started and (run_dir(job_id) / "checkpoints/step-3.pt.sum").is_file()

    wait_for(saved_at_2, 180, f"job {job_id} to train on 2 nodes to a checkpoint")
    second = [pid for pid in processes_of(job_id) if node_of(pid) == "1"]
    assert second, "no process of the second node's task"
    for pid in second:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    state = wait_for(lambda: finished(slurm_env, job_id), 300, f"job {job_id} to finish on node 0")
    log = output(job_id)
    assert state == "COMPLETED" and job(slurm_env, job_id)["ExitCode"] == "0:0", log[-4000:]
    assert "elastic, 1:2 nodes (granted 2)" in log and "--nnodes=1:2" in log
    assert re.search(r"srun exited with [1-9]\d* \(a node that left\); node 0 exited with 0", log), log[-4000:]
    recs = records(metrics)
    assert [(r["old_world_size"], r["world_size"]) for r in recs if r["event"] == "resize"] == [(2, 1)]
    final = 2 * (1437 // 96)
    assert max(r["step"] for r in recs if r["event"] == "train") == final
    assert (run_dir(job_id) / f"checkpoints/step-{final}.pt").is_file()
