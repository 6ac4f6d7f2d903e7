"""tests/starter.py: a command forked from the starter is what an exec'd `python -m ddpjob` would be, and
ends as it would; run() returns or times out as subprocess.run does. Each row compares the fork with
the same command exec'd (helpers.ddpjob's ``fresh``): the expectation is python's, not a list kept here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.plugins.starter_probe import ENDINGS

import starter
from helpers import alive, clean_env, ddpjob, spawn, wait_until
from ports import free_port

pytestmark = pytest.mark.slow


TEST = {"TEST_PID": str(os.getpid())}  # the probe compares its session and process group with the test's


def both(args: list[str], work, **env: str) -> dict[bool, subprocess.CompletedProcess[str]]:
    """The command exec'd (True) and forked from the starter (False), each in a folder of its own."""
    runs = {}
    for fresh in (True, False):
        cwd = work / ("exec" if fresh else "fork")
        cwd.mkdir()
        runs[fresh] = ddpjob([arg.format(cwd=cwd) for arg in args], cwd, fresh=fresh, **TEST, **env)
    return runs


def state_of(cwd: Path, **env: str) -> dict:
    """The state the probe recorded as a one-step run's data was made, run in cwd."""
    out = cwd / "state.json"
    data = f"tests.plugins.starter_probe:state(out={str(out)!r})"
    proc = ddpjob(["train", "--max-steps", "1", "--save-every", "0", "--data", data], cwd, **TEST, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_forked_command_starts_as_an_exec_d_one_would(work):
    """argv, __main__, sys.path, cwd, environment, signal handlers (before ddpjob's), mask and wakeup
    fd, descriptors, streams, threads (python's, the OS's, torch's), session and process group (the
    test's), umask, flags: the same; random draws not."""
    data = "tests.plugins.starter_probe:state(out='{cwd}/state.json')"
    runs = both(["train", "--max-steps", "1", "--save-every", "0", "--data", data], work)
    for fresh, proc in runs.items():
        assert proc.returncode == 0, (fresh, proc.stderr[-3000:])
    execd, forked = (  # where each ran, its own folder, named "cwd"
        json.loads((work / how / "state.json").read_text().replace(str(work / how), "cwd")) for how in ("exec", "fork")
    )
    assert execd["cwd"] == "cwd" and execd["path"][0] == "cwd" and execd["session"] == [True, True]
    assert execd["main"] == ["ddpjob.__main__", "__main__.py"] and execd["stdio"][1:] == ["pipe", "pipe"]
    assert execd["handlers"][str(int(signal.SIGTERM))] == "SIG_DFL"  # before ddpjob's own
    # python's own, unless the tests run with SIGINT ignored (started with & by a shell without job
    # control), where the KeyboardInterrupt row below could not tell a fork from an exec
    assert execd["handlers"][str(int(signal.SIGINT))] == "default_int_handler", execd["handlers"]
    assert forked.pop("forked") and not execd.pop("forked")  # each ran as it says
    draws = execd.pop("draws"), forked.pop("draws")
    execd.pop("hash"), forked.pop("hash")  # a fork hashes with its starter's seed (tests/starter.py)
    assert all(a != b for a, b in zip(*draws, strict=True)), draws  # python's, numpy's, torch's: seeded anew
    for key in execd:
        assert forked[key] == execd[key], key


def test_a_rank_started_by_hand_tears_down_as_an_exec_d_one_and_other_commands_skip_the_teardown(work):
    """Where ddpjob reads its environment as a rank (RANK here), a forked command ends through the
    interpreter's teardown, as a rank torchrun or srun starts does (an object freed late would abort
    there); any other ends as a forked worker does, without it."""
    data = "tests.plugins.starter_probe:kept_till_teardown"
    args = ["train", "--max-steps", "1", "--save-every", "0", "--data", data]
    ends = {}
    for name, fresh, port in [("exec", True, free_port()), ("fork", False, free_port()), ("plain", False, None)]:
        cwd = work / name
        cwd.mkdir()
        rank = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if port else {}
        proc = ddpjob(args, cwd, fresh=fresh, **rank)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ends[name] = "torn down" in proc.stderr
    assert ends == {"exec": True, "fork": True, "plain": False}


@pytest.mark.parametrize("how", ENDINGS)
def test_a_forked_command_ends_as_an_exec_d_one_would(work, how, monkeypatch):
    # stdout a pipe's buffer, as a user's is (a starter of its own)
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    runs = both(["train", "--data", f"tests.plugins.starter_probe:ending(how={how!r})"], work)
    execd, forked = runs[True], runs[False]
    assert f"ending: {how}" in execd.stdout, execd.stderr[-3000:]  # it ran, and ended as it says
    assert "did not end the process" not in execd.stderr, execd.stderr[-3000:]
    assert "forked: True" in forked.stderr and "forked: False" in execd.stderr
    code = ENDINGS[how][1]
    assert code is None or execd.returncode == code, (execd.returncode, execd.stderr[-3000:])
    assert forked.returncode == execd.returncode, (forked.returncode, execd.returncode, forked.stderr[-3000:])
    assert forked.stdout == execd.stdout
    last = [
        [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("forked: ")][-1:] for proc in runs.values()
    ]
    assert last[0] == last[1], last


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_started_command_is_signalled_waited_for_and_read_as_a_popen_one_would_be(work, sig):
    """helpers.spawn's fork (starter.Started) against the same command exec'd (subprocess.Popen): its
    pid is the command's; poll, wait and communicate with a timeout say it runs; a signal in its set-up
    ends it with the same exit code and last line (TERM is kept until training checks for a stop)."""
    ends = {}
    for fresh in (True, False):
        cwd = work / ("exec" if fresh else "fork")
        cwd.mkdir()
        pid_file = cwd / "pid"
        model = f"tests.plugins.starter_probe:sleeper(pid_file={str(pid_file)!r}, seconds=2)"
        proc = spawn(["train", "--model", model], cwd, fresh=fresh, **TEST)
        try:
            wait_until(pid_file.exists, 60, "the model factory")
            pid, forked = pid_file.read_text().split()
            assert (int(pid), forked) == (proc.pid, str(not fresh))
            assert proc.poll() is None
            for timeout in (0, 0.1):
                with pytest.raises(subprocess.TimeoutExpired):
                    proc.wait(timeout=timeout)
            with pytest.raises(subprocess.TimeoutExpired):
                proc.communicate(timeout=0.1)
            proc.send_signal(sig)
            out = proc.communicate(timeout=60)[0]
        finally:
            proc.kill()
        last = out.replace(str(cwd), "cwd").strip().splitlines()[-1:]  # each ran in a folder of its own
        ends[fresh] = (proc.returncode, proc.poll(), proc.wait(), last)
    assert ends[True] == ends[False], ends
    assert ends[True][0] == (-signal.SIGKILL if sig == signal.SIGKILL else 75), ends  # kept, then a stop


def test_a_started_command_writes_to_a_file_as_a_popen_one_would(work):
    """spawn(stdout=FILE): stdout and stderr both in the file, nothing to read, the same exit code."""
    ends = {}
    for fresh in (True, False):
        log = work / f"{fresh}.log"
        with open(log, "w") as out:
            proc = spawn(["config", "--epochs", "0"], work, fresh=fresh, stdout=out)  # bad input: exit 2
        ends[fresh] = (proc.communicate(timeout=60), proc.returncode, log.read_text())
    assert ends[True] == ends[False], ends
    assert ends[True][1] == 2 and "ddpjob: error: --epochs" in ends[True][2], ends


def test_a_second_draw_in_one_test_differs_too(work):
    """Two forked commands of one test process are seeded anew each (not the starter's state)."""
    states = []
    for n in range(2):
        (work / str(n)).mkdir()
        states.append(state_of(work / str(n)))
    assert states[0]["forked"] and states[1]["forked"]
    assert all(a != b for a, b in zip(states[0]["draws"], states[1]["draws"], strict=True)), states


def test_a_command_past_its_timeout_is_killed_and_raises_timeout_expired_as_subprocess_run_does(work):
    pid_file = work / "pid"
    model = f"tests.plugins.starter_probe:sleeper(pid_file={str(pid_file)!r})"
    ddpjob(["config"], work)  # the starter started: its time is not the command's
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        ddpjob(["train", "--model", model], work, timeout=10)
    assert time.monotonic() - started < 10 + 10
    assert isinstance(expired.value.stdout, bytes)  # as communicate() leaves it, text or not
    pid, forked = pid_file.read_text().split()
    assert forked == "True"
    deadline = time.monotonic() + 10
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(int(pid)), "the command outlived its timeout"


@pytest.mark.parametrize("fresh", [True, False], ids=["exec", "fork"])
def test_a_child_left_holding_the_commands_output_makes_it_time_out_as_with_subprocess_run(work, fresh):
    """communicate() reads stdout and stderr to their end: a child that keeps them open holds the test
    until its timeout, forked or exec'd, instead of returning with half the output."""
    pid_file = work / "pid"
    model = f"tests.plugins.starter_probe:pipe_holder(pid_file={str(pid_file)!r})"
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            ddpjob(["train", "--model", model], work, timeout=20, fresh=fresh)
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
    assert pid_file.read_text().split()[1] == str(not fresh)  # it got as far as its child within the timeout


def test_a_start_up_variable_of_its_own_makes_a_command_exec_d(tmp_path):
    """Read as python or torch start (also from an env file, which ddpjob exports before torch loads):
    a fork would run with the starter's value instead."""
    base = clean_env()
    assert starter.kind_of(["train"], tmp_path, base, base) == "plain"
    assert starter.kind_of(["launch", "--nproc-per-node", "2"], tmp_path, base, base) == "launch"
    assert starter.kind_of(["train"], tmp_path, {**base, "AWS_ENDPOINT_URL": "http://x"}, base) == "plain"
    for name in ("PYTHONHASHSEED", "OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL", "TZ", "TMP", "GOMP_SPINCOUNT"):
        changed = {**base, name: base.get(name, "") + "1"}
        assert starter.kind_of(["train"], tmp_path, changed, base) is None, name
    assert starter.kind_of(["launch"], tmp_path, {**base, "TORCH_CPP_LOG_LEVEL": "INFO"}, base) is None
    assert starter.kind_of(["launch"], tmp_path, {**base, "TORCH_CPP_LOG_LEVEL": "ERROR"}, base) == "launch"
    assert starter.kind_of(["train", "--env-file", "x.env"], tmp_path, base, base) is None
    assert starter.kind_of(["train"], tmp_path, {**base, "DDPJOB_ENV_FILE": "x.env"}, base) is None
    (tmp_path / ".env").write_text("OMP_NUM_THREADS=2\n")
    assert starter.kind_of(["train"], tmp_path, base, base) is None


def test_a_hash_seed_of_its_own_is_the_commands(work):
    """PYTHONHASHSEED set for one command: exec'd, so it hashes as python does with that seed (a fork
    would hash with the starter's: the one limit of forked commands, which tests/starter.py names)."""
    env = clean_env(PYTHONHASHSEED="7")
    python = subprocess.run([sys.executable, "-c", "print(hash('ddpjob'))"], env=env, capture_output=True, text=True)
    assert state_of(work, PYTHONHASHSEED="7")["hash"] == int(python.stdout)


def test_a_launch_is_forked_from_the_starter_whose_torch_loaded_under_launchs_log_level(work):
    """launch sets TORCH_CPP_LOG_LEVEL=ERROR only while torch loads (cli._launch): its own starter
    holds that, and the command, like launch's workers, has the environment without it."""
    out = work / "state.json"
    data = f"tests.plugins.starter_probe:state(out={str(out)!r})"
    proc = ddpjob(["launch", "--nproc-per-node", "1", "--max-steps", "1", "--data", data], work, **TEST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads(out.read_text())
    assert state["forked"] and "TORCH_CPP_LOG_LEVEL" not in state["environ"]
    launch_starter = starter._STARTERS[starter.starter_key("launch", clean_env())][0]
    environ = Path(f"/proc/{launch_starter.pid}/environ").read_bytes().split(b"\0")
    assert b"TORCH_CPP_LOG_LEVEL=ERROR" in environ
