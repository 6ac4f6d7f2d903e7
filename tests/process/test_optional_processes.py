"""Optional dependencies (pyproject's extras): missing, each is one line naming the extra, exit 2.

Each case runs the real CLI in a child process that cannot import the package: a directory early
on PYTHONPATH holds a stand-in that raises ModuleNotFoundError, as an uninstalled package would.

(The tests of test_optional.py that start processes.)
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from ddpjob import optional
from ddpjob.checkpoint.formats import single_file
from helpers import PY, clean_env
from plugins.shards import write_shards


def without(package: str, tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    hidden = tmp_path / "hidden"
    (hidden / package).mkdir(parents=True)
    (hidden / package / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{package}'\", name={package!r})\n"
    )
    env = clean_env()
    env["PYTHONPATH"] = f"{hidden}:{env['PYTHONPATH']}"
    return subprocess.run(
        [PY, "-m", "ddpjob", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def metrics_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"event": "start", "step": 0}, {"event": "train", "step": 1, "loss": 1.0, "samples_per_s": 9.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def weights_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.pt"
    single_file.save({"model": {"w": torch.zeros(2)}}, path)
    return path


def stream_job(tmp_path: Path) -> list[str]:
    """Training on the stream plug-in, whose sample files it writes first."""
    write_shards(tmp_path / "shards", [40])
    return ["train", "--data", "tests.plugins.shards:sharded", "--max-steps", "2"]


def safetensors_file(tmp_path: Path) -> Path:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\0" * 16)  # never read: the import fails first
    return path


CASES = [
    ("matplotlib", lambda t: ["plot", str(metrics_run(t))], "ddpjob plot needs"),
    (
        "safetensors",
        lambda t: ["ckpt", "convert", str(weights_file(t)), "w.safetensors", "--to", "safetensors"],
        "--to",
    ),
    ("safetensors", lambda t: ["ckpt", "inspect", str(safetensors_file(t))], "reading"),
    ("tensorboard", lambda t: ["train", "--tensorboard", "tb", "--epochs", "1"], "--tensorboard tb needs"),
    ("tensorboard", lambda t: ["launch", "--tensorboard", "tb", "--epochs", "1"], "--tensorboard tb needs"),
    ("torchdata", stream_job, "an IterableDataset (--data) needs"),
]


@pytest.mark.parametrize("package, argv, words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_missing_optional_package_is_one_line_naming_the_extra(tmp_path, package, argv, words):
    proc = without(package, tmp_path, argv(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("ddpjob: error: ") and words in lines[0]
    assert f"optional package {package}" in lines[0] and f"pip install 'ddpjob[{optional.EXTRAS[package]}]'" in lines[0]
    assert not (tmp_path / "w.safetensors").exists() and not (tmp_path / "tb").exists()


URL_CASES = [  # every command that takes a checkpoint URL, s3fs not installed
    ["train", "--checkpoint-dir", "s3://bucket/ckpt"],
    ["launch", "--checkpoint-dir", "s3://bucket/ckpt"],
    ["train", "--init-from", "s3://bucket/w.pt"],
    ["train", "--resume", "s3://bucket/ckpt/step-5.pt"],
    ["ckpt", "inspect", "s3://bucket/ckpt/step-5.pt"],
    ["ckpt", "convert", "w.pt", "s3://bucket/w-dcp", "--to", "dcp"],
]


@pytest.mark.parametrize("argv", URL_CASES, ids=[" ".join(a[:2]) for a in URL_CASES])
def test_a_url_without_s3fs_is_one_line_naming_the_s3_extra(tmp_path, argv):
    weights_file(tmp_path)
    proc = without("s3fs", tmp_path, argv)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "s3://bucket/" in lines[0] and "pip install 'ddpjob[s3]'" in lines[0], lines[0]
    assert not (tmp_path / "s3:").exists()
