"""The task-dependent parts of the loop, in-process: batches, losses, optimizers and schedules."""

import math
from collections import namedtuple

import pytest
import torch
from torch import nn

from ddpjob import config
from ddpjob.distenv import DistEnv
from ddpjob.errors import UsageError
from ddpjob.tools import plot
from ddpjob.train import batches, optim
from ddpjob.train.evaluation import evaluate, token_count
from ddpjob.train.losses import Loss
from ddpjob.train.metrics import Metrics
from ddpjob.train.schedule import Schedule
from ddpjob.train.setup import check_setup
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


def raises_one_line(call, *words):
    with pytest.raises(UsageError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_float_labels_under_default_cross_entropy_are_a_usage_error_not_a_silent_zero_gradient():
    output = torch.randn(4, 1, requires_grad=True)  # a regression head
    raises_one_line(lambda: Loss()(output, (None, torch.randn(4, 1))), "float labels", "--loss MODULE:CALLABLE")
    raises_one_line(lambda: Loss()(torch.randn(4), (None, torch.randn(4))), "float labels", "regression")
    probabilities = torch.softmax(torch.randn(4, 3), 1)  # soft targets: still cross-entropy
    assert Loss()(torch.randn(4, 3), (None, probabilities)).kind == "cross_entropy"


def test_a_zero_dim_output_on_a_labelled_batch_is_a_prediction_not_the_model_own_loss():
    output = torch.tensor(0.5, requires_grad=True)  # a regression at batch size 1, squeezed
    raises_one_line(lambda: Loss()(output, (torch.zeros(1, 3), torch.tensor(0.3))), "float labels", "regression")
    assert Loss()(output, torch.zeros(1, 3)).kind == "model"  # no labels: the model's own loss


def test_token_logits_with_per_token_labels_are_flattened_for_cross_entropy():
    logits, label = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    result = Loss()(logits, (None, label))
    assert torch.equal(result.value, nn.functional.cross_entropy(logits.reshape(10, 7), label.reshape(10)))
    images, pixels = torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4))  # torch's classes-at-dim-1 layout
    assert torch.equal(Loss()(images, (None, pixels)).value, nn.functional.cross_entropy(images, pixels))


def test_labels_that_do_not_fit_the_logits_are_named_on_the_first_step_only():
    raises_one_line(lambda: Loss()(torch.randn(4, 3), (None, torch.zeros(5, dtype=torch.long))), "[5]", "[4, 3]")
    raises_one_line(lambda: Loss()(torch.randn(2, 3), (None, torch.tensor([1, 3]))), "1..3", "3 classes")
    loss = Loss()
    loss(torch.randn(2, 3), (None, torch.tensor([1, -100])))  # padding is not out of range
    with pytest.raises(IndexError):  # later steps pay no check: torch's own error
        loss(torch.randn(2, 3), (None, torch.tensor([1, 3])))


def test_extras_named_as_logged_fields_are_a_usage_error_on_the_first_step():
    loss = Loss("tests.plugins.anyjob:named_extra(name='lr')")
    raises_one_line(lambda: loss(torch.ones(2), (None, torch.zeros(2))), "named lr", "reserved", "val_loss")
    Loss("tests.plugins.anyjob:named_extra(name='mae')")(torch.ones(2), (None, torch.zeros(2)))


def test_data_parallel_gathered_per_gpu_losses_are_averaged():
    gathered = torch.tensor([1.0, 3.0], requires_grad=True)
    for output in (gathered, {"loss": gathered}):
        result = Loss(replicas=2)(output, torch.zeros(4, 2))
        assert result.kind == "model" and result.value.item() == 2.0
    raises_one_line(lambda: Loss()({"loss": gathered}, None), "not a scalar")  # one process, no averaging


def test_perplexity_only_for_a_model_own_loss_on_per_sequence_labels():
    env = DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
    data = [{"x": torch.ones(2), "labels": torch.tensor([[1, 2], [3, 4]])}] * 4  # 2-D labels per sample: 3-D batch
    model = anyjob.ConstantLoss()
    assert "perplexity" not in evaluate(model, data, Loss(), env, torch.device("cpu"), batch_size=2)
    seqs = [{"x": torch.ones(2), "labels": torch.tensor([1, 2, 3])}] * 4
    assert "perplexity" in evaluate(model, seqs, Loss(), env, torch.device("cpu"), batch_size=2)
    user = Loss("tests.plugins.anyjob:own_loss")
    assert "perplexity" not in evaluate(model, seqs, user, env, torch.device("cpu"), batch_size=2)


def test_classifier_accuracy_counts_each_token_label_once():
    env = DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
    label = torch.tensor([[0, 1, -100], [2, 2, 2]])
    logits = nn.functional.one_hot(torch.tensor([[0, 1, 1], [2, 2, 0]]), 3).float()  # 4 of 5 counted are right
    model = anyjob.Fixed(logits)
    scores = evaluate(model, list(zip(range(2), label, strict=True)), Loss(), env, torch.device("cpu"), batch_size=2)
    assert scores["accuracy"] == pytest.approx(4 / 5)


def test_the_logged_loss_sums_bf16_losses_in_float32(tmp_path):
    metrics = Metrics(tmp_path / "m.jsonl", True, 100, 1, 100)
    for _ in range(50):
        metrics.step(1, 0, torch.tensor(1.001, dtype=torch.bfloat16), 0.1)
    assert metrics.loss_sum is not None and metrics.loss_sum.dtype == torch.float32
    step_loss = torch.tensor(2.0)
    metrics = Metrics(tmp_path / "n.jsonl", True, 100, 1, 100)
    metrics.step(1, 0, step_loss, 0.1)
    metrics.step(2, 0, torch.tensor(3.0), 0.1)
    assert step_loss.item() == 2.0  # the sum is a copy, never the step's own tensor


