"""The suite's own scheduling: under `pytest -n 2 --dist loadgroup` (make process-parallel), the tests
that share a module-scoped fixture (a reference run, a server) run on one worker, so the fixture is
made once; under make process-serial, `serial` tests run two at a time and an `alone` one with none
beside it (tests/conftest.py). Each is run on a small suite of its own, with the hooks of
tests/conftest.py."""

import subprocess
import sys
from pathlib import Path

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
pytest_runtest_protocol = suite.pytest_runtest_protocol


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: races a deadline")
    config.addinivalue_line("markers", "alone: measures a speed")
"""

TIMED = """
import time
import pytest

def timed(name):
    start = time.monotonic()
    time.sleep(0.4)
    with open("spans", "a") as f:
        f.write(f"{name} {start} {time.monotonic()}\\n")

@pytest.mark.serial
@pytest.mark.parametrize("i", [pytest.param(i, marks=[pytest.mark.alone] if i % 4 == 1 else []) for i in range(11)])
def test_probe(request, i):
    timed(("alone" if request.node.get_closest_marker("alone") else "pair") + str(i))
"""


def pytest_run(tmp_path: Path, probe: str, *flags: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_probe.py").write_text(probe)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    args = [sys.executable, "-m", "pytest", "-q", *flags, "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    return subprocess.run([*args, "test_probe.py"], cwd=tmp_path, capture_output=True, text=True)


def test_tests_sharing_a_module_fixture_run_on_one_worker_and_make_it_once(tmp_path):
    proc = pytest_run(tmp_path, PROBE, "-n", "2", "--dist", "loadgroup")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "12 passed" in proc.stdout, proc.stdout[-3000:]
    assert len((tmp_path / "setups").read_text().split()) == 1  # one worker made it, once


def test_serial_tests_run_two_at_a_time_and_an_alone_test_with_none_beside_it(tmp_path):
    proc = pytest_run(tmp_path, TIMED, "-n", "2", "--dist", "loadgroup")
    assert proc.returncode == 0 and "11 passed" in proc.stdout, proc.stdout[-3000:]
    spans = {
        name: (float(a), float(b))
        for name, a, b in (ln.split() for ln in (tmp_path / "spans").read_text().splitlines())
    }

    def overlap(x: str, y: str) -> bool:
        return spans[x][0] < spans[y][1] and spans[y][0] < spans[x][1]

    beside_alone = [(x, y) for x in spans if x.startswith("alone") for y in spans if y != x and overlap(x, y)]
    assert beside_alone == []
    assert any(overlap(x, y) for x in spans for y in spans if x < y)  # the others did run two at a time


def test_a_test_marked_alone_but_not_serial_is_a_usage_error(tmp_path):
    probe = "import pytest\n\n@pytest.mark.alone\ndef test_measure():\n    pass\n"
    proc = pytest_run(tmp_path, probe)
    assert proc.returncode == 4 and "marked alone but not serial" in proc.stdout + proc.stderr, proc.stdout[-2000:]
