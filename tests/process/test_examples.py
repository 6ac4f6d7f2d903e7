"""The examples of "any training job": a language model on the standard library's sources, a
Hugging Face model from a config, a regression with its own loss. (The tutorial with its SGD
settings: tests/test_any_job.py.)"""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path

import pytest
import torch

from ddpjob.checkpoint import catalogue
from helpers import (
    REPO,
    assert_bitwise_equal,
    ddpjob,
    final_params,
    launched,
    ok,
    records,
    spawn,
    trained_steps,
    wait_until,
)

sys.path.insert(0, str(REPO))
from examples import lm, regression

# A small LM and corpus, so that a run takes seconds: used where the figure does not matter.
SMALL_LM = "examples.lm:tiny_lm(dim=32, layers=1, heads=2, block=32, dropout=0.1)"
SMALL_TEXT = "examples.lm:stdlib_text(block=32, max_bytes=200_000)"


def finals(run_dir: Path) -> dict:
    return next(r for r in reversed(records(run_dir)) if r["event"] == "final")


# Measured on 2 CPU processes (contended machine): see README "Language models".
LM_TEST_RUN = [
    "--model",
    "examples.lm:tiny_lm(dim=64, layers=2, heads=2, block=64)",
    "--data",
    "examples.lm:stdlib_text(block=64, max_bytes=500_000)",
    "--batch-size",
    "16",
    "--epochs",
    "1",
    "--max-steps",
    "120",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "10",
    "--log-every",
    "20",
    "--save-every",
    "0",
]


@pytest.mark.slow
def test_lm_learns_the_held_out_text_beyond_byte_frequencies(work):
    """A short run; the full `make run-lm` reaches the README's figure."""
    ok(launched(LM_TEST_RUN, work, timeout=600))
    final = finals(work / "runs/ddpjob")
    print(f"\nshort LM run: held-out loss {final['val_loss']:.3f} nats/byte")
    # Byte frequencies alone (the train split's, on the held-out text): 2.92 nats; uniform: ln 256 = 5.55.
    assert final["val_loss"] < 2.6, final


@pytest.mark.slow
def test_lm_stopped_by_sigterm_resumes_to_the_same_parameters_bitwise(work, tmp_path_factory):
    job = [
        "--model",
        SMALL_LM,
        "--data",
        SMALL_TEXT,
        "--batch-size",
        "8",
        "--max-steps",
        "60",
        "--log-every",
        "2",
        "--save-every",
        "0",
        "--stop-check-every",
        "1",
    ]
    whole = tmp_path_factory.mktemp("whole")
    ok(ddpjob(["launch", "--nproc-per-node", "2", *job], whole, timeout=600))

    run_dir = work / "runs/ddpjob"
    agent = spawn(["launch", "--nproc-per-node", "2", *job], work)
    wait_until(lambda: trained_steps(run_dir) >= 10, 300, "training to start")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=300)[0]
    assert agent.returncode == 75, out[-3000:]
    (stop,) = [r for r in records(run_dir) if r["event"] == "preempted"]
    assert 10 <= stop["step"] < 60

    ok(ddpjob(["launch", "--nproc-per-node", "2", *job], work, timeout=600))
    assert [r for r in records(run_dir) if r["event"] == "start"][-1]["step"] == stop["step"]
    assert_bitwise_equal(final_params(whole / "runs/ddpjob"), final_params(run_dir))


@pytest.mark.slow
def test_hf_gpt2_trains_on_its_own_loss_and_reloads_in_transformers_from_safetensors(work):
    transformers = pytest.importorskip("transformers")
    from examples.hf_tiny import config
    from safetensors.torch import load_file

    text = "examples.lm:stdlib_text(block=32, max_bytes=200_000)"
    model = "examples.hf_tiny:tiny_gpt2(block=32)"
    ok(ddpjob(["train", "--model", model, "--data", text, "--max-steps", "40", "--batch-size", "16"], work))
    run_dir = work / "runs/ddpjob"
    final = finals(run_dir)
    assert final["val_loss"] < 4.0, final  # it learned: an untrained model is at about ln 256 = 5.55
    assert final["perplexity"] == pytest.approx(math.exp(final["val_loss"]))

    export = work / "gpt2"
    newest = catalogue.list_steps(run_dir / "checkpoints")[0][1]
    ok(ddpjob(["ckpt", "convert", str(newest), str(export / "model.safetensors"), "--to", "safetensors"], work))
    config(block=32).save_pretrained(export)

    loaded = transformers.GPT2LMHeadModel.from_pretrained(export).eval()
    by_hand = transformers.GPT2LMHeadModel(config(block=32)).eval()
    missing, unexpected = by_hand.load_state_dict(load_file(str(export / "model.safetensors")), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding: stored once
    trained = transformers.GPT2LMHeadModel(config(block=32)).eval()
    trained.load_state_dict(final_params(run_dir))
    _, val = lm.stdlib_text(block=32, max_bytes=200_000)
    ids = torch.stack([val[i]["input_ids"] for i in range(8)])
    weights = trained.state_dict()
    for model in (loaded, by_hand):  # the very weights, bitwise
        assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
    with torch.no_grad():
        logits = trained(ids).logits
        for model in (loaded, by_hand):  # from_pretrained may pick another attention kernel: float order only
            torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
        assert loaded(ids, labels=ids).loss.item() < 4.0


@pytest.mark.slow
def test_regression_trains_with_its_user_loss_and_logs_the_extra_metric(work):
    args = ["--model", "examples.regression:model", "--data", "examples.regression:data"]
    ok(ddpjob(["train", *args, "--loss", "examples.regression:mse_loss", "--epochs", "8", "--log-every", "50"], work))
    run = records(work / "runs/ddpjob")
    first, final = next(r for r in run if r["event"] == "eval"), finals(work / "runs/ddpjob")
    print(f"\nregression: val mse {first['val_loss']:.4f} -> {final['val_loss']:.4f}, mae {final['mae']:.4f}")
    target = regression.data()[1].tensors[1]
    assert final["val_loss"] < 0.1 * target.var().item() and final["val_loss"] < first["val_loss"]
    assert final["mae"] < 0.3 * (target - target.mean()).abs().mean().item()  # predicting the mean: 0.60
    assert "accuracy" not in final and all("mae" in r for r in run if r["event"] == "train")
