"""Training at a changed world size, with real torchrun processes: a run resumed on fewer or more
processes continues the same run. With --global-batch-size fixed, every step trains on exactly the
samples an uninterrupted run's step does, at the same LR, and the parameters match within float
tolerance (the gradient sums run in another order, so bitwise cannot hold)."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ddpjob.checkpoint import catalogue
from ddpjob.checkpoint.formats import dcp_folder, single_file
from ddpjob.train import rng
from helpers import (
    ddpjob,
    launched,
    lr_by_step,
    ok,
    records,
    samples_by_step,
    spawn,
    trained_steps,
    wait_until,
)
from ports import free_port

# The resume-at-another-world-size tests compare samples, LRs and weights, whatever the timing: they
# run in the parallel tier. The elastic tests below act on live agents mid-run: `serial`.
pytestmark = pytest.mark.slow

STEPS = 44  # digits: 1437 training samples, 22 steps of 64 per epoch, 2 epochs
GLOBAL = ["--batch-size", "16", "--global-batch-size", "64"]
JOB = [
    "--data",
    "tests.plugins.recording:digits",
    "--model",
    "ddpjob.plugins:digits_mlp(dropout=0.0)",
    "--epochs",
    "2",
    "--log-every",
    "1",
    "--save-every",
    "5",
    "--num-workers",
    "0",
]
# Measured: 1.5e-8 apart at most (one float32 ulp of these weights) after 44 AdamW steps at 1 and 4
# processes; a skipped or repeated micro-batch, or a shifted LR, moves them by far more.
ATOL = 1e-6


def model_state(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = catalogue.list_steps(run_dir / "checkpoints")[0][1]
    return dcp_folder.read_model(newest) if newest.is_dir() else single_file.read(newest)["model"]


def trained(work: Path, nproc: int, *extra: str) -> str:
    samples = work / "samples"
    samples.mkdir(exist_ok=True)
    return ok(launched([*JOB, *GLOBAL, *extra], work, nproc=nproc, TEST_SAMPLES_DIR=str(samples)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("whole")
    trained(work, 2)
    return work


@pytest.mark.parametrize("fmt", ["file", "dcp"])
@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_at_another_world_size_sees_the_same_samples_and_lr_per_step(tmp_path, uninterrupted, fmt, new_world):
    fmt_flags = ["--checkpoint-format", fmt]
    trained(tmp_path, 2, *fmt_flags, "--max-steps", "30")  # mid-epoch 1
    out = trained(tmp_path, new_world, *fmt_flags)
    run_dir, whole = tmp_path / "runs/ddpjob", uninterrupted / "runs/ddpjob"

    assert f"world size 2 -> {new_world} at step 30: global batch 64 kept" in out
    resize = [r for r in records(run_dir) if r["event"] == "resize"]
    assert [(r["old_world_size"], r["world_size"], r["step"]) for r in resize] == [(2, new_world, 30)]
    seen, expected = samples_by_step(run_dir, tmp_path / "samples"), samples_by_step(whole, uninterrupted / "samples")
    assert list(expected) == list(range(1, STEPS + 1)) and all(len(ids) == 64 for ids in expected.values())
    assert seen == expected  # each step: the same 64 samples, none repeated or skipped
    for epoch in (0, 1):  # so each epoch saw every sample of its permutation's 22 x 64 at most once
        ids = [i for step in range(22 * epoch + 1, 22 * epoch + 23) for i in seen[step]]
        assert len(set(ids)) == len(ids) == 22 * 64
    assert lr_by_step(run_dir) == lr_by_step(whole)  # the same float at every step
    ours, theirs = model_state(run_dir), model_state(whole)
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    assert worst <= ATOL, f"parameters differ by {worst:g}"


def test_a_resume_at_a_new_world_size_seeds_each_rank_from_seed_step_and_rank(tmp_path):
    # The default model has dropout: at a new world size there are no saved per-rank streams to
    # continue, so each rank's RNG is seeded from (seed, step, rank), the same at every such resume,
    # and not the stream the run started with (seed + rank), which would replay its first masks.
    job = ["--data", "ddpjob.plugins:digits", "--model", "tests.plugins.recording:model", "--epochs", "1", *GLOBAL]
    job += ["--save-every", "0"]
    draws = tmp_path / "draws"
    draws.mkdir()
    ok(launched([*job, "--max-steps", "10"], tmp_path, nproc=2, TEST_SAMPLES_DIR=str(draws)))
    (draws / "rng-rank0.draws").unlink()
    finals = []
    for copy in ("a", "b"):
        run_dir = tmp_path / copy
        resume = ["--run-dir", str(run_dir), "--resume", str(tmp_path / "runs/ddpjob/checkpoints/step-10.pt")]
        ok(launched([*job, *resume], tmp_path, nproc=1, TEST_SAMPLES_DIR=str(draws)))
        finals.append(single_file.read(catalogue.list_steps(run_dir / "checkpoints")[0][1])["model"])
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    torch.manual_seed(rng.derived_seed(0, 10, 0))
    expected = torch.rand(()).item()
    assert [float(x) for x in (draws / "rng-rank0.draws").read_text().split()] == [expected, expected]


def test_without_a_global_batch_size_a_new_world_size_warns_that_the_run_changes(tmp_path):
    job = ["--data", "ddpjob.plugins:digits", "--epochs", "1", "--save-every", "0", "--batch-size", "16"]
    ok(launched([*job, "--max-steps", "10"], tmp_path, nproc=2))
    out = ok(launched(job, tmp_path, nproc=1))
    assert "warning: world size 2 -> 1 at step 10: the global batch changes 32 -> 16" in out
    assert "--global-batch-size" in out


def test_a_resume_on_a_dataset_of_another_size_is_refused_in_one_line(tmp_path):
    # the cursor counts places in a permutation of the dataset: on other data it would skip or repeat
    job = ["train", "--model", "ddpjob.plugins:synthetic_mlp(width=64)", "--epochs", "1", "--max-steps", "5", "--data"]
    ok(ddpjob([*job, "ddpjob.plugins:synthetic(samples=512)"], tmp_path))
    proc = ddpjob([*job, "ddpjob.plugins:synthetic(samples=640)"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "trained on a dataset of 512 samples, this --data has 640" in proc.stderr.strip().splitlines()[-1]


# Elastic: real agents (`ddpjob launch`, one worker each) on one rendezvous, nodes lost and added.
ELASTIC = [
    *JOB[2:],
    "--data",
    # ~0.13 s per step at 2 processes, time to act mid-run, until the test makes samples/acted
    "tests.plugins.recording:digits(delay=0.004, until='acted')",
    "--epochs",
    "4",
    "--stop-check-every",
    "1",
    *GLOBAL,
]
ELASTIC_STEPS = 88


@pytest.fixture(scope="module")
def elastic_reference(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("elastic-whole")
    trained_as(work, [*ELASTIC, "--data", "tests.plugins.recording:digits"], 2)  # no one acts on it: no delay
    return work


def trained_as(work: Path, job: list[str], nproc: int) -> str:
    samples = work / "samples"
    samples.mkdir(exist_ok=True)
    return ok(launched(job, work, nproc=nproc, timeout=300, TEST_SAMPLES_DIR=str(samples)))


def node(work: Path, port: int, rank: int, *extra: str) -> subprocess.Popen[str]:
    samples = work / "samples"
    samples.mkdir(exist_ok=True)
    flags = ["--nnodes", "1:2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    flags += ["--max-restarts", "3", "--elastic-wait", "2", "--nproc-per-node", "1"]
    return spawn(["launch", *flags, *ELASTIC, *extra], work, TEST_SAMPLES_DIR=str(samples))


def assert_same_run(work: Path, reference: Path, sizes: list[int]) -> None:
    run_dir, whole = work / "runs/ddpjob", reference / "runs/ddpjob"
    starts = [r["world_size"] for r in records(run_dir) if r["event"] == "start"]
    assert starts[0] == sizes[0] and starts[-1] == sizes[-1], starts
    resizes = [(r["old_world_size"], r["world_size"]) for r in records(run_dir) if r["event"] == "resize"]
    assert resizes and resizes[0] == (sizes[0], sizes[1]), resizes
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(a["old_world_size"], a["world_size"]) for a in attempts if a.get("event") == "resize"] == resizes
    seen, expected = samples_by_step(run_dir, work / "samples"), samples_by_step(whole, reference / "samples")
    assert list(expected) == list(range(1, ELASTIC_STEPS + 1))
    assert seen == expected
    assert lr_by_step(run_dir) == lr_by_step(whole)
    ours, theirs = model_state(run_dir), model_state(whole)
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    assert worst <= ATOL, f"parameters differ by {worst:g}"


@pytest.mark.serial
@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_a_node_lost_mid_run_leaves_the_other_to_finish_the_same_run_alone(tmp_path, elastic_reference, fmt):
    port, run_dir = free_port(), tmp_path / "runs/ddpjob"
    nodes = [node(tmp_path, port, rank, "--checkpoint-format", fmt) for rank in (0, 1)]
    wait_until(lambda: trained_steps(run_dir) >= 12, 120, "step 12")
    os.kill(nodes[1].pid, signal.SIGKILL)  # the whole agent: its worker follows it (exit_with_parent, within 1 s)
    try:
        wait_until(lambda: any(r["event"] == "resize" for r in records(run_dir)), 120, "the group to shrink")
    except AssertionError as error:  # what node 0 said and the records, for the cause (seen once under load)
        nodes[0].kill()
        out = nodes[0].communicate(timeout=60)[0]
        raise AssertionError(f"{error}\nrecords: {records(run_dir)[-5:]}\nnode 0: {out[-3000:]}") from None
    (tmp_path / "samples/acted").touch()
    out = nodes[0].communicate(timeout=300)[0]
    assert nodes[0].returncode == 0, out[-3000:]
    assert_same_run(tmp_path, elastic_reference, [2, 1])


@pytest.mark.serial
@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_a_node_joining_mid_run_grows_the_group_which_finishes_the_same_run(tmp_path, elastic_reference, fmt):
    port, run_dir = free_port(), tmp_path / "runs/ddpjob"
    first = node(tmp_path, port, 0, "--checkpoint-format", fmt)
    wait_until(lambda: trained_steps(run_dir) >= 8, 120, "step 8")
    second = node(tmp_path, port, 1, "--checkpoint-format", fmt)
    wait_until(lambda: any(r["event"] == "resize" for r in records(run_dir)), 120, "the group to grow")
    (tmp_path / "samples/acted").touch()
    outs = [n.communicate(timeout=300)[0] for n in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], [o[-3000:] for o in outs]
    assert_same_run(tmp_path, elastic_reference, [1, 2])
    # the agent stopped its worker to admit the new node: it checkpointed where it stopped, so the
    # larger group resumed at that very step and no step was trained twice
    resize = next(r for r in records(run_dir) if r["event"] == "resize")
    assert resize["step"] in [r["step"] for r in records(run_dir) if r["event"] == "preempted"]


@pytest.mark.serial
def test_losing_node_0_which_hosts_the_store_ends_the_others_at_once_in_one_line(tmp_path):
    port, run_dir = free_port(), tmp_path / "runs/ddpjob"
    nodes = [node(tmp_path, port, rank) for rank in (0, 1)]
    wait_until(lambda: trained_steps(run_dir) >= 8, 120, "step 8")
    os.kill(nodes[0].pid, signal.SIGKILL)
    out = nodes[1].communicate(timeout=120)[0]  # not the 300 s rendezvous timeout
    assert nodes[1].returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "the rendezvous store at 127.0.0.1" in last and "(node 0) is gone after the job had started" in last
    assert "start the job again: it resumes from the newest checkpoint" in last
