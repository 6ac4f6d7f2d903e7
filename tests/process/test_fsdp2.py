"""--strategy fsdp2 with real torchrun processes on gloo: it trains as DDP does, its sharded
checkpoints resume bitwise, at another world size and under the other strategy, survive a kill
mid-save and convert to one file; each rank holds 1/N of the state; bad input is one line."""

import os
import shutil
import signal
import subprocess

import pytest
import torch

from ddpjob.checkpoint import catalogue
from ddpjob.checkpoint.formats import dcp_folder, hf_safetensors
from helpers import (
    PY,
    assert_bitwise_equal,
    clean_env,
    ddpjob,
    final_params,
    launched,
    ok,
    records,
    spawn,
    trained_steps,
    wait_until,
)
from plugins.shards import write_shards

pytestmark = pytest.mark.slow
TOLERANCE = 1e-6  # fsdp2 against DDP, and across world sizes: float sums in another order
FSDP2 = ["--strategy", "fsdp2", "--checkpoint-format", "dcp"]
DCP = ["--checkpoint-format", "dcp"]
# 16 optimizer steps of 2 micro-batches each, clipped: the accumulation and clipping paths.
JOB = ["--epochs", "2", "--max-steps", "16", "--save-every", "8", "--log-every", "4", "--grad-accum", "2"]
JOB += ["--grad-clip", "0.5"]
NO_DROPOUT = ["--model", "ddpjob.plugins:digits_mlp(dropout=0.0)"]  # no per-rank RNG stream: any world size


