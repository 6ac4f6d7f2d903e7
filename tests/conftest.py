"""Shared fixtures; helpers that tests import live in helpers.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """An empty working directory for a job's runs/."""
    return tmp_path
