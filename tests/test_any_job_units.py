"""The task-dependent parts of the loop, in-process: batches, losses, optimizers and schedules."""

import math
from collections import namedtuple

import pytest
import torch
from torch import nn

from ddpjob import batches, config, optim, plot
from ddpjob.distenv import DistEnv
from ddpjob.errors import UsageError
from ddpjob.evaluation import evaluate, token_count
from ddpjob.losses import Loss
from ddpjob.schedule import Schedule
from plugins import anyjob

Pair = namedtuple("Pair", "a b")


def test_to_device_keeps_every_structure_and_passes_non_tensor_leaves():
    batch = {"x": torch.ones(2), "inner": [torch.zeros(1), ("id-1", 7)], "pair": Pair(torch.ones(1), "s")}
    moved = batches.to_device(batch, torch.device("meta"))
    assert moved["x"].is_meta and moved["inner"][0].is_meta
    assert isinstance(moved["inner"], list) and moved["inner"][1] == ("id-1", 7)
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.is_meta and moved["pair"].b == "s"


def test_forward_passes_dicts_as_keywords_tuples_first_element_and_tensors_whole():
    seen = []

    class Probe(nn.Module):
        def forward(self, *args, **kwargs):
            seen.append((len(args), sorted(kwargs)))
            return torch.zeros(())

    probe, x = Probe(), torch.ones(3, 2)
    batches.forward(probe, {"input_ids": x, "labels": x})
    batches.forward(probe, (x, torch.zeros(3)))
    batches.forward(probe, x)
    assert seen == [(0, ["input_ids", "labels"]), (1, []), (1, [])]
    assert batches.size(({"name": ["a", "b", "c"], "x": x}, torch.zeros(3))) == 3


@pytest.mark.parametrize("returns", ["scalar", "dict", "object"])
def test_a_model_own_loss_is_used_as_is(returns):
    batch = anyjob.tokens(samples=4)[0][0]
    batch = {k: v[None] for k, v in batch.items()}
    model = anyjob.tiny_lm(returns)
    result = Loss()(batches.forward(model, batch), batch)
    reference = anyjob.tiny_lm("dict")
    reference.load_state_dict(model.state_dict())
    assert result.kind == "model"
    assert torch.equal(result.value, reference(**batch)["loss"])


def test_cross_entropy_on_labels_when_the_model_returns_logits_or_a_dict_with_logits():
    logits, label = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    expected = nn.functional.cross_entropy(logits, label)
    for output in (logits, {"logits": logits}, anyjob.Output(logits)):
        result = Loss()(output, (torch.zeros(5, 2), label))
        assert result.kind == "cross_entropy" and torch.equal(result.value, expected)


def test_a_user_loss_may_return_extras_that_become_floats_or_detached_tensors():
    output, batch = torch.tensor([1.0, 3.0], requires_grad=True), (None, torch.tensor([0.0, 0.0]))
    result = Loss("tests.plugins.anyjob:mse_and_mae(scale=2.0)")(output, batch)
    assert result.kind == "user" and result.value.item() == 10.0
    assert result.extras["mae"].item() == 2.0 and not result.extras["mae"].requires_grad
    assert result.extras["scale"] == 2.0


@pytest.mark.parametrize(
    "spec, output, batch, words",
    [
        ("auto", {"logits": torch.zeros(2, 3)}, {"input_ids": torch.zeros(2)}, ["returned no loss", "no labels"]),
        ("auto", anyjob.Output(torch.zeros(2, 3)), torch.zeros(2, 3), ["returned no loss", "--loss MODULE:CALLABLE"]),
        ("auto", {"loss": torch.ones(4)}, None, ["output['loss']", "shape [4]", "not a scalar", ".mean()"]),
        ("tests.plugins.anyjob:per_sample", torch.zeros(4), (None, torch.ones(4)), ["per_sample", "not a scalar"]),
        ("tests.plugins.anyjob:plain_number", torch.zeros(1), (None, torch.ones(1)), ["float", "not a scalar tensor"]),
    ],
)
def test_a_loss_that_is_not_a_scalar_or_missing_is_one_usage_error(spec, output, batch, words):
    with pytest.raises(UsageError) as caught:
        Loss(spec)(output, batch)
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_token_count_is_the_predicted_labels_that_are_not_ignored():
    assert token_count({"labels": torch.tensor([[1, -100, 3, 4], [-100, 1, 2, -100]])}).item() == 4
    assert token_count({"labels": torch.tensor([[0.5, 1.0]])}) is None and token_count((1, 2)) is None
    assert token_count({"labels": torch.tensor([1, 2])}) is None  # one label per sample: not a token model


def cfg(**overrides) -> config.Config:
    c = config.Config(**overrides)
    config.validate(c)
    return c


def test_weight_decay_skips_biases_and_norm_weights():
    model = anyjob.tiny_lm()
    optimizer = optim.build_optimizer(cfg(weight_decay=0.1), model)
    decayed, kept = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decayed["params"]) == ["embed.weight", "head.weight"]
    assert sorted(names[id(p)] for p in kept["params"]) == ["head.bias", "norm.bias", "norm.weight"]