def test_sparse_embeddings_get_torch_default_optimizer_not_the_fused_one():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    optimizer = optim.build_optimizer(cfg(optimizer="sgd"), model)
    assert not optimizer.defaults.get("fused")
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()  # fused SGD: RuntimeError on the sparse gradient


def test_dict_batch_keys_forward_does_not_take_are_one_usage_error_naming_keys_and_signature():
    model = anyjob.tiny_lm()
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "doc_id": ["a", "b"]}
    tight = nn.Linear(2, 2)  # forward(input): takes no input_ids, no doc_id
    raises_one_line(
        lambda: batches.forward(tight, batch), "['doc_id', 'input_ids']", "Linear.forward(input", "**kwargs"
    )
    batches.forward(model, batch)  # TinyLM.forward takes **unused: the ids pass

    class Buggy(nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return len(5)  # a TypeError of its own: not the batch's fault

    with pytest.raises(TypeError, match="has no len"):
        batches.forward(Buggy(), {"input_ids": torch.zeros(1)})


def test_compile_on_cpu_without_a_cpp_compiler_is_a_usage_error(tmp_path, monkeypatch):
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    monkeypatch.delenv("CXX", raising=False)
    env = DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
    c = cfg(compile=True, device="cpu", run_dir=str(tmp_path / "run"))
    raises_one_line(lambda: check_setup(c, env), "--compile", "C++ compiler", "g++", "CXX")
    (bare / "g++").write_text("#!/bin/sh\n")
    (bare / "g++").chmod(0o755)
    check_setup(c, env)


def stepped(c: config.Config) -> torch.optim.Optimizer:
    """The optimizer of ``c`` for a seeded tiny LM, after one step (so it has state)."""
    torch.manual_seed(0)
    model = anyjob.tiny_lm()
    optimizer = optim.build_optimizer(c, model)
    batch = anyjob.tokens(samples=2)[0][0]
    model(**{k: v[None] for k, v in batch.items()})["loss"].backward()
    optimizer.step()
    return optimizer


def test_resuming_another_optimizer_kind_or_group_layout_is_one_usage_error():
    adamw = stepped(cfg(weight_decay=0.1))
    recorded = {"optimizer": adamw.state_dict(), "optimizer_layout": optim.layout(adamw)}
    sgd = optim.layout(stepped(cfg(optimizer="sgd")))
    raises_one_line(lambda: optim.check_resume(recorded, sgd, "ck"), "adamw with 2", "sgd with 1", "--optimizer")
    no_decay = optim.layout(stepped(cfg()))
    raises_one_line(lambda: optim.check_resume(recorded, no_decay, "ck"), "adamw with 1", "--weight-decay")
    older = {"optimizer": adamw.state_dict()}  # written before the record: told from its saved groups
    raises_one_line(lambda: optim.check_resume(older, sgd, "ck"), "adam or adamw with 2", "sgd with 1")
    optim.check_resume(older, optim.layout(stepped(cfg(weight_decay=0.3))), "ck")  # compatible: resumes
    optim.check_resume(recorded, optim.layout(adamw), "ck")


def test_after_a_resume_the_optimizer_keeps_its_state_and_this_run_settings():
    saved = stepped(cfg(weight_decay=0.1, betas="0.9,0.999")).state_dict()
    optimizer = optim.build_optimizer(cfg(weight_decay=0.2, betas="0.8,0.99"), anyjob.tiny_lm())
    mine = optim.settings(optimizer)
    optimizer.load_state_dict(saved)
    optim.keep_settings(optimizer, mine)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]
    assert all(g["betas"] == (0.8, 0.99) for g in optimizer.param_groups)
    first = optimizer.param_groups[0]["params"][0]
    assert torch.equal(optimizer.state[first]["exp_avg"], saved["state"][0]["exp_avg"])


def test_a_schedule_factory_returning_a_negative_factor_is_a_usage_error():
    with pytest.raises(UsageError, match=r"returned -0\.5 for step 0, not a finite number of 0 or more"):
        lrs(lambda step, total: -0.5, source="--schedule m:f")


def test_built_in_optimizer_flags_given_with_a_factory_are_warned_about_once(capsys):
    model = anyjob.tiny_lm()
    optim.build_optimizer(cfg(optimizer="tests.plugins.anyjob:sgd_factory", weight_decay=0.1, betas="0.8,0.9"), model)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "--betas, --weight-decay" in err and "ignored" in err
    optim.build_optimizer(cfg(optimizer="tests.plugins.anyjob:sgd_factory", weight_decay=0.1), model, warn=False)
    optim.build_optimizer(cfg(optimizer="tests.plugins.anyjob:sgd_factory"), model)
    assert capsys.readouterr().err == ""


def test_an_empty_validation_set_names_a_fix_that_works_for_the_built_in_digits():
    from ddpjob.plugins import build_data

    with pytest.raises(UsageError, match=r"val_fraction > 0") as caught:
        build_data("ddpjob.plugins:digits(val_fraction=0)")
    assert "\n" not in str(caught.value)


def test_a_dataset_whose_len_raises_type_error_is_unsized_not_a_traceback():
    from ddpjob.plugins import build_data

    assert build_data("plugins.empty_val:unsized_val")[1] is not None  # no length: not checked for emptiness
    with pytest.raises(UsageError, match="empty or unsized training dataset"):
        build_data("plugins.empty_val:unsized_train")
