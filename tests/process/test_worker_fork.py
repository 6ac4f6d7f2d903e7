"""Forked workers (launch/worker_fork.py): a fork of launch starts as an exec'd ``python -u`` would, ends
as it would, and launch itself runs none of the user's code.

The rows compare the fork with an exec'd worker started by the same launch-like process
(tests/plugins/fork_probe.py): the expectation is what python itself does, not a list kept here.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from tests.plugins.fork_probe import EXIT_ROWS

from helpers import PY, assert_bitwise_equal, clean_env, ddpjob, final_params, launched, ok, trained_steps, wait_until


def probe(mode: str, out: Path, timeout: float = 240) -> None:
    """The launch-like process in MODE, started as a user starts launch: no OMP_NUM_THREADS (torch's
    default count), and buffered (the worker must be unbuffered as `python -u` is, C's stdio too)."""
    env = clean_env()
    env.pop("OMP_NUM_THREADS")
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.run(
        [PY, "-m", "tests.plugins.fork_probe", mode, str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_forked_worker_starts_as_an_exec_d_python_would(work):
    """Signals (handlers, mask, wakeup fd), descriptors, environment, argv, sys.path[0], unbuffered
    streams, torch's threads and python's, its own session: the same as an exec'd worker's."""
    probe("state", work)
    forked, execd = (json.loads((work / f"{how}.json").read_text()) for how in ("fork", "exec"))
    assert forked.pop("comm") == "ddpjob-r1"  # what ps and top show for a forked worker of rank 1
    execd.pop("comm")
    assert forked.pop("argv0") == "__main__.py"  # python -m ddpjob's (the probe's is its own file)
    execd.pop("argv0")
    for how, state in (("fork", forked), ("exec", execd)):
        assert state.pop("argv") == ["train", str(work / f"{how}.json")]
    # launch's stream handler moved onto the worker's stderr (an exec'd worker has none); torch's own the same
    assert sorted([*execd.pop("log_handlers"), "StreamHandler:2"]) == forked.pop("log_handlers")
    # what launch loaded (torch) is frozen in a fork: no collection of the worker writes to it and copies its pages
    assert forked.pop("frozen") > 50_000 and execd.pop("frozen") == 0
    assert forked["launchs_descriptors"] == [] and forked["handlers"]["SIGTERM"] == "SIG_DFL"
    assert forked["handlers"]["SIGINT"] == "default_int_handler" and forked["own_session"]
    for key in execd:
        assert forked[key] == execd[key], key


def test_forked_workers_draw_their_own_random_numbers_before_ddpjob_seeds(work):
    """Each exec'd process seeds torch's and numpy's generators from the OS: a user's data factory that
    draws before ddpjob seeds gets other numbers on every rank. Forks of launch must too."""
    calls = work / "calls"
    flags = ["--worker-start", "fork", "--device", "cpu", "--max-steps", "1", "--save-every", "0"]
    flags += ["--model", "ddpjob.plugins:synthetic_mlp(width=64)"]
    ok(launched([*flags, "--data", "tests.plugins.rank_data:seeds_drawn"], work, TEST_DATA_CALLS=str(calls)))
    drawn = dict(line.split(" ", 1) for line in calls.read_text().splitlines())
    assert sorted(drawn) == ["0", "1"], drawn
    torch_draws, numpy_draws = zip(*(draw.split() for draw in drawn.values()), strict=True)
    assert len(set(torch_draws)) == 2 and len(set(numpy_draws)) == 2, drawn


def test_a_forked_worker_ends_as_an_exec_d_python_would(work):
    """Exit codes of returns, SystemExit, errors, Ctrl-C and signals; the last line of stderr;
    non-daemon threads joined before atexit; daemonic multiprocessing children ended."""
    probe("exits", work)
    rows = json.loads((work / "exits.json").read_text())
    assert rows.keys() == EXIT_ROWS.keys()
    for name, row in rows.items():
        assert row["fork"] == row["exec"], (name, row)
    assert rows["interrupted"]["fork"][0] == -signal.SIGINT and rows["exit 300"]["fork"][0] == 300 & 0xFF
    assert rows["thread then atexit"]["fork"][1] == "thread\natexit\n"


def test_a_sigint_as_a_forked_worker_starts_ends_it_by_sigint(work):
    """Ctrl-C while launch starts its workers: each dies by SIGINT, as an exec'd python does, never
    with another code (a KeyboardInterrupt escaping the start would read as a failure)."""
    probe("sigint", work)
    assert set(json.loads((work / "sigint.json").read_text())) == {-signal.SIGINT}


def test_launchs_checks_run_apart_and_only_their_answer_comes_back(work):
    """A value; a ddpjob error as itself; a user's error as one RuntimeError with its traceback; a check
    that dies or whose value cannot travel; a process it leaves holding the pipe does not hold launch;
    the modules it imports and the object stores are not launch's."""
    probe("checks", work)
    got = json.loads((work / "checks.json").read_text())
    assert got["value"]["value"] == "{'plan': 42}"
    assert (got["ddpjob error"]["error"], got["ddpjob error"]["message"]) == ("UsageError", "--data is bad")
    assert (got["exit 2"]["error"], got["exit 2"]["message"]) == ("SystemExit", "2")  # exits 2, as it did
    users = got["user's error"]
    assert users["error"] == "RuntimeError" and users["message"] == "UsersError: the user's data is missing"
    assert "_raise_users_error" in users["notes"][0]  # the check's traceback
    assert got["unpicklable value"]["error"] == "RuntimeError" and "pickle" in got["unpicklable value"]["message"]
    assert got["died"]["error"] == "RuntimeError" and "exit code 3 and no answer" in got["died"]["message"]
    assert got["left a process"]["value"] == "7" and got["left a process"]["seconds"] < 10
    assert got["imports"]["value"] == "True" and got["launch imported"]["value"] == "False"
    assert got["stores"]["value"] == "0" and got["launch's stores"]["value"] == "1"


def test_a_forked_job_trains_bitwise_as_an_exec_d_one_and_only_workers_import_the_users_code(work):
    """Same parameters either way; the model's module is imported by launch's check and by each worker,
    never by launch itself (what a module does as it loads would be every forked worker's)."""
    job = ["--device", "cpu", "--epochs", "2", "--log-every", "1000", "--seed", "3"]
    model = ["--model", "tests.plugins.imported_by:digits_mlp"]
    for how in ("fork", "exec"):
        out = work / f"imports-{how}"
        out.mkdir()
        run = ["launch", "--nproc-per-node", "2", "--worker-start", how, "--run-dir", how, *job, *model]
        proc = ddpjob(run, work, timeout=300, TEST_IMPORTS_DIR=str(out))
        assert f"2 proc/node ({'forked' if how == 'fork' else 'exec'})" in ok(proc)
    assert_bitwise_equal(final_params(work / "fork"), final_params(work / "exec"))
    importers = [json.loads(p.read_text()) for p in (work / "imports-fork").iterdir()]
    launch_pid = {i["parent"] for i in importers if i["rank"] is not None}
    assert len(launch_pid) == 1 and launch_pid.pop() not in {i["pid"] for i in importers}
    assert sorted(i["rank"] for i in importers if i["rank"] is not None) == ["0", "1"]


def test_a_launch_that_inherited_an_ignored_sigchld_still_reads_its_workers_exit_codes(work):
    """With SIGCHLD ignored the kernel reaps children itself: the workers' exit codes would be lost.
    A finished job exits 0, and a stopped one 75."""
    job = [PY, "-m", "ddpjob", "launch", "--nproc-per-node", "2", "--device", "cpu", "--log-every", "1000"]

    def launch(*args: str) -> subprocess.Popen[str]:
        ignore = lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # noqa: E731
        return subprocess.Popen(
            [*job, *args],
            cwd=work,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=ignore,
        )

    finished = launch("--max-steps", "3", "--run-dir", "finished")
    assert finished.wait(180) == 0, finished.communicate()[1][-3000:]
    stopped = launch("--epochs", "50", "--run-dir", "stopped", "--log-every", "10")
    try:
        wait_until(lambda: trained_steps(work / "stopped") > 0, 120, "training")
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(120) == 75, stopped.communicate()[1][-3000:]
    finally:
        stopped.kill()
        stopped.communicate()


def test_fork_where_a_worker_may_use_cuda_is_bad_input(work):
    proc = ddpjob(["launch", "--worker-start", "fork", "--device", "cuda", "--dry-run"], work)
    assert proc.returncode == 2 and "does not survive a fork" in proc.stderr and "Traceback" not in proc.stderr
