"""The unit tier runs in this process: a test that starts a process fails, and belongs in tests/process;
a test that writes into the checkout (a run dir made in the current directory) fails too."""

import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

from ddpjob.launch import worker_fork


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a unit test started a process: move it to tests/process/")


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
    monkeypatch.setattr(os, "fork", _refuse)
    monkeypatch.setattr(os, "posix_spawn", _refuse)
    # launch runs the user's code in a fork where it forks its workers (tests/process/test_worker_fork.py)
    monkeypatch.setattr(worker_fork, "checked_apart", worker_fork.run_here)


DEFAULT_RUN_DIR = Path(__file__).resolve().parents[2] / "runs" / "ddpjob"


@pytest.fixture(autouse=True)
def nothing_written_in_the_checkout() -> object:
    """pytest runs in the checkout's root, where a job's default --run-dir (runs/ddpjob) would land."""
    there = DEFAULT_RUN_DIR.exists()
    yield
    assert there or not DEFAULT_RUN_DIR.exists(), (
        f"the test made {DEFAULT_RUN_DIR} in the checkout: run it in tmp_path (monkeypatch.chdir)"
    )
