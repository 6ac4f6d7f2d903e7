"""Jobs of any shape as real training processes: the model's own loss on dict and tensor batches, a user
loss with extras on nested batches, each optimizer and schedule, gradient clipping, --compile, and
bitwise resume at world size 1 and 2 on these paths."""

import math

import pytest
import torch

from ddpjob.checkpoint import catalogue
from ddpjob.train.setup import build
from helpers import ddpjob, final_checkpoint, final_params, launched, lr_by_step, ok, records

pytestmark = pytest.mark.slow

P = "tests.plugins.anyjob"
LM = ["--model", f"{P}:tiny_lm", "--data", f"{P}:tokens"]
REGRESSION = ["--model", f"{P}:regressor", "--data", f"{P}:nested", "--loss", f"{P}:mse_and_mae"]


def of(work, event, run="runs/ddpjob"):
    return [r for r in records(work / run) if r["event"] == event]


@pytest.mark.parametrize(
    "model, data",
    [
        ("tiny_lm(returns='scalar')", "tokens"),
        ("tiny_lm(returns='dict')", "tokens"),
        ("tiny_lm(returns='object')", "tokens"),
        ("autoencoder", "vectors"),
    ],
)
def test_a_model_returning_its_own_loss_trains_on_dict_and_tensor_batches(work, model, data):
    ok(ddpjob(["train", "--model", f"{P}:{model}", "--data", f"{P}:{data}", "--epochs", "3", "--log-every", "4"], work))
    evals = of(work, "eval")
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert "accuracy" not in evals[-1]
    if data == "tokens":  # a dict batch with integer labels: a token model
        assert evals[-1]["bits_per_token"] == pytest.approx(evals[-1]["val_loss"] / math.log(2))
        assert evals[-1]["perplexity"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    else:
        assert "perplexity" not in evals[-1]


def test_a_user_loss_on_nested_batches_logs_its_extras_in_training_and_evaluation(work):
    ok(
        ddpjob(
            [
                "train",
                *REGRESSION[:-1],
                f"{P}:mse_and_mae(scale=0.5)",
                "--lr",
                "0.05",
                "--epochs",
                "3",
                "--log-every",
                "4",
            ],
            work,
        )
    )
    train, evals = of(work, "train"), of(work, "eval")
    assert all(r["scale"] == 0.5 and r["mae"] > 0 for r in train + evals)
    assert train[-1]["mae"] < train[0]["mae"] and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert "accuracy" not in evals[-1] and "perplexity" not in evals[-1]


def expected_lr(name: str, lr: float, step: int, total: int) -> float:
    """The LR optimizer step ``step`` (from 1) must use, for the settings of the cases below."""
    s = step - 1
    if name == "sgd":  # linear, warm-up 3, to 0.01
        return lr * (s + 1) / 4 if s < 3 else 0.01 + (lr - 0.01) * (1 - (s - 3) / (total - 3))
    if name == "adam":  # constant, warm-up 2
        return lr * (s + 1) / 3 if s < 2 else lr
    if name == "adamw":  # cosine to 0.001, no warm-up
        return 0.001 + (lr - 0.001) * 0.5 * (1 + math.cos(math.pi * s / total))
    return lr * (1.0 if s < 0.25 * total else 0.1)  # the plug-in schedule


OPTIMIZER_GROUPS = {  # per case below: the state each parameter gets, and each group's settings
    "sgd": ("momentum_buffer", [{"momentum": 0.9, "nesterov": True, "weight_decay": 0.0, "params": [0, 1]}]),
    "adam": ("exp_avg", [{"betas": (0.8, 0.99), "weight_decay": 0.0, "params": [0, 1]}]),
    "adamw": (  # the regressor's linear layer: decay on its weight, none on its bias
        "exp_avg",
        [
            {"betas": (0.9, 0.999), "weight_decay": 0.1, "params": [0]},
            {"betas": (0.9, 0.999), "weight_decay": 0.0, "params": [1]},
        ],
    ),
    "factory": ("momentum_buffer", [{"momentum": 0.9, "nesterov": False, "params": [0, 1]}]),
}


@pytest.mark.parametrize(
    "name, flags",
    [
        (
            "sgd",
            [
                "--optimizer",
                "sgd",
                "--momentum",
                "0.9",
                "--nesterov",
                "--schedule",
                "linear",
                "--warmup-steps",
                "3",
                "--min-lr",
                "0.01",
            ],
        ),
        ("adam", ["--optimizer", "adam", "--betas", "0.8,0.99", "--schedule", "constant", "--warmup-steps", "2"]),
        ("adamw", ["--optimizer", "adamw", "--weight-decay", "0.1", "--min-lr", "0.001"]),
        ("factory", ["--optimizer", f"{P}:sgd_factory(lr=0.05)", "--schedule", f"{P}:step_down(at=0.25)"]),
    ],
)
def test_each_optimizer_and_schedule_trains_with_the_lr_of_its_step(work, name, flags):
    ok(ddpjob(["train", *REGRESSION, *flags, "--lr", "0.05", "--epochs", "2", "--log-every", "1"], work))
    saved = final_checkpoint(work / "runs/ddpjob")["optimizer"]
    kind, groups = OPTIMIZER_GROUPS[name]
    assert [{k: g[k] for k in groups[0]} for g in saved["param_groups"]] == groups
    assert all(kind in state for state in saved["state"].values()) and len(saved["state"]) == 2
    lrs, total = lr_by_step(work / "runs/ddpjob"), 16  # 256 samples / 32 per step x 2 epochs
    assert sorted(lrs) == list(range(1, total + 1))
    for step, lr in lrs.items():
        assert lr == pytest.approx(expected_lr(name, 0.05, step, total), rel=1e-9), (step, lr)
    evals = of(work, "eval")
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] * 1.05  # trained, not diverged


