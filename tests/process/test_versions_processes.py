"""The torch version check: `ddpjob train` and `ddpjob launch` refuse an older torch in one line, exit 2.

(The tests of test_versions.py that start processes.)
"""

import subprocess

import pytest

from ddpjob import versions
from helpers import PY, clean_env

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
