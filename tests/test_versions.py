"""The torch version check: `ddpjob train` and `ddpjob launch` refuse an older torch in one line, exit 2."""

import re
import subprocess
from pathlib import Path

import pytest

from ddpjob import versions
from ddpjob.errors import UsageError
from helpers import PY, REPO, clean_env

# A child process whose torch says it is an old release, then the real CLI entry point.
OLD_TORCH = (
    "import sys, torch; torch.__version__ = sys.argv[1]; from ddpjob.cli import main; sys.exit(main(sys.argv[2:]))"
)


@pytest.mark.parametrize("command", [["train", "--epochs", "1"], ["launch", "--epochs", "1"]])
@pytest.mark.parametrize("old", ["2.7.1+cu128", "2.11.0"])
def test_train_and_launch_refuse_an_older_torch_in_one_line(tmp_path, command, old):
    proc = subprocess.run(
        [PY, "-c", OLD_TORCH, old, *command], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"ddpjob: error: ddpjob needs torch >= 2.12, found {old}; install a newer one (pip install 'torch>=2.12') "
        f"or use an image that has one (e.g. {versions.CUDA_IMAGE})"
    ]
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.parametrize("found", ["2.12.0", "2.13.0+cpu", "2.12.0a0+git1234abc", "2.14.1+cu130", "3.0.0"])
def test_this_torch_and_newer_ones_pass(found):
    versions.check_torch(found)


@pytest.mark.parametrize("found", ["2.11.0", "2.9.1+cu128", "1.13.1", "unknown"])
def test_older_or_unreadable_versions_fail(found):
    with pytest.raises(UsageError, match=re.escape(f"found {found};")):
        versions.check_torch(found)


def test_the_installed_torch_passes():
    versions.check_torch()


def test_pyproject_the_images_and_the_check_agree_on_the_minimum():
    need = ".".join(map(str, versions.MIN_TORCH))
    assert re.search(rf'^\s*"torch>={re.escape(need)}",', (REPO / "pyproject.toml").read_text(), re.M)
    image = versions.CUDA_IMAGE
    tag_torch = versions.release(image.split(":")[1])
    assert tag_torch is not None and tag_torch >= versions.MIN_TORCH
    for path in ["docker/Dockerfile", "compose.gpu.yaml", "README.md"]:
        text = Path(REPO / path).read_text()
        assert image in text, path
        for old in re.findall(r"pytorch/pytorch:(\d+\.\d+)", text):
            assert versions.release(old) >= versions.MIN_TORCH, f"{path} names pytorch/pytorch:{old}"