def test_gradients_are_clipped_to_the_max_norm_and_their_norm_logged(work):
    flags = ["--optimizer", "sgd", "--lr", "1", "--schedule", "constant", "--max-steps", "1", "--log-every", "1"]
    ok(ddpjob(["train", *REGRESSION, *flags, "--grad-clip", "0.001"], work))
    grad_norm = of(work, "train")[0]["grad_norm"]
    before, after = build(f"{P}:regressor", 0, None, "").state_dict(), final_params(work / "runs/ddpjob")
    moved = torch.cat([(after[k] - before[k]).flatten() for k in before]).norm().item()
    assert grad_norm > 0.1  # the gradient before clipping
    assert moved == pytest.approx(0.001, rel=1e-4)  # one SGD step of lr 1 with the clipped gradient


JOBS = {
    "lm": [*LM, "--weight-decay", "0.1", "--warmup-steps", "3", "--grad-clip", "1.0"],
    "regression": [
        *REGRESSION,
        "--optimizer",
        "sgd",
        "--lr",
        "0.02",
        "--momentum",
        "0.9",
        "--nesterov",
        "--schedule",
        "linear",
        "--grad-clip",
        "5",
    ],
    # Hugging Face: dict batches as keyword arguments, the ModelOutput's loss, dropout; plug-in optimizer and schedule
    "factory": [
        *("--model", "examples.hf_tiny:tiny_gpt2(vocab=16, dim=16, layers=1, heads=2, block=8)"),
        *("--data", f"{P}:tokens", "--optimizer", f"{P}:sgd_factory(lr=0.05)", "--schedule", f"{P}:step_down(at=0.2)"),
    ],
    # the default model, data and loss: digits, an MLP with dropout, cross-entropy; Adam's moments, a constant
    # LR after a warm-up that the split falls in, clipping
    "classifier": [
        *("--optimizer", "adam", "--betas", "0.8,0.99", "--schedule", "constant", "--warmup-steps", "8"),
        *("--grad-clip", "0.5"),
    ],
}


SAVES = {"file": [], "dcp-async": ["--checkpoint-format", "dcp", "--save-mode", "async"]}


