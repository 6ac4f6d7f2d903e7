"""The torch version check: `ddpjob train` and `ddpjob launch` refuse an older torch in one line, exit 2."""

import re
from pathlib import Path

import pytest

from ddpjob import versions
from ddpjob.errors import UsageError
from helpers import REPO


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
