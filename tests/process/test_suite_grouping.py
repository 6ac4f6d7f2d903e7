"""The suite's own scheduling: under `pytest -n 2 --dist loadgroup` (make process-parallel), the tests
that share a module-scoped fixture (a reference run, a server) run on one worker, so the fixture is
made once (tests/conftest.py). Run on a small suite of its own, with the hook of tests/conftest.py."""

import subprocess
import sys

from helpers import REPO

PROBE = """
import os
import pytest

@pytest.fixture(scope="module")
def shared():
    with open("setups", "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_shares(shared, i):
    pass

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass
"""

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {str(REPO / "tests/conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
"""


def test_tests_sharing_a_module_fixture_run_on_one_worker_and_make_it_once(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    args = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*args, "--rootdir", str(tmp_path), "test_probe.py"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "12 passed" in proc.stdout, proc.stdout[-3000:]
    assert len((tmp_path / "setups").read_text().split()) == 1  # one worker made it, once