@pytest.mark.parametrize(
    "job, world, saves",
    [
        ("lm", 1, "file"),
        ("lm", 2, "file"),
        ("regression", 1, "file"),
        ("regression", 2, "file"),
        ("lm", 2, "dcp-async"),
        ("factory", 1, "file"),
        ("factory", 2, "file"),
        ("classifier", 1, "file"),
        ("classifier", 2, "file"),
    ],
)
def test_resume_is_bitwise_equal_to_an_uninterrupted_run_on_any_job(work, job, world, saves):
    """Two launches: the uninterrupted run, which also saves at step 5 (mid-epoch at either world size), and
    a run resumed from that checkpoint in another run directory; both to the same step."""
    args = [*JOBS[job], *SAVES[saves], "--epochs", "3", "--batch-size", "16", "--grad-accum", "2", "--log-every", "1"]
    total = 3 * 256 // (32 * world)

    def run(run_dir, *flags):
        flags = [*args, "--run-dir", run_dir, "--max-steps", str(total), *flags]
        return ok(ddpjob(["train", *flags], work) if world == 1 else launched(flags, work))

    run("whole", "--save-every", "5", "--keep", "10")
    step_5 = dict(catalogue.list_steps(work / "whole/checkpoints"))[5]
    run("split", "--save-every", "0", "--resume", str(step_5))
    assert [r["step"] for r in of(work, "start", "split")] == [5]
    fingerprints = [of(work, "final", run)[-1]["params"] for run in ("whole", "split")]  # sha256 of the weights
    assert fingerprints[0] == fingerprints[1]
    whole = {r["step"]: r["loss"] for r in of(work, "train", "whole") if r["step"] > 5}
    split = {r["step"]: r["loss"] for r in of(work, "train", "split")}
    assert sorted(split) == list(range(6, total + 1)) and whole == split


def test_compile_matches_eager_within_tolerance_and_saves_plain_keys(work):
    args = [*LM, "--grad-accum", "2", "--batch-size", "16", "--max-steps", "6", "--log-every", "1"]
    ok(launched([*args, "--run-dir", "eager"], work))  # 2 ranks: DDP's buckets, no_sync on the first micro-batch
    cache = work / "inductor-cache"  # proof that --compile compiled: inductor wrote kernels here
    ok(launched([*args, "--run-dir", "compiled", "--compile"], work, timeout=600, TORCHINDUCTOR_CACHE_DIR=str(cache)))
    assert any(path.is_file() for path in cache.rglob("*"))
    eager, compiled = final_params(work / "eager"), final_params(work / "compiled")
    assert compiled.keys() == eager.keys()  # no _orig_mod. or module. prefixes
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5)
    assert not torch.equal(eager["head.weight"], build(f"{P}:tiny_lm", 0, None, "").state_dict()["head.weight"])


def test_the_tutorial_runs_with_its_own_sgd_settings(work):
    tutorial = ["--model", "examples.tutorial:model", "--data", "examples.tutorial:data"]
    out = ok(launched([*tutorial, "--optimizer", "sgd", "--lr", "1e-3", "--epochs", "2", "--log-every", "5"], work))
    assert "done:" in out
    optimizer = final_checkpoint(work / "runs/ddpjob")["optimizer"]  # SGD's settings, no Adam moments
    assert all(g["momentum"] == 0 and "betas" not in g for g in optimizer["param_groups"])
    assert not any("exp_avg" in state for state in optimizer["state"].values())
    lrs = lr_by_step(work / "runs/ddpjob")
    assert max(lrs.values()) <= 1e-3 and lrs[5] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 30)))


def test_a_model_with_unused_parameters_names_the_flag_and_trains_with_it(work):
    args = ["train", "--model", f"{P}:partly_used", "--data", f"{P}:vectors", "--max-steps", "3"]
    failed = ddpjob(args, work)
    assert failed.returncode == 2, failed.stderr[-2000:]
    error = failed.stderr.strip().splitlines()[-1]
    assert "--find-unused-parameters" in error and "Traceback" not in failed.stderr
    ok(ddpjob([*args, "--find-unused-parameters", "--run-dir", "with-flag"], work))


def test_resuming_with_another_optimizer_setup_is_one_line_naming_both(work):
    ok(ddpjob(["train", *REGRESSION, "--weight-decay", "0.1", "--max-steps", "2"], work))
    failed = ddpjob(["train", *REGRESSION, "--optimizer", "sgd", "--max-steps", "4"], work)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    error = failed.stderr.strip().splitlines()[-1]
    assert "--optimizer 'sgd' differs from 'adamw'" in error and "--resume never" in error  # config.check_resume
    failed = ddpjob(["train", *REGRESSION, "--weight-decay", "0", "--max-steps", "4"], work)  # one group, not two
    error = failed.stderr.strip().splitlines()[-1]
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert "adamw with 2 parameter group(s)" in error and "adamw with 1" in error and "--resume never" in error
    resumed = ddpjob(["train", *REGRESSION, "--weight-decay", "0.2", "--max-steps", "4"], work)  # same layout
    ok(resumed)
    assert [g["weight_decay"] for g in final_checkpoint(work / "runs/ddpjob")["optimizer"]["param_groups"]] == [
        0.2,
        0.0,
    ]
