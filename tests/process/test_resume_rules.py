"""The resume table: a setting changed on resume applies, is refused in one line, or is node-level.

Rows come from config.py's declarations. The 'applies' settings are changed together in two real
resumes (each setting's new value must reach the run: the checkpoint's config, and its effect where
it shows); each 'refused' setting is its own real resume (exit 2, one line, before any step); the
node-level settings are given to a worker, which must train exactly as without them."""

import json
import shutil

import pytest

from ddpjob import config
from ddpjob.checkpoint import catalogue
from ddpjob.checkpoint.formats import single_file
from helpers import assert_bitwise_equal, ddpjob, launched, ok, records

ANYJOB = "tests.plugins.anyjob"  # children import from the repo root
BASE = [
    "train",
    "--model",
    "ddpjob.plugins:digits_mlp(hidden=16)",
    "--epochs",
    "2",
    "--batch-size",
    "64",
    "--max-steps",
    "2",
    "--save-every",
    "2",
    "--log-every",
    "1",
    "--optimizer",
    "sgd",
    "--momentum",
    "0.5",
    "--weight-decay",
    "0.1",  # a change between values above 0 keeps the optimizer's groups (0 <-> above 0 is refused)
    "--schedule",
    "constant",
    "--lr",
    "0.003",
]
STEP_2 = "runs/ddpjob/checkpoints/step-2.pt"
# Each 'applies' setting: its new value in one of two resumes (from step 2 to step 4). What can
# take effect together is grouped; run_dir, checkpoint_dir and checkpoint_format move the run.
APPLIES_A = {
    "model": "ddpjob.plugins:digits_mlp(hidden=16, dropout=0.2)",
    "data": "ddpjob.plugins:digits(val_fraction=0.2)",
    "epochs": "3",
    "max_steps": "4",
    "batch_size": "32",
    "grad_accum": "2",
    "loss": f"{ANYJOB}:cross_entropy_marked",
    "lr": "0.001",
    "weight_decay": "0.2",
    "momentum": "0.9",
    "nesterov": "true",
    "betas": "0.8,0.99",
    "grad_clip": "1.0",
    "strategy": "none",
    "device": "cpu",
    "init_method": "tcp://127.0.0.1:1",
    "startup_timeout": "601",
    "collective_timeout": "301",
    "eval_timeout": "1801",
    "save_timeout": "1801",
    "fs_timeout": "121",
    "metrics": "runs/ddpjob/other.jsonl",
    "save_every": "1",
    "keep": "5",
    "save_mode": "async",
    "on_save_error": "warn",
    "load_mode": "rank0",
    "tensorboard": "tb",
    "tracker_uri": "sqlite:///unused.db",
    "tracker_project": "p2",
    "tracker_run_name": "r2",
    "tracker_every": "2",
    "tracker_timeout": "31",
    "stop_check_every": "1",
    "straggler_factor": "2",
    "straggler_intervals": "4",
    "heartbeat": "30",
    "trace_after": "60",
}
APPLIES_B = {
    "global_batch_size": "128",
    "schedule": "linear",
    "warmup_steps": "1",
    "min_lr": "0.0001",
    "find_unused_parameters": "true",
    "num_workers": "1",
    "run_dir": "moved",
    "checkpoint_dir": "moved/ckpts",
    "checkpoint_format": "dcp",
    "resume": STEP_2,
    "log_every": "2",
}
NOT_CHANGED_HERE = {  # 'applies' settings a CPU test machine cannot change (still in the in-process table)
    "precision": "bf16 needs CUDA",
    "compile": "compiling takes minutes on two shared cores",
    "tracker": "needs a tracker's package and store; test_trackers resumes runs with a tracker",
}
WALKED_ELSEWHERE = {  # 'applies' rows resumed for real in another file
    "shard_modules": "fsdp2 only: test_fsdp2.py::test_shard_modules_and_activation_checkpointing_changed_on_resume_apply",
    "activation_checkpointing": "fsdp2 only: test_fsdp2.py (the same test)",
}
REFUSED_CHANGES = {"seed": "1", "optimizer": "adamw"}
FRESH_ONLY_CHANGES = {"init_from": "moved-away.pt"}  # the checkpoint wins: ignored, with one warning line
STORED_ONLY = {  # 'applies' rows whose effect a short CPU resume cannot show: checked in the saved config only
    "init_method": "--strategy none at world 1 starts no process group",
    "load_mode": "--strategy none at world 1: no other rank to broadcast to",
    "startup_timeout": "a timeout shows only when a peer hangs (test_faults hangs peers)",
    "collective_timeout": "a timeout shows only when a peer hangs (test_faults hangs peers)",
    "eval_timeout": "a timeout shows only when evaluation hangs",
    "save_timeout": "a timeout shows only when a save hangs (test_stop_paths times saves)",
    "fs_timeout": "a timeout shows only on lagging shared storage",
    "tracker_uri": "--tracker none here; test_trackers resumes runs with a tracker",
    "tracker_every": "--tracker none here",
    "tracker_timeout": "--tracker none here",
    "straggler_factor": "one rank: no straggler to name",
    "straggler_intervals": "one rank: no straggler to name",
    "heartbeat": "30 s: longer than the resume",
    "trace_after": "60 s: longer than the resume",
    "stop_check_every": "shows only with a stop signal (test_stop_paths)",
    "on_save_error": "shows only when a save fails (test_stop_paths)",
    "save_mode": "async and sync write the same checkpoint",
    "data": "the same samples (val_fraction splits off validation, which --max-steps never reaches)",
    "model": "dropout's effect is in the weights, not compared here",
    "strategy": "none and ddp at world 1 train the same",
    "device": "cpu is the default here",
    "epochs": "shows as the schedule's length: --schedule constant here",
    "batch_size": "with grad_accum 2 the same step size",
    "grad_accum": "with batch_size 32 the same step size",
}
# Tracker project and run name: refused when the checkpoint holds a tracker run (the run cannot move),
# else they apply; test_tracker_project_on_resume_* shows both with a real MLflow store.
NODE_VALUES = {
    "nnodes": "1:4",
    "node_rank": "2",
    "nproc_per_node": "3",
    "rdzv_endpoint": "10.0.0.9:1234",
    "rdzv_id": "other",
    "rdzv_timeout": "5",
    "elastic_wait": "2",
    "max_restarts": "2",
    "shutdown_timeout": "7",
    "rdzv_retries": "5",
    "worker_start": "exec",
}