def model_at(run_dir, step: int) -> dict[str, torch.Tensor]:
    return dcp_folder.read_model(run_dir / f"checkpoints/step-{step}")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def record(run_dir, event: str) -> dict:
    return [r for r in records(run_dir) if r["event"] == event][-1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same job at world size 2 under DDP and under fsdp2, both saving DCP folders."""
    work = tmp_path_factory.mktemp("pair")
    ok(launched([*JOB, *DCP, "--run-dir", "ddp"], work))
    ok(launched([*JOB, *FSDP2, "--run-dir", "fsdp2"], work))
    return work


def test_fsdp2_trains_as_ddp_does_with_accumulation_and_clipping(pair):
    for step in (8, 16):
        assert max_difference(model_at(pair / "ddp", step), model_at(pair / "fsdp2", step)) <= TOLERANCE
    norms = {run: [r["grad_norm"] for r in records(pair / run) if r["event"] == "train"] for run in ("ddp", "fsdp2")}
    assert len(norms["ddp"]) == 4 and norms["fsdp2"] == pytest.approx(norms["ddp"], abs=TOLERANCE)  # the global norm
    assert record(pair / "fsdp2", "start")["strategy"] == "fsdp2"


def test_each_fsdp2_rank_holds_half_the_state_of_a_ddp_rank(pair):
    ddp, fsdp2 = record(pair / "ddp", "memory"), record(pair / "fsdp2", "memory")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert len(ddp[key]) == len(fsdp2[key]) == 2 and ddp[key][0] > 0
        for mine in fsdp2[key]:  # about 1/2: a tensor of odd rows splits unevenly
            assert ddp[key][0] / 2 * 0.95 <= mine <= ddp[key][0] / 2 * 1.05, (key, ddp[key], fsdp2[key])
    start = record(pair / "fsdp2", "start")
    assert start["param_bytes"] == fsdp2["param_bytes"] and start["grad_bytes"] == [0, 0]


def test_fsdp2_checkpoint_converts_to_one_file_and_safetensors(pair):
    folder = pair / "fsdp2/checkpoints/step-16"
    ok(ddpjob(["ckpt", "convert", str(folder), "one.pt", "--to", "ddpjob"], pair))
    ok(ddpjob(["ckpt", "convert", str(folder), "one.safetensors", "--to", "safetensors"], pair))
    whole = dcp_folder.read_model(folder)
    assert_bitwise_equal(whole, torch.load(pair / "one.pt", weights_only=True)["model"])
    assert_bitwise_equal(whole, hf_safetensors.read(pair / "one.safetensors"))
    assert max_difference(whole, model_at(pair / "ddp", 16)) <= TOLERANCE


@pytest.mark.parametrize("first, then", [("ddp", "fsdp2"), ("fsdp2", "ddp")])
def test_a_checkpoint_of_one_strategy_resumes_under_the_other(pair, tmp_path, first, then):
    target = tmp_path / "runs/ddpjob/checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(pair / first / "checkpoints/step-8", target / "step-8")
    strategy = FSDP2 if then == "fsdp2" else DCP
    out = ok(launched([*JOB, *strategy], tmp_path))
    assert record(tmp_path / "runs/ddpjob", "start")["step"] == 8, out[-2000:]
    assert max_difference(model_at(tmp_path / "runs/ddpjob", 16), model_at(pair / first, 16)) <= TOLERANCE


def test_init_from_a_single_file_ddp_checkpoint_starts_fsdp2_as_it_starts_ddp(pair, tmp_path):
    ok(ddpjob(["ckpt", "convert", str(pair / "ddp/checkpoints/step-16"), "start.pt", "--to", "ddpjob"], tmp_path))
    short = ["--epochs", "1", "--max-steps", "4", "--log-every", "1000", "--init-from", "start.pt", *DCP]
    ok(launched([*short, "--run-dir", "ddp"], tmp_path))
    out = ok(launched([*short, "--strategy", "fsdp2", "--run-dir", "fsdp2"], tmp_path))
    assert record(tmp_path / "fsdp2", "start")["step"] == 0, out[-2000:]
    assert max_difference(model_at(tmp_path / "ddp", 4), model_at(tmp_path / "fsdp2", 4)) <= TOLERANCE


def test_fsdp2_resumed_at_another_world_size_continues_within_tolerance(tmp_path):
    job = [*FSDP2, *NO_DROPOUT, "--epochs", "2", "--log-every", "1000", "--save-every", "0"]
    job += ["--batch-size", "16", "--global-batch-size", "64"]  # the same steps at 2 (2 micro-batches) and at 1 (4)
    ok(launched([*job, "--max-steps", "14", "--run-dir", "whole"], tmp_path))
    ok(launched([*job, "--max-steps", "7", "--run-dir", "split"], tmp_path))
    out = ok(launched([*job, "--max-steps", "14", "--run-dir", "split"], tmp_path, nproc=1))
    assert "world size 2 -> 1 at step 7" in out
    assert max_difference(model_at(tmp_path / "whole", 14), model_at(tmp_path / "split", 14)) <= TOLERANCE


def test_fsdp2_stopped_by_sigterm_during_async_saves_exits_75_and_resumes_bitwise(tmp_path):
    job = ["launch", "--nproc-per-node", "2", *FSDP2, "--data", "tests.plugins.recording:digits(delay=0.01)"]
    job += ["--epochs", "1", "--max-steps", "20", "--log-every", "1", "--stop-check-every", "1"]
    job += ["--save-mode", "async", "--save-every", "3"]
    samples = {"TEST_SAMPLES_DIR": str(tmp_path)}
    ok(ddpjob([*job, "--run-dir", "whole"], tmp_path, timeout=300, **samples))
    split = tmp_path / "split"
    agent = spawn([*job, "--run-dir", "split"], tmp_path, **samples)
    wait_until(lambda: trained_steps(split) >= 5, 120, "training to start")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=180)[0]
    assert agent.returncode == 75, out[-3000:]
    stopped = record(split, "preempted")["step"]
    newest = catalogue.list_steps(split / "checkpoints")[0]
    assert stopped < 20 and newest[0] == stopped and dcp_folder.verify(newest[1]) is None
    ok(ddpjob([*job, "--run-dir", "split"], tmp_path, timeout=300, **samples))
    assert record(split, "start")["step"] == stopped
    assert_bitwise_equal(model_at(tmp_path / "whole", 20), model_at(split, 20))


def test_a_kill_mid_save_keeps_the_previous_fsdp2_checkpoint(tmp_path):
    slow = ["--model", "tests.plugins.slow_save:model(seconds=60, after=1)"]  # rank 0's second save stalls
    job = [*FSDP2, "--epochs", "1", "--max-steps", "20", "--save-every", "5", "--log-every", "1000"]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ddpjob", "train"]
    proc = subprocess.Popen([*cmd, *job, *slow], cwd=tmp_path, env=clean_env(), start_new_session=True)
    folder = tmp_path / "runs/ddpjob/checkpoints"
    try:
        wait_until(lambda: (folder / ".step-10.tmp").is_dir() and (folder / "step-5").is_dir(), 120, "the save")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert catalogue.latest_valid(folder) == folder / "step-5"
    out = ok(launched([*job, "--model", "tests.plugins.slow_save:model(seconds=0)"], tmp_path))
    assert "removed 1 leftover(s) of killed saves: .step-10.tmp" in out
    assert record(tmp_path / "runs/ddpjob", "start")["step"] == 5 and (folder / "step-20").is_dir()


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path):
    job = ["train", *FSDP2, "--epochs", "1", "--max-steps", "6", "--log-every", "1000"]
    ok(ddpjob([*job, "--run-dir", "plain"], tmp_path))
    ok(ddpjob([*job, "--activation-checkpointing", "--run-dir", "recomputed"], tmp_path))
    assert_bitwise_equal(model_at(tmp_path / "plain", 6), model_at(tmp_path / "recomputed", 6))


def test_shard_modules_and_activation_checkpointing_changed_on_resume_apply(tmp_path):
    """Their rows of the resume table (test_resume_rules walks the others): both apply on resume, and
    neither changes the numbers, so the resumed run equals the uninterrupted one bitwise."""
    job = ["train", *FSDP2, "--epochs", "1", "--save-every", "3", "--log-every", "1000"]
    ok(ddpjob([*job, "--max-steps", "6", "--run-dir", "whole"], tmp_path))
    ok(ddpjob([*job, "--max-steps", "3", "--run-dir", "split"], tmp_path))
    changed = ["--activation-checkpointing", "--shard-modules", "Linear"]
    ok(ddpjob([*job, "--max-steps", "6", "--run-dir", "split", *changed], tmp_path))
    assert record(tmp_path / "split", "start")["step"] == 3  # resumed, not refused
    saved = dcp_folder.read_extra(tmp_path / "split/checkpoints/step-6")["config"]
    assert saved["activation_checkpointing"] is True and saved["shard_modules"] == "Linear"
    assert_bitwise_equal(model_at(tmp_path / "whole", 6), model_at(tmp_path / "split", 6))


def test_a_model_without_blocks_is_sharded_whole_with_a_one_line_warning(tmp_path):
    out = ok(
        ddpjob(
            ["train", *FSDP2, "--model", "torch.nn:Linear(in_features=64, out_features=10)", "--max-steps", "3"],
            tmp_path,
        )
    )
    warnings = [ln for ln in out.splitlines() if "no blocks to shard" in ln]
    assert len(warnings) == 1 and "Linear" in warnings[0]


def test_shard_modules_by_class_name_or_plugin(tmp_path):
    for spec in ("Linear", "ddpjob.train.fsdp:default_blocks"):
        out = ok(ddpjob(["train", *FSDP2, "--shard-modules", spec, "--max-steps", "3", "--run-dir", spec], tmp_path))
        assert "done: step 3" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--strategy", "fsdp2"], "add --checkpoint-format dcp"),
        (["--shard-modules", "Linear"], "--shard-modules applies to --strategy fsdp2 only"),
        (["--activation-checkpointing"], "--activation-checkpointing applies to --strategy fsdp2 only"),
        ([*FSDP2, "--shard-modules", "Block"], "--shard-modules names Block, which the model has no module of"),
        ([*FSDP2, "--shard-modules", "nowhere.at_all:blocks"], "cannot import 'nowhere.at_all'"),
    ],
)
def test_bad_fsdp2_input_is_one_line_and_exit_2(tmp_path, args, words):
    proc = ddpjob(["train", *args, "--max-steps", "1"], tmp_path)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_single_file_checkpoint_is_refused_by_fsdp2_in_one_line(tmp_path):
    ok(ddpjob(["train", "--max-steps", "2", "--epochs", "1"], tmp_path))
    proc = ddpjob(["train", *FSDP2, "--max-steps", "4", "--epochs", "1"], tmp_path)
    assert proc.returncode == 2 and "is a single-file checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and final_params(tmp_path / "runs/ddpjob")


def test_a_hugging_face_model_starts_from_its_own_initialisation(tmp_path):
    job = ["train", *FSDP2, "--model", "examples.hf_tiny:tiny_gpt2", "--data", "examples.lm:stdlib_text"]
    ok(ddpjob([*job, "--max-steps", "1", "--batch-size", "2", "--lr", "1e-30"], tmp_path))  # weights as initialised
    weights = model_at(tmp_path / "runs/ddpjob", 1)
    assert weights["transformer.wte.weight"].std().item() == pytest.approx(0.02, rel=0.1)  # GPT-2's, not N(0, 1)
    assert torch.equal(weights["transformer.h.0.ln_1.weight"], torch.ones(64))


def test_evaluation_of_unevenly_split_validation_data_matches_ddp(tmp_path):
    """359 validation samples at batch 179: rank 0 has 2 batches, rank 1 one. Every fsdp2 forward
    is a collective, so rank 1 runs a spare batch in step, counted nowhere."""
    job = ["--epochs", "1", "--max-steps", "2", "--batch-size", "179", "--log-every", "1000", *DCP]
    ok(launched([*job, "--run-dir", "ddp"], tmp_path))
    ok(launched([*job, "--strategy", "fsdp2", "--eval-timeout", "60", "--run-dir", "fsdp2"], tmp_path, timeout=240))
    ddp, fsdp2 = record(tmp_path / "ddp", "final"), record(tmp_path / "fsdp2", "final")
    assert fsdp2["val_loss"] == pytest.approx(ddp["val_loss"], abs=TOLERANCE) and fsdp2["accuracy"] == ddp["accuracy"]


def first_loss(run_dir) -> float:
    return next(r["loss"] for r in records(run_dir) if r["event"] == "train")


LM_TEXT = "examples.lm:stdlib_text(block=32, max_bytes=200000)"
TINY_LM = ["--model", "examples.lm:tiny_lm(dim=32, layers=2, heads=2, block=32)", "--data", LM_TEXT]
HF_TINY = ["--model", "examples.hf_tiny:tiny_gpt2(dim=32, block=32)", "--data", LM_TEXT]


@pytest.mark.parametrize("model", [TINY_LM, HF_TINY], ids=["tiny_lm", "hf_tiny"])
def test_a_fresh_fsdp2_start_takes_the_factorys_initial_weights_as_ddp_does(tmp_path, model):
    """examples.lm initialises GPT-2's way in its __init__, beyond its modules' reset_parameters;
    Hugging Face in its own order: a fresh fsdp2 start has exactly the weights DDP starts from."""
    job = [*model, "--epochs", "1", "--max-steps", "1", "--batch-size", "8", "--log-every", "1", *DCP]
    ok(launched([*job, "--run-dir", "ddp"], tmp_path))
    ok(launched([*job, "--strategy", "fsdp2", "--run-dir", "fsdp2"], tmp_path))
    assert first_loss(tmp_path / "fsdp2") == pytest.approx(first_loss(tmp_path / "ddp"), abs=TOLERANCE)
    assert max_difference(model_at(tmp_path / "ddp", 1), model_at(tmp_path / "fsdp2", 1)) <= TOLERANCE


def test_buffers_reset_parameters_leaves_alone_come_from_the_model_as_built(tmp_path):
    """A mask buffer and a non-persistent gain that no reset_parameters sets: fresh, they are the
    factory's (as under DDP); resumed, the gain outside the checkpoint is still the factory's."""
    job = ["--model", "tests.plugins.masked:model", "--epochs", "1", "--log-every", "1", "--save-every", "2"]
    ok(launched([*job, *DCP, "--max-steps", "4", "--run-dir", "ddp"], tmp_path))
    ok(launched([*job, *FSDP2, "--max-steps", "4", "--run-dir", "whole"], tmp_path))
    ok(launched([*job, *FSDP2, "--max-steps", "2", "--run-dir", "split"], tmp_path))
    ok(launched([*job, *FSDP2, "--max-steps", "4", "--run-dir", "split"], tmp_path))
    assert first_loss(tmp_path / "whole") == pytest.approx(first_loss(tmp_path / "ddp"), abs=TOLERANCE)
    assert max_difference(model_at(tmp_path / "ddp", 4), model_at(tmp_path / "whole", 4)) <= TOLERANCE
    assert_bitwise_equal(model_at(tmp_path / "whole", 4), model_at(tmp_path / "split", 4))


def test_an_empty_validation_share_at_world_3_evaluates_in_step(tmp_path):
    """The validation stream is 2 files: at world 3 rank 2 has none, yet joins every forward."""
    write_shards(tmp_path / "shards", [40, 40, 40, 40])
    job = ["--data", "tests.plugins.shards:sharded(val_stream=True)", "--epochs", "1", "--max-steps", "2", *DCP]
    ok(launched([*job, "--run-dir", "ddp"], tmp_path, nproc=3))
    out = ok(launched([*job, "--strategy", "fsdp2", "--run-dir", "fsdp2"], tmp_path, nproc=3, timeout=240))
    assert "Traceback" not in out
    ddp, fsdp2 = record(tmp_path / "ddp", "final"), record(tmp_path / "fsdp2", "final")
    assert fsdp2["val_loss"] == pytest.approx(ddp["val_loss"], abs=TOLERANCE) and fsdp2["accuracy"] == ddp["accuracy"]


def test_a_tied_weight_split_across_shard_groups_is_one_line_and_exit_2(tmp_path):
    args = ["train", *FSDP2, *TINY_LM, "--shard-modules", "Embedding,Block", "--max-steps", "1"]
    proc = ddpjob(args, tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "tokens" in proc.stderr and "head" in proc.stderr and "--shard-modules" in proc.stderr


def test_accumulated_micro_batches_reduce_scatter_once_per_optimizer_step(tmp_path):
    job = [*FSDP2, "--model", "tests.plugins.reduce_scatters:model", "--epochs", "1", "--max-steps", "3"]
    counts = {}
    for accum in (1, 2):
        (tmp_path / str(accum)).mkdir()
        ok(launched([*job, "--grad-accum", str(accum), "--run-dir", "run"], tmp_path / str(accum)))
        counts[accum] = [int((tmp_path / str(accum) / f"reduce-scatters-{r}").read_text()) for r in (0, 1)]
    assert counts[1][0] > 0 and counts[2] == counts[1], counts


def test_fsdp2_with_weight_decay_trains_as_ddp_does(tmp_path):
    job = ["--epochs", "1", "--max-steps", "4", "--save-every", "4", "--grad-accum", "2", "--weight-decay", "0.1"]
    ok(launched([*job, *DCP, "--run-dir", "ddp"], tmp_path))
    ok(launched([*job, *FSDP2, "--run-dir", "fsdp2"], tmp_path))
    assert max_difference(model_at(tmp_path / "ddp", 4), model_at(tmp_path / "fsdp2", 4)) <= TOLERANCE
