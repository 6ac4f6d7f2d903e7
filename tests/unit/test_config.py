"""Config precedence (defaults < .env < DDPJOB_* env < CLI) and validation."""

import argparse
import dataclasses
import importlib
import re
import sys

import pytest

from ddpjob import config
from ddpjob.errors import UsageError


def load(argv, environ=None, cwd=None, monkeypatch=None):
    parser = config.make_parser("t", "t")
    config.add_config_flags(parser)
    return config.load(parser.parse_args(argv), environ or {})


def test_defaults_without_any_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load([])
    assert cfg == config.Config()
    assert str(cfg.checkpoint_path) == "runs/ddpjob/checkpoints"


def test_dotenv_then_env_then_cli_each_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("DDPJOB_EPOCHS=3\nDDPJOB_LR=0.5\nDDPJOB_SEED=7\nDDPJOB_BATCH_SIZE=8\n")
    cfg = load(["--seed", "9"], {"DDPJOB_LR": "0.25", "DDPJOB_SEED": "8"})
    assert (cfg.epochs, cfg.lr, cfg.seed, cfg.batch_size) == (3, 0.25, 9, 8)


def test_env_file_flag_replaces_dot_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("DDPJOB_EPOCHS=3\n")
    (tmp_path / "other.env").write_text("DDPJOB_EPOCHS=5\n")
    assert load(["--env-file", "other.env"]).epochs == 5


def test_env_example_documents_every_key_with_its_default():
    example = (config.Path(__file__).resolve().parents[2] / ".env.example").read_text()
    assert example == config.render_env(config.Config()), "regenerate: ddpjob config > .env.example"
    for name in config.FIELDS:
        assert f"DDPJOB_{name.upper()}=" in example, name