def rule_of(name):
    return config.FIELDS[name].metadata["resume"]


def test_every_setting_has_a_row_of_its_rule():
    """A new setting must be given a row here: its new value on resume, or why it cannot change."""
    by_rule = {rule: {n for n in config.FIELDS if rule_of(n) == rule} for rule in (config.APPLIES, config.REFUSED)}
    walked = set(APPLIES_A) | set(APPLIES_B) | set(NOT_CHANGED_HERE) | set(WALKED_ELSEWHERE)
    assert walked == by_rule[config.APPLIES]
    assert not set(APPLIES_A) & set(APPLIES_B)
    assert set(REFUSED_CHANGES) == by_rule[config.REFUSED]
    assert set(FRESH_ONLY_CHANGES) == {n for n in config.FIELDS if rule_of(n) == config.FRESH_ONLY}
    assert set(STORED_ONLY) <= set(APPLIES_A) | set(APPLIES_B)
    assert set(NODE_VALUES) == {n for n in config.FIELDS if rule_of(n) == config.NODE_LEVEL}


def flags(values):
    return [arg for name, value in values.items() for arg in (config.flag(name), value)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run to step 2 given every node-level setting (as DDPJOB_* variables), and the same run
    without them: the worker ignores them, so both trained the same weights."""
    root = tmp_path_factory.mktemp("resume")
    (root / "node").mkdir()
    (root / "plain").mkdir()
    ok(ddpjob(BASE, root / "node", **{f"DDPJOB_{n.upper()}": v for n, v in NODE_VALUES.items()}))
    ok(ddpjob(BASE, root / "plain"))
    return root


def test_node_level_settings_are_ignored_by_the_worker(trained):
    with_them, without = (single_file.read(trained / run / STEP_2) for run in ("node", "plain"))
    assert_bitwise_equal(with_them["model"], without["model"])
    assert {n: with_them["config"][n] for n in NODE_VALUES} != {n: without["config"][n] for n in NODE_VALUES}


def resume_copy(trained, tmp_path, argv):
    work = tmp_path / "work"
    shutil.copytree(trained / "node", work)  # a resume without the node-level settings: not refused
    return ddpjob([*BASE, "--max-steps", "4", *argv], work), work  # two steps more


def converted(name, raw):
    default = config.FIELDS[name].default
    return config._convert(name, raw, name) if not isinstance(default, str) else raw


def assert_saved_config(saved, values):
    for name, raw in values.items():
        assert saved[name] == converted(name, raw), name


def test_settings_that_apply_take_effect_on_resume_a(trained, tmp_path):
    proc, work = resume_copy(trained, tmp_path, flags(APPLIES_A))
    ok(proc)
    run = work / "runs/ddpjob"
    assert_saved_config(single_file.read(run / "checkpoints/step-4.pt")["config"], APPLIES_A)
    logged = [json.loads(line) for line in (run / "other.jsonl").read_text().splitlines()]
    trains = {r["step"]: r for r in logged if r["event"] == "train"}
    assert sorted(trains) == [3, 4]  # --max-steps 4, logged to --metrics
    assert all(trains[s]["lr"] == pytest.approx(0.001) for s in (3, 4)), trains  # --lr, lowered
    assert all("marked" in trains[s] and "grad_norm" in trains[s] for s in (3, 4))  # --loss, --grad-clip
    assert [s for s, _ in catalogue.list_steps(run / "checkpoints")] == [4, 3, 2]  # --save-every 1, --keep 5
    groups = single_file.read(run / "checkpoints/step-4.pt")["optimizer"]["param_groups"]
    assert [(g["momentum"], g["nesterov"]) for g in groups] == [(0.9, True)] * 2
    assert [g["weight_decay"] for g in groups] == [0.2, 0.0]
    assert list((work / "tb").iterdir())  # --tensorboard


def test_settings_that_apply_take_effect_on_resume_b(trained, tmp_path):
    proc, work = resume_copy(trained, tmp_path, flags(APPLIES_B))
    ok(proc)
    newest = catalogue.list_steps(work / "moved/ckpts")[0][1]
    assert newest.name == "step-4" and newest.is_dir()  # --checkpoint-dir, --checkpoint-format dcp
    trains = {r["step"]: r for r in records(work / "moved") if r["event"] == "train"}
    assert sorted(trains) == [4]  # --run-dir (its metrics.jsonl), --log-every 2
    assert trains[4]["lr"] < 0.003  # --schedule linear to --min-lr, not the constant 0.003
    start = [r for r in records(work / "moved") if r["event"] == "start"][-1]
    assert start["resumed_from"].endswith("step-2.pt") and start["global_batch"] == 128  # --resume, --global-batch-size


@pytest.mark.parametrize("name", sorted(REFUSED_CHANGES))
def test_a_refused_setting_changed_on_resume_is_one_line_and_exit_2(name, trained, tmp_path):
    proc, work = resume_copy(trained, tmp_path, [config.flag(name), REFUSED_CHANGES[name]])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpjob: error: "), proc.stderr
    assert config.flag(name) in lines[0] and "--run-dir" in lines[0], lines[0]
    assert [s for s, _ in catalogue.list_steps(work / "runs/ddpjob/checkpoints")] == [2]  # no step trained


def test_init_from_on_resume_is_ignored_with_one_warning(trained, tmp_path):
    name = "init_from"
    proc, work = resume_copy(trained, tmp_path, [config.flag(name), FRESH_ONLY_CHANGES[name]])
    ok(proc)
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if "--init-from" in line]
    assert len(warned) == 1 and "ignored: resuming from step 2" in warned[0], warned
    assert catalogue.list_steps(work / "runs/ddpjob/checkpoints")[0][0] == 4


def test_a_run_started_with_init_from_resumes_after_that_file_moved(trained, tmp_path):
    shutil.copy(trained / "plain" / STEP_2, tmp_path / "base.pt")
    ok(ddpjob([*BASE, "--init-from", "base.pt", "--save-every", "1"], tmp_path))
    (tmp_path / "base.pt").rename(tmp_path / "x.pt")
    ok(ddpjob([*BASE, "--max-steps", "3"], tmp_path))  # --init-from left out
    ok(ddpjob([*BASE, "--max-steps", "4", "--init-from", "base.pt"], tmp_path))  # the old path, now gone
    ok(ddpjob([*BASE, "--max-steps", "5", "--init-from", "x.pt"], tmp_path))  # its new place
    assert catalogue.list_steps(tmp_path / "runs/ddpjob/checkpoints")[0][0] == 5


def test_a_refused_change_on_a_dcp_resume_at_world_2_is_one_line_and_exit_2(tmp_path):
    from helpers import torchrun

    dcp = [*BASE, "--checkpoint-format", "dcp"][1:]  # torchrun() adds `train`
    ok(launched(dcp, tmp_path))
    proc = torchrun([*dcp, "--max-steps", "4", "--seed", "1"], tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "ddpjob: error:" in line]
    assert errors and all("--seed" in line and "--run-dir" in line for line in errors), proc.stderr[-3000:]
    assert [s for s, _ in catalogue.list_steps(tmp_path / "runs/ddpjob/checkpoints")] == [2]


def test_adamw_betas_changed_on_resume_apply():
    """optim.keep_settings puts this run's betas back over the checkpoint's (adamw: the fixture is sgd)."""
    import torch

    from ddpjob.train import optim

    model = torch.nn.Linear(2, 2)
    old = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.999))
    new = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.99))
    mine = optim.settings(new)
    new.load_state_dict(old.state_dict())
    optim.keep_settings(new, mine)
    assert [g["betas"] for g in new.param_groups] == [(0.8, 0.99)]


def mlflow_store(tmp_path):
    return ["--tracker", "mlflow", "--tracker-uri", f"sqlite:///{tmp_path}/mlflow.db", "--tracker-every", "0"]


def test_tracker_project_and_name_apply_on_resume_when_the_checkpoint_holds_no_tracker_run(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    ok(ddpjob(BASE, tmp_path))  # --tracker none: no tracker run in the checkpoint
    names = ["--tracker-project", "p2", "--tracker-run-name", "r2"]
    ok(ddpjob([*BASE, *mlflow_store(tmp_path), "--max-steps", "3", *names], tmp_path, timeout=300))
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("p2").experiment_id])
    assert [r.info.run_name for r in runs] == ["r2"]  # the new project and name took effect


@pytest.mark.parametrize("resumed_with", ["same", "other"])
def test_tracker_project_on_resume_is_refused_once_the_checkpoint_holds_a_tracker_run(resumed_with, tmp_path):
    pytest.importorskip("mlflow")
    store = mlflow_store(tmp_path)
    ok(ddpjob([*BASE, *store, "--tracker-project", "p1"], tmp_path, timeout=300))
    project = "p1" if resumed_with == "same" else "p2"
    proc = ddpjob([*BASE, *store, "--max-steps", "3", "--tracker-project", project], tmp_path, timeout=300)
    if resumed_with == "same":
        ok(proc)
        return
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tracker-project" in lines[0] and "--resume never" in lines[0], proc.stderr
