"""The process-level rows of test_bad_input.py: real CLI processes."""

import pytest

from helpers import ddpjob

KUBEFLOW_BAD_PORT = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "MASTER_ADDR": "head", "MASTER_PORT": "abc"}


REAL_CLI = [  # a sample of the bad-value table (tests/test_config.py walks all of it in process)
    (["train", "--lr", "nan"], {}),
    (["train"], {"DDPJOB_SAVE_TIMEOUT": "inf"}),
    (["train", "--model", "ddpjob.plugins:digits_mlp(hiden=32)"], {}),
    (["train"], {"WORLD_SIZE": "2"}),
    (["launch", "--dry-run", "--rdzv-endpoint", "127.0.0.1:99999"], {}),
    (["launch", "--dry-run"], KUBEFLOW_BAD_PORT),
    (["train", "--max-steps", "1", "--checkpoint-dir", "s3://bucket/ckpt"], {}),
    (["launch", "--dry-run", "--rdzv-endpoint", "tcp://127.0.0.1:29555"], {}),
    (["launch", "--dry-run", "--optimizer", "no.such.opt:make"], {}),
]


@pytest.mark.parametrize("argv, env", REAL_CLI, ids=[" ".join(a) + str(e) for a, e in REAL_CLI])
def test_bad_values_through_the_real_cli_are_one_line_exit_2_before_any_step(argv, env, tmp_path):
    proc = ddpjob(argv, tmp_path, **env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpjob: error: "), proc.stderr
    assert not (tmp_path / "runs/ddpjob/metrics.jsonl").exists()  # no training step, no start record
    assert not (tmp_path / "s3:").exists()  # no local folder named after a URL


def test_a_factorys_network_error_through_the_real_cli_is_exit_1_one_line(tmp_path):
    proc = ddpjob(["train", "--data", "tests.plugins.network:refused"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "transient" in lines[0] and "refused" in lines[0], proc.stderr


def test_a_bad_worker_value_ends_before_torch_loads(tmp_path):
    """A worker's bad flag costs a tenth of a second, not torch's two: validation comes first."""
    proc = ddpjob(["train", "--lr", "nan"], tmp_path, PYTHONPROFILEIMPORTTIME="1")
    assert proc.returncode == 2, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "ddpjob.config" in imported  # the probe sees the imports
    assert "torch" not in imported
