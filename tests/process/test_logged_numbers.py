"""The numbers ddpjob logs are the right ones: ``val_loss`` weighs each validation batch by the labels
it counts (a batch of only ignored labels adds nothing, and a pass with none is one line, exit 2);
with ``--grad-accum`` a step's logged loss and extras are its mean over its micro-batches."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpjob.distenv import DistEnv
from ddpjob.errors import UsageError
from ddpjob.train.evaluation import evaluate
from ddpjob.train.losses import IGNORE_INDEX, Loss
from helpers import ddpjob, launched, records
from plugins import anyjob

SINGLE = DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
CPU = torch.device("cpu")


def test_a_validation_batch_of_only_ignored_labels_adds_nothing_to_val_loss_and_accuracy():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(8, 4)
    y = torch.tensor([1, 2, 0, IGNORE_INDEX, *[IGNORE_INDEX] * 4])  # the second batch of 4: nothing counted
    scores = evaluate(model, TensorDataset(x, y), Loss(), SINGLE, CPU, batch_size=4)
    with torch.no_grad():
        logits = model(x)
        expected = nn.functional.cross_entropy(logits, y).item()  # the mean over the 3 counted labels
    assert scores["val_loss"] == pytest.approx(expected)
    assert scores["accuracy"] == pytest.approx((logits[:3].argmax(1) == y[:3]).float().mean().item())


def test_a_token_batch_with_no_predicted_tokens_adds_nothing_to_the_models_own_loss():
    torch.manual_seed(0)
    model = anyjob.tiny_lm("dict")
    data = anyjob.Tokens(4, 6, 0)
    labels = data.ids.clone()
    labels[2:, 1:] = IGNORE_INDEX  # sequences 2 and 3 (the second batch of 2) predict no token

    class Masked(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": data.ids[i], "labels": labels[i]}

    scores = evaluate(model, Masked(), Loss(), SINGLE, CPU, batch_size=2)
    with torch.no_grad():  # one batch of all four: the model's mean over every predicted token
        expected = model(input_ids=data.ids, labels=labels)["loss"].item()
    assert math.isfinite(scores["val_loss"]) and scores["val_loss"] == pytest.approx(expected)
    assert scores["perplexity"] == pytest.approx(math.exp(expected))


def test_a_validation_pass_with_no_counted_label_on_any_rank_is_one_line_naming_the_labels():
    with pytest.raises(UsageError, match="-100"):
        evaluate(nn.Linear(4, 3), TensorDataset(torch.randn(4, 4), torch.full((4,), -100)), Loss(), SINGLE, CPU, 2)


def test_a_job_whose_validation_labels_are_all_ignored_stops_with_one_line_and_exit_2(work):
    P = "tests.plugins.numeric_jobs"
    args = ["train", "--model", f"{P}:classifier", "--data", f"{P}:unlabelled_val", "--batch-size", "16"]
    proc = ddpjob([*args, "--epochs", "1"], work)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "-100" in proc.stderr.strip().splitlines()[-1]


def test_with_grad_accum_the_logged_loss_and_extras_are_the_steps_mean_over_micro_batches(work):
    """World 2, the same global batch of 32 two ways: 2 micro-batches of 8 per rank, or 1 of 16. Rank 0
    trains on the same 16 samples per step either way (train/sampling.py's layout), so the logged loss (rank
    0's, as without accumulation) and the user loss's extra must agree within float tolerance."""
    job = ["--model", "tests.plugins.anyjob:regressor", "--data", "tests.plugins.anyjob:nested"]
    job += ["--loss", "tests.plugins.anyjob:mse_and_mae", "--max-steps", "3", "--log-every", "1", "--save-every", "0"]
    logged = {}
    for accum, batch in ((2, 8), (1, 16)):
        run = f"accum{accum}"
        proc = launched([*job, "--run-dir", run, "--grad-accum", str(accum), "--batch-size", str(batch)], work)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logged[accum] = {r["step"]: r for r in records(work / run) if r["event"] == "train"}
    assert sorted(logged[2]) == sorted(logged[1]) == [1, 2, 3]
    for step in (1, 2, 3):
        for name in ("loss", "mae"):
            assert logged[2][step][name] == pytest.approx(logged[1][step][name], rel=1e-5), (step, name)


def test_val_loss_weighs_each_batch_by_the_labels_it_counts_not_by_its_samples():
    """Batches of 4 samples counting 4, 1 and 0 labels (classifier), 10, 3 and 0 predicted tokens (token
    model): val_loss is the mean over every counted label, which weighing by samples would not give."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(12, 4)
    y = torch.tensor([1, 2, 0, 1, 2, *[IGNORE_INDEX] * 7])
    scores = evaluate(model, TensorDataset(x, y), Loss(), SINGLE, CPU, batch_size=4)
    with torch.no_grad():
        assert scores["val_loss"] == pytest.approx(nn.functional.cross_entropy(model(x), y).item())

    lm, data = anyjob.tiny_lm("dict"), anyjob.Tokens(6, 6, 0)
    labels = data.ids.clone()
    labels[2, 4:] = labels[3, 1:] = labels[4:, 1:] = IGNORE_INDEX  # batches of 2: 10, 3 and 0 tokens predicted

    class Masked(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"input_ids": data.ids[i], "labels": labels[i]}

    scores = evaluate(lm, Masked(), Loss(), SINGLE, CPU, batch_size=2)
    with torch.no_grad():
        expected = lm(input_ids=data.ids, labels=labels)["loss"].item()
    assert scores["val_loss"] == pytest.approx(expected)


def test_a_user_loss_on_a_validation_batch_of_only_ignored_labels_adds_nothing():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.tensor([1, 2, 0, 1, *[IGNORE_INDEX] * 4])
    user = Loss("tests.plugins.numeric_jobs:cross_entropy")
    scores = evaluate(model, TensorDataset(x, y), user, SINGLE, CPU, batch_size=4)
    with torch.no_grad():
        assert scores["val_loss"] == pytest.approx(nn.functional.cross_entropy(model(x[:4]), y[:4]).item())


def test_a_user_loss_may_log_an_extra_named_samples():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(6, 4), torch.tensor([1, 2, 0, 1, 2, 0]))
    user = Loss("tests.plugins.numeric_jobs:with_samples_extra")
    scores = evaluate(nn.Linear(4, 3), data, user, SINGLE, CPU, batch_size=4)  # batches of 4 and 2
    assert scores["samples"] == pytest.approx((4 * 4 + 2 * 2) / 6)
