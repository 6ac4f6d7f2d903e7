"""Shared fixtures, and the `serial` mark; helpers that tests import live in helpers.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


# Files whose tests time a rank, a link or a deadline, or take fixed network-namespace names: `make
# unit` runs them alone, after the rest has run two at a time (pytest-xdist).
SERIAL = {
    "test_diagnose.py",
    "test_dirlock.py",
    "test_elastic.py",
    "test_faults.py",
    "test_launch.py",
    "test_launch_signals.py",
    "test_operator_tools.py",
    "test_phases.py",
    "test_preflight.py",
    "test_shared_checkpoint_dir.py",
    "test_slurm_launch.py",
    "test_stragglers.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """An empty working directory for a job's runs/."""
    return tmp_path
