"""Config precedence (defaults < .env < DDPJOB_* env < CLI) and validation."""

import argparse

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
    example = (config.Path(__file__).resolve().parents[1] / ".env.example").read_text()
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
        (["--strategy", "fsdp"], {}, ["fsdp", "ddp, dp, none"]),
        (["--batch-size", "0"], {}, ["--batch-size", "at least 1"]),
        (["--lr", "-1"], {}, ["--lr", "positive"]),
        (["--model", "mymodel"], {}, ["--model", "package.module:callable"]),
        (["--resume", "/nope.pt"], {}, ["--resume", "no such checkpoint"]),
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