@pytest.mark.parametrize(
    "argv, environ, words",
    [
        (["--epochs", "x"], {}, ["--epochs='x'", "not an integer"]),
        ([], {"DDPJOB_LR": "fast"}, ["DDPJOB_LR='fast'", "not a number"]),
        ([], {"DDPJOB_EPOCH": "3"}, ["unknown setting DDPJOB_EPOCH"]),
        (["--epoch", "3"], {}, ["unrecognized arguments"]),
        (["--strategy", "fsdp"], {}, ["fsdp", "ddp, fsdp2, dp, none"]),
        (["--batch-size", "0"], {}, ["--batch-size", "from 1"]),
        (["--lr", "-1"], {}, ["--lr", "above 0"]),
        (["--model", "mymodel"], {}, ["--model", "package.module:callable"]),
        (["--resume", "/nope.pt"], {}, ["--resume", "does not exist"]),
        (["--env-file", "/nope.env"], {}, ["--env-file", "no such file"]),
        (["--init-method", "file:///x"], {}, ["--init-method", "tcp://"]),
    ],
)
def test_bad_config_is_one_line_naming_the_source(tmp_path, monkeypatch, argv, environ, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as err:
        load(argv, environ)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_unknown_key_in_dotenv_names_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("DDPJOB_BATCHSIZE=3\n")
    with pytest.raises(UsageError, match=r"DDPJOB_BATCHSIZE in \.env"):
        load([])


def test_non_ddpjob_keys_in_dotenv_reach_the_environment_without_overriding(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")  # so that monkeypatch removes what load() exports
    (tmp_path / ".env").write_text("GLOO_SOCKET_IFNAME=eth1\nNCCL_DEBUG=INFO\n")
    parser = config.make_parser("t", "t")
    config.add_config_flags(parser)
    config.load(parser.parse_args([]))
    assert config.os.environ["GLOO_SOCKET_IFNAME"] == "eth1"
    assert config.os.environ["NCCL_DEBUG"] == "WARN"


def test_parser_errors_raise_instead_of_exiting():
    parser = config.make_parser("t", "t")
    with pytest.raises(UsageError):
        parser.parse_args(["--bogus"])
    assert isinstance(parser, argparse.ArgumentParser)


# ---- the declaration: every field says its kind, scope and resume rule ------------------------------
def test_every_field_declares_its_kind_scope_and_resume_rule():
    """A new field without a kind (and so its bad values) or a resume rule fails here."""
    for f in dataclasses.fields(config.Config):
        meta = f.metadata
        assert isinstance(meta.get("kind"), config.Kind), f"{f.name}: declare its kind with _opt or _node"
        assert meta.get("scope") in (config.WORKER, config.NODE), f.name
        assert meta.get("resume") in config.RULES, f.name
        assert (meta["scope"] == config.NODE) == (meta["resume"] == config.NODE_LEVEL), f.name
        assert (meta["resume"] in (config.REFUSED, config.FRESH_ONLY)) == bool(meta["why"]), f"{f.name}: says why"
        assert meta["help"], f.name
        assert meta["kind"].bad or meta["kind"] is config.TEXT, f"{f.name}: its kind lists no bad values"
        assert not meta["kind"].problem(f.default), f"{f.name}: its default {f.default!r} is not of its kind"


def bad_rows():
    """(field, bad value) for every field and every bad value of its kind: from the declarations."""
    return [(name, bad) for name, f in config.FIELDS.items() for bad in f.metadata["kind"].bad]


def fill(bad, tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir(exist_ok=True)
    return bad.format(file=tmp_path / "a_file", dir=tmp_path / "a_dir")


@pytest.mark.parametrize("source", ["flag", "env"])
@pytest.mark.parametrize("name, bad", bad_rows())
def test_each_bad_value_of_each_field_is_one_line_naming_its_flag_or_variable(name, bad, source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    value = fill(bad, tmp_path)
    named = config.flag(name) if source == "flag" else f"DDPJOB_{name.upper()}"
    with pytest.raises(UsageError) as err:
        load([named, value] if source == "flag" else [], {named: value} if source == "env" else {})
    message = str(err.value)
    assert "\n" not in message and named in message, message


def test_the_bad_value_table_covers_every_kind_of_bad_input():
    values = {bad for _, bad in bad_rows()}
    for bad in ("nan", "inf", "-1", "0", "1e30", "x", "{file}", "{dir}", "{file}/sub", "host:abc", "127.0.0.1:99999"):
        assert bad in values, bad
    assert len(bad_rows()) >= 200  # 230 when written


def test_node_level_settings_are_the_ones_launch_reads():
    node = {name for name in config.FIELDS if config.in_scope(name, config.NODE)}
    assert node == {
        "nnodes",
        "node_rank",
        "nproc_per_node",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_timeout",
        "elastic_wait",
        "rdzv_retries",
        "max_restarts",
        "shutdown_timeout",
        "worker_start",
    }


@pytest.mark.parametrize("command, scope", [("train", config.WORKER), ("launch", config.NODE)])
def test_help_of_each_command_shows_its_own_settings(command, scope, capsys):
    from ddpjob import cli

    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for name in config.FIELDS:
        listed = re.search(rf"^  {config.flag(name)}[ \n]", shown, re.MULTILINE) is not None
        assert listed == config.in_scope(name, scope), name


# ---- the resume rules, in process (tests/test_resume_rules.py runs them as real resumes) -----------
def changed(name):
    """Another good value of the field."""
    return {bool: True, int: 7, float: 0.5}.get(type(config.FIELDS[name].default), "other")


@pytest.mark.parametrize("name", list(config.FIELDS))
def test_a_changed_setting_on_resume_is_refused_only_where_its_rule_says(name):
    saved = config.Config().to_dict()
    cfg = dataclasses.replace(config.Config(), **{name: changed(name)})
    if config.FIELDS[name].metadata["resume"] == config.REFUSED:
        with pytest.raises(UsageError) as err:
            config.check_resume(cfg, saved, "step-2.pt")
        assert "\n" not in str(err.value) and config.flag(name) in str(err.value) and "--run-dir" in str(err.value)
    else:  # applies, fresh-start only (the checkpoint wins, changed or removed), node-level
        config.check_resume(cfg, saved, "step-2.pt")
        config.check_resume(config.Config(), {**saved, name: changed(name)}, "step-2.pt")
    config.check_resume(cfg, {k: v for k, v in saved.items() if k != name}, "old.pt")  # not recorded: not compared


def test_docs_show_the_settings_table_of_the_code():
    docs = (config.Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert config.resume_table() in docs, "paste config.resume_table() into docs/configuration.md"


# ---- review fixes: each walks the declarations ---------------------------------------------------
PATH_FIELDS = {"run_dir", "checkpoint_dir", "metrics", "tensorboard", "resume", "init_from"}


def test_the_path_fields_are_the_ones_whose_kind_is_a_path():
    assert {name for name, f in config.FIELDS.items() if f.metadata["kind"].path} == PATH_FIELDS


URL_FIELDS = {"checkpoint_dir", "resume", "init_from"}  # where a checkpoint is read or written


def test_the_url_fields_are_the_ones_whose_kind_takes_urls():
    assert {name for name, f in config.FIELDS.items() if f.metadata["kind"].urls} == URL_FIELDS


@pytest.mark.parametrize("name", sorted(PATH_FIELDS - URL_FIELDS))
@pytest.mark.parametrize("url", ["s3://bucket/ckpt", "gs://b/x", "file:///tmp/x"])
def test_an_object_storage_url_for_a_local_path_is_one_line_naming_the_flag(name, url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as err:
        load([config.flag(name), url])
    assert config.flag(name) in str(err.value) and "only --checkpoint-dir, --resume and --init-from" in str(err.value)
    assert not list(tmp_path.iterdir())  # no ./s3:/bucket folder


@pytest.mark.parametrize("name", sorted(URL_FIELDS))
def test_a_url_without_its_library_is_one_line_naming_the_extra(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed: its import fails, and
    monkeypatch.delitem(importlib.import_module("fsspec.registry")._registry, "s3", raising=False)  # no class kept
    with pytest.raises(UsageError) as err:
        load([config.flag(name), "s3://bucket/ckpt"])
    assert config.flag(name) in str(err.value) and "pip install 'ddpjob[s3]'" in str(err.value)
    assert "\n" not in str(err.value) and not list(tmp_path.iterdir())


def test_every_bounded_kind_refuses_the_value_just_below_its_minimum():
    """A kind of minimum 1 has the row '0', one of minimum 0 the row '-1', one 'above 0' the row '0'."""
    bounded = {f.metadata["kind"] for f in config.FIELDS.values() if f.metadata["kind"].low is not None}
    assert len(bounded) >= 6
    for kind in bounded:
        whole = isinstance(kind.low, int)
        below = str(kind.low - 1) if whole else (f"{kind.low:g}" if kind.above else f"{kind.low - 1e-9:g}")
        assert below in kind.bad, (kind.name, below, kind.bad)
        assert kind.problem(int(below) if whole else float(below)), (kind.name, below)


def test_init_from_is_not_required_to_exist_when_a_checkpoint_will_be_resumed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="--init-from"):
        load(["--init-from", "moved.pt"])  # a fresh start: it must exist
    (tmp_path / "runs/ddpjob/checkpoints").mkdir(parents=True)
    (tmp_path / "runs/ddpjob/checkpoints/step-2.pt").write_bytes(b"x")
    assert load(["--init-from", "moved.pt"]).init_from == "moved.pt"  # resumed: the checkpoint wins
    with pytest.raises(UsageError, match="--init-from"):
        load(["--init-from", "moved.pt", "--resume", "never"])


def test_an_empty_resume_means_auto(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load(["--resume", ""]).resume == "auto"
    assert load([], {"DDPJOB_RESUME": ""}).resume == "auto"


@pytest.mark.parametrize("seed", [2**31, 2**63, 2**64 - 1, -1, -(2**63)])
def test_seeds_torch_accepts_are_accepted(seed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load(["--seed", str(seed)]).seed == seed


def test_seeds_at_the_ends_of_the_range_drive_every_generator():
    from ddpjob.train import rng, sampling

    for seed in (2**64 - 1, -(2**63)):
        assert len(sampling.epoch_order(10, seed, 3)) == 10  # seed + epoch past 2**64 - 1
        rng.seed_all(seed + 5)  # seed + rank


def test_the_resume_hint_quotes_the_value_for_the_shell():
    saved = {**config.Config().to_dict(), "optimizer": "my.opt:make(name='a b')"}
    with pytest.raises(UsageError) as err:
        config.check_resume(config.Config(), saved, "step-2.pt")
    assert "resume with --optimizer 'my.opt:make(name='\"'\"'a b'\"'\"')'" in str(err.value), str(err.value)


def test_the_seed_refusal_says_when_samples_would_repeat():
    saved = {**config.Config().to_dict(), "seed": 3}
    with pytest.raises(UsageError) as err:
        config.check_resume(config.Config(), saved, "step-2.pt")
    assert "mid-epoch" in str(err.value), str(err.value)


@pytest.mark.parametrize("name", ["tracker_project", "tracker_run_name"])
def test_a_tracker_runs_project_or_name_is_refused_only_when_the_checkpoint_holds_its_run(name):
    saved = config.Config().to_dict()
    cfg = dataclasses.replace(config.Config(), **{name: "other"})
    config.check_resume(cfg, saved, "step-2.pt")  # no tracker run: applies
    with pytest.raises(UsageError) as err:
        config.check_resume(cfg, saved, "step-2.pt", tracker_run="abc123")
    message = str(err.value)
    assert "\n" not in message and config.flag(name) in message and "--resume never" in message, message
    config.check_resume(dataclasses.replace(cfg, **{name: ""}), saved, "step-2.pt", tracker_run="abc123")
