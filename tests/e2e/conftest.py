"""Fixtures for the end-to-end tests: the Docker engine and Slurm cluster that provision.sh started.

These tests fail, never skip, when what they need is missing: run `make e2e` (root) to provision.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from e2e import IMAGE, STATE


@pytest.fixture(scope="session")
def docker_env() -> dict[str, str]:
    env = {
        **os.environ,
        "DOCKER_HOST": f"unix://{STATE}/docker.sock",
        "DOCKER_CONFIG": str(STATE / "docker-config"),
        "DOCKER_BUILDKIT": "0",
        "DDPJOB_IMAGE": IMAGE,  # the image compose.yaml runs (${DDPJOB_IMAGE:-ddpjob:cpu})
    }
    probe = subprocess.run(["docker", "image", "inspect", IMAGE], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(
            f"no Docker engine with {IMAGE} at {env['DOCKER_HOST']}; run `make e2e` as root: {probe.stderr.strip()}"
        )
    return env


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    env = {**os.environ, "SLURM_CONF": str(STATE / "slurm/slurm.conf")}
    probe = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.count("idle") < 2:
        pytest.fail(f"no 2-node Slurm cluster is up; run `make e2e` as root: {probe.stdout}{probe.stderr}")
    return env