@pytest.mark.parametrize(
    "name, kind, settings",
    [
        ("adamw", torch.optim.AdamW, {"betas": (0.8, 0.95)}),
        ("adam", torch.optim.Adam, {"betas": (0.8, 0.95)}),
        ("sgd", torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    ],
)
def test_built_in_optimizers_take_their_flags_and_the_fused_kernels(name, kind, settings):
    c = cfg(optimizer=name, betas="0.8,0.95", momentum=0.9, nesterov=name == "sgd", lr=0.01)
    optimizer = optim.build_optimizer(c, anyjob.tiny_lm())
    assert type(optimizer) is kind and optimizer.defaults["fused"] is True
    assert optimizer.defaults["lr"] == 0.01
    assert all(optimizer.defaults[key] == value for key, value in settings.items())


def test_an_optimizer_factory_gets_the_model_and_must_return_an_optimizer():
    model = anyjob.tiny_lm()
    built = optim.build_optimizer(cfg(optimizer="tests.plugins.anyjob:sgd_factory(lr=0.5)"), model)
    assert isinstance(built, torch.optim.SGD) and built.defaults["lr"] == 0.5
    with pytest.raises(UsageError, match=r"returned a list, not a torch\.optim\.Optimizer"):
        optim.build_optimizer(cfg(optimizer="tests.plugins.anyjob:not_an_optimizer"), model)


def lrs(kind, steps=10, **kwargs) -> list[float]:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = Schedule(optimizer, steps, kind, **kwargs)
    out = []
    for step in range(steps + 1):
        schedule.set(step)
        out.append(schedule.lr)
    return out


def test_schedules_warm_up_linearly_then_decay_to_the_minimum():
    assert lrs("constant", warmup=3)[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    linear = lrs("linear", warmup=2, min_lr=0.1)
    assert linear[:3] == pytest.approx([1 / 3, 2 / 3, 1.0]) and linear[-1] == pytest.approx(0.1)
    assert linear[6] == pytest.approx(0.1 + 0.9 * (1 - 4 / 8))
    cosine = lrs("cosine", min_lr=0.2)
    assert cosine[0] == 1.0 and cosine[5] == pytest.approx(0.6) and cosine[-1] == pytest.approx(0.2)
    assert lrs("cosine")[3] == 0.5 * (1 + math.cos(math.pi * 3 / 10))  # today's cosine, to the bit


def test_a_schedule_factory_is_a_function_of_the_step_and_must_give_numbers():
    assert lrs(anyjob.step_down, steps=4) == [1.0, 1.0, 0.1, 0.1, 0.1]
    with pytest.raises(UsageError, match="returned None for step 0, not a finite number"):
        lrs(lambda step, total: None, source="--schedule m:f")


def test_evaluation_weighs_a_token_model_by_its_counted_tokens_and_a_classifier_by_samples():
    torch.manual_seed(0)
    labels = torch.randint(0, anyjob.VOCAB, (6, 8))
    labels[0, 2:] = labels[3, 4:] = -100  # padding: batches of 2 predict 8, 14 and 10 counted targets
    val = [{"input_ids": labels.clamp(min=0)[i], "labels": labels[i]} for i in range(6)]
    model, env = anyjob.tiny_lm(), DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
    result = evaluate(model, val, Loss(), env, torch.device("cpu"), batch_size=2)
    with torch.no_grad():
        logits = model.head(model.norm(model.embed(labels.clamp(min=0))))
        per_token = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, anyjob.VOCAB), labels[:, 1:].reshape(-1))
    assert result["val_loss"] == pytest.approx(per_token.item(), rel=1e-6)  # the mean over every counted token
    assert result["bits_per_token"] == pytest.approx(per_token.item() / math.log(2), rel=1e-6)

    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    classifier = nn.Linear(3, 3)
    scores = evaluate(classifier, list(zip(x, y, strict=True)), Loss(), env, torch.device("cpu"), batch_size=2)
    with torch.no_grad():
        assert scores["val_loss"] == pytest.approx(nn.functional.cross_entropy(classifier(x), y).item(), rel=1e-6)
        assert scores["accuracy"] == (classifier(x).argmax(1) == y).sum().item() / 5


def test_plot_shows_the_held_out_loss_of_a_job_without_accuracy():
    records = [
        {"event": "train", "step": 1, "loss": 3.0, "samples_per_s": 9.0},
        {"event": "eval", "step": 1, "val_loss": 2.5, "perplexity": 12.2},
        {"event": "final", "step": 1, "val_loss": 2.5, "params": "ab"},
    ]
    assert plot.series(records)["held-out loss"] == ([1, 1], [2.5, 2.5])
    records[1]["accuracy"] = 0.5
    assert plot.series(records)["held-out accuracy"] == ([1], [0.5])
