"""The stop-path table. Invariant: `ddpjob launch` exits 75 ("stopped with a checkpoint, requeue me")
if and only if a verified checkpoint of the step where training stopped exists; any other exit
code comes with a last line that says what was lost, and attempts.jsonl's last record agrees.

Rows are generated from the code: each signal of ``preempt.STOP_SIGNALS`` (what the workers stop
on and what launch has torchrun forward) and TERM sent twice, crossed with where it is sent (to
`ddpjob launch`, to one worker), how the stop's save goes (succeeds; fails on a full disk with
--on-save-error warn; the same with fail; slower than --save-timeout) and the checkpoint format
(file, dcp). The full product, 6 x 2 x 4 x 2 = 96 runs of a two-worker job, is too slow for two
cores: the table walks a pairwise cover of it (every pair of values of any two columns is in some
row; every signal, place, save outcome and format appears), 24 rows with today's five signals.
Besides the table: a signal while the workers set up (nothing trained: not 75) and one after
training finished (exit 0 stays 0), for every handled signal.

Which rows are `serial` (apart from the parallel tier's load): those that race a deadline (a save
slower than --save-timeout, a seal just inside or after it, a signal during the final evaluation
against --shutdown-timeout). The others hold whatever the machine's load, which only moves the step a
signal lands on, and run in the parallel tier; the signal during set-up lands there because the workers' data takes 5 s to build.
"""

import contextlib
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ddpjob.checkpoint import catalogue
from ddpjob.launch import worker_fork
from ddpjob.train.stop_signal import STOP_SIGNALS
from helpers import (
    PYTHONPATH,
    alive,
    ddpjob,
    in_every_worker,
    injected_ranks,
    rank_of,
    records,
    spawn,
    trained_steps,
    wait_until,
    workers_of,
)

pytestmark = pytest.mark.slow

SIGNALS = [*(s.name for s in STOP_SIGNALS), "SIGTERM twice"]
PLACES = ["launch", "one worker"]
SAVES = ["ok", "full disk, warn", "full disk, fail", "slower than --save-timeout"]
FORMATS = ["file", "dcp"]
STARTS = list(worker_fork.SETTINGS[1:])  # fork, exec: how launch starts its workers (auto is fork here)


def pairwise(*columns: Sequence[str]) -> list[tuple[str, ...]]:
    """Rows of the product of columns, chosen greedily until every pair of values of any two
    columns is in a row (the first column's values in order, for a readable table)."""
    pairs = {
        ((i, a), (j, b))
        for i, j in itertools.combinations(range(len(columns)), 2)
        for a in columns[i]
        for b in columns[j]
    }

    def covers(row: tuple[str, ...]) -> set:
        return {((i, row[i]), (j, row[j])) for i, j in itertools.combinations(range(len(row)), 2)} & pairs

    rows = []
    candidates = list(itertools.product(*columns))
    while pairs:
        best = max(candidates, key=lambda row: len(covers(row)))
        rows.append(best)
        pairs -= covers(best)
    return sorted(rows, key=lambda row: [list(c).index(v) for c, v in zip(columns, row, strict=True)])


TABLE = pairwise(SIGNALS, PLACES, SAVES, FORMATS, STARTS)


def test_the_table_holds_every_pair_of_values_of_any_two_columns():
    columns = (SIGNALS, PLACES, SAVES, FORMATS, STARTS)
    for i, j in itertools.combinations(range(len(columns)), 2):
        assert {(row[i], row[j]) for row in TABLE} == set(itertools.product(columns[i], columns[j]))
    assert len(TABLE) == len(SIGNALS) * len(SAVES)  # the least a pairwise cover can be: 24 with five signals


def job(save: str, fmt: str, start: str = "auto") -> list[str]:
    slow = races_a_deadline(save)
    return [
        "--device",
        "cpu",
        "--worker-start",
        start,
        "--nproc-per-node",
        "2",
        "--model",
        f"tests.plugins.slow_save:model(seconds={10 if slow else 0},width=256)",
        "--data",
        "ddpjob.plugins:synthetic(samples=8192)",
        "--epochs",
        "3",
        "--log-every",
        "5",
        "--save-every",
        "0",
        "--stop-check-every",
        "5",
        "--checkpoint-format",
        fmt,
        "--on-save-error",
        "warn" if save.endswith("warn") else "fail",
        *(["--save-timeout", "3"] if slow else []),
    ]


@contextlib.contextmanager
def full_disk(directory: Path) -> Iterator[None]:
    """A 64 KiB tmpfs over directory: every checkpoint write fails with ENOSPC."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def send(pid: int, name: str) -> None:
    sig = signal.Signals[name.split()[0]]
    for _ in range(2 if name.endswith("twice") else 1):
        os.kill(pid, sig)
        time.sleep(0.3)


def verified_steps(directory: Path) -> list[int]:
    """Steps of the checkpoints in directory that pass the project's own integrity check."""
    return [step for step, path in catalogue.list_steps(directory) if catalogue.verify(path) is None]


def last_line(out: str) -> str:
    return [line for line in out.splitlines() if line.strip()][-1]


def attempts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]


def assert_invariant(code: int, out: str, run_dir: Path, saved: list[int]) -> None:
    stops = [r["step"] for r in records(run_dir) if r["event"] == "preempted"]
    assert (code == 75) == bool(saved), f"exit {code} with verified checkpoints {saved}\n{out[-3000:]}"
    if code == 75:
        assert saved == stops, (saved, stops)  # the checkpoint is of the step where training stopped
    else:
        assert "lost" in last_line(out), f"exit {code}: the last line does not say what was lost\n{out[-3000:]}"
    end = attempts(run_dir)[-1]
    assert end["event"] == "end" and end["exit_code"] == code, end
    assert code == 0 or end["reason"] in last_line(out), (end, last_line(out))


def races_a_deadline(save: str) -> bool:
    return save.startswith("slower")


@pytest.mark.parametrize(
    ("sig", "place", "save", "fmt", "start"),
    [pytest.param(*row, marks=[pytest.mark.serial] if races_a_deadline(row[2]) else []) for row in TABLE],
    ids=[" / ".join(row) for row in TABLE],
)
def test_exit_75_if_and_only_if_the_stop_step_has_a_verified_checkpoint(work, sig, place, save, fmt, start):
    if save.startswith("full disk") and os.geteuid() != 0:
        pytest.skip("mounts a tmpfs (root)")
    run_dir = work / "runs/ddpjob"
    ckpt = run_dir / "checkpoints"
    agent = spawn(["launch", *job(save, fmt, start)], work)
    try:
        wait_until(lambda: trained_steps(run_dir) >= 10, 180, "training to start")
        workers = workers_of(agent.pid)
        assert len(workers) == 2, workers
        target = agent.pid if place == "launch" else next(pid for pid in workers if rank_of(pid) == 1)
        with full_disk(ckpt) if save.startswith("full disk") else contextlib.nullcontext():
            send(target, sig)
            out = agent.communicate(timeout=240)[0]
            saved = verified_steps(ckpt)
        assert not [pid for pid in workers if alive(pid)], "workers outlived launch"
        assert_invariant(agent.returncode, out, run_dir, saved)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_a_stop_signal_while_the_workers_set_up_is_not_75(work, sig):
    run_dir = work / "runs/ddpjob"
    args = job("ok", "file")  # its data takes 5 s to build: the signal lands in set-up, under any load
    args[args.index("--data") + 1] = "tests.plugins.stalls:slow_to_build(seconds=5)"
    agent = spawn(["launch", *args], work)
    wait_until(lambda: len(workers_of(agent.pid)) == 2, 120, "the workers to start")
    agent.send_signal(sig)
    out = agent.communicate(timeout=180)[0]
    assert_invariant(agent.returncode, out, run_dir, verified_steps(run_dir / "checkpoints"))
    assert agent.returncode != 75 and not trained_steps(run_dir), out[-3000:]


def test_a_set_up_that_fails_under_repeated_stop_signals_keeps_its_exit_code(work, tmp_path):
    """A stop signal in set-up is kept (a checkpoint load can take minutes), but when set-up then fails,
    the exit code is the failure's: CPython puts back each handled signal's default action as it exits,
    and a signal repeated then (Slurm, train.sbatch's forward) must not turn exit 2 into a death."""
    called = tmp_path / "called"
    proc = spawn(["train", "--model", "tests.plugins.failing:slow_to_fail(seconds=1)"], work, CALLED=str(called))
    wait_until(called.exists, 120, "the model factory to be called")
    sent = 0
    while proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.002)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 2, (proc.returncode, sent, out[-3000:])
    assert "ddpjob: error: model factory 'tests.plugins.failing:slow_to_fail(seconds=1)' returned tuple" in out


def test_a_stop_signal_as_a_failed_set_up_tears_down_leaves_the_failures_code_and_line(work):
    """torchrun's agent stops the other ranks with TERM once one has exited 2: a rank that failed too,
    and is tearing down, must still say why and exit with its own code, not die of the TERM."""
    proc = ddpjob(["train", "--model", "tests.plugins.failing:fails_then_term"], work)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "got SIGTERM" in proc.stderr  # it came, in the tear-down
    assert "ddpjob: error: model factory 'tests.plugins.failing:fails_then_term' returned tuple" in proc.stderr


# In launch (not its workers): once torchrun's agent has started both workers, and before it has
# recorded them (its start returns their handles), a stop signal to launch itself. Delivered at once:
# the handler runs at the next bytecode, inside the agent's start.
SIGNAL_IN_THE_START = """
import os
if "LOCAL_RANK" not in os.environ:
    import signal, subprocess
    from pathlib import Path
    from ddpjob.launch import worker_fork

    popen_init, fork_start, started = subprocess.Popen.__init__, worker_fork.start, []

    def then_signal(pid):
        started.append(pid)
        if len(started) == 2:
            Path(os.environ["WORKERS_FILE"]).write_text(" ".join(map(str, started)))
            os.kill(os.getpid(), signal.SIGTERM)

    def exec_then_signal(self, *args, **kwargs):
        popen_init(self, *args, **kwargs)
        argv = args[0] if args else kwargs.get("args", ())
        if "train" in [str(a) for a in argv]:  # a worker
            then_signal(self.pid)

    def fork_then_signal(*args, **kwargs):
        worker = fork_start(*args, **kwargs)
        then_signal(worker.pid)
        return worker

    subprocess.Popen.__init__ = exec_then_signal
    worker_fork.start = fork_then_signal
"""


@pytest.mark.parametrize("start", STARTS)
def test_a_stop_signal_while_the_agent_starts_the_workers_stops_them_before_launchs_last_line(
    work, tmp_path_factory, start
):
    """A signal that lands inside the agent's start of its workers is held until the agent has
    recorded them, so its shutdown stops them: none outlives launch or prints after its last line."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(SIGNAL_IN_THE_START)
    pids = site / "workers"
    env = {"PYTHONPATH": f"{site}:{PYTHONPATH}", "WORKERS_FILE": str(pids)}
    agent = spawn(["launch", *job("ok", "file", start)], work, **env)
    out = agent.communicate(timeout=180)[0]  # until every process holding its output has exited
    workers = [int(pid) for pid in pids.read_text().split()]
    assert agent.returncode != 75 and not [pid for pid in workers if alive(pid)], out[-3000:]
    last = last_line(out)  # launch's, stopping the workers it started (not "before any worker started")
    assert "launch: " in last and "got SIGTERM" in last and "before any worker" not in last, out[-3000:]
    assert "already gone" not in out  # no orphan saw launch go


LATE_SIGNAL = """
import os
if os.environ.get("RANK") == "0":  # a worker, not launch
    import signal, time
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def signal_then_destroy(*args, **kwargs):  # called once training has finished
        open(os.environ["FIRED"], "w").close()
        os.kill(os.getppid(), signal.{name})  # to launch, which torchrun runs in-process
        time.sleep(1)
        return destroy(*args, **kwargs)

    dist.destroy_process_group = signal_then_destroy
"""


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_a_stop_signal_after_training_finished_keeps_exit_0(work, tmp_path_factory, sig):
    site = tmp_path_factory.mktemp("site")
    env = in_every_worker(site, LATE_SIGNAL.format(name=sig.name))
    run_dir = work / "runs/ddpjob"
    agent = spawn(["launch", *job("ok", "file"), "--max-steps", "5"], work, FIRED=str(site / "fired"), **env)
    out = agent.communicate(timeout=180)[0]
    assert injected_ranks(site) == ["0", "1"] and (site / "fired").exists(), out[-3000:]
    assert agent.returncode == 0, out[-3000:]
    assert attempts(run_dir)[-1]["exit_code"] == 0 and "done: step 5" in out


# Slowness the save's own checks cannot see: rank 0 seals the checkpoint after the other ranks gave
# up waiting for it (--save-timeout 3). The exit code comes from verifying it on disk: 75.
SLOW_FSYNC = """
import os
if os.environ.get("RANK") == "0":  # a worker, not launch
    import glob, time
    from ddpjob.checkpoint import atomic_fs

    fsync_dir = atomic_fs.fsync_dir

    def slow_fsync_dir(directory):  # the last step of a file save, after its manifest
        if glob.glob(os.path.join(directory, "step-*.pt.sum")):
            open(os.environ["FIRED"], "w").close()
            time.sleep(6)
        return fsync_dir(directory)

    atomic_fs.fsync_dir = slow_fsync_dir
"""
SLOW_SAVES = {  # a stop's save on rank 0 that ends sealed: (slow_save seconds, extra flags, sitecustomize)
    "async, slower than --save-timeout": (10, ["--save-mode", "async"], ""),
    "between 0.9 and 1 x --save-timeout": (2.85, [], ""),
    "slow after the save's last check (fsync of the dir)": (0, [], SLOW_FSYNC),
}


@pytest.mark.serial
@pytest.mark.parametrize("save", SLOW_SAVES)
def test_a_stop_save_that_rank_0_seals_late_exits_75(work, tmp_path_factory, save):
    seconds, flags, site = SLOW_SAVES[save]
    folder = tmp_path_factory.mktemp("site")
    env = {**in_every_worker(folder, site), "FIRED": str(folder / "fired")} if site else {}
    args = [*job("ok", "file"), "--save-timeout", "3", *flags]
    args[args.index("--model") + 1] = f"tests.plugins.slow_save:model(seconds={seconds},width=256)"
    run_dir = work / "runs/ddpjob"
    agent = spawn(["launch", *args], work, **env)
    try:
        wait_until(lambda: trained_steps(run_dir) >= 10, 180, "training to start")
        workers = workers_of(agent.pid)
        assert len(workers) == 2, workers
        agent.send_signal(signal.SIGTERM)
        out = agent.communicate(timeout=240)[0]
        assert not [pid for pid in workers if alive(pid)], "workers outlived launch"
        assert_invariant(agent.returncode, out, run_dir, verified_steps(run_dir / "checkpoints"))
        assert agent.returncode == 75, out[-3000:]  # the checkpoint was sealed: nothing is lost
        assert not site or (injected_ranks(folder) == ["0", "1"] and (folder / "fired").exists())
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.serial
def test_a_stop_during_the_final_evaluation_is_75_with_the_last_steps_checkpoint(work):
    """Training finished and its last step is checkpointed; a signal in the final evaluation outlasts
    --shutdown-timeout and the workers are killed: nothing trained is lost, the next start evaluates."""
    run_dir = work / "runs/ddpjob"
    args = [*job("ok", "file"), "--max-steps", "10", "--shutdown-timeout", "3"]
    args[args.index("--data") + 1] = "tests.plugins.slow_save:signal_in_eval(seconds=60)"
    agent = spawn(["launch", *args], work)
    out = agent.communicate(timeout=240)[0]
    assert verified_steps(run_dir / "checkpoints") == [10], out[-3000:]
    assert agent.returncode == 75 and "training finished at step 10" in last_line(out), out[-3000:]
    assert attempts(run_dir)[-1]["exit_code"] == 75


# A heartbeat of the rendezvous handler that lasts until torchrun has returned after the stop, so
# that the keep-alive thread holds the handler while launch drops it (a race, forced). Launch then
# waits a little at exit, so that whatever that thread prints is printed in full.
HELD_HEARTBEAT = """
import atexit, os, sys, threading, time
if "launch" in sys.argv:
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    returned = threading.Event()
    keep_alive, torchrun = dynamic_rendezvous.DynamicRendezvousHandler._keep_alive, run.run

    def held_keep_alive(self):
        open(os.environ["HEARTBEAT_HELD"], "w").close()
        returned.wait(120)
        time.sleep(1)
        keep_alive(self)

    def run_then_release(*args, **kwargs):
        try:
            return torchrun(*args, **kwargs)
        finally:
            returned.set()

    dynamic_rendezvous.DynamicRendezvousHandler._keep_alive = held_keep_alive
    run.run = run_then_release
    atexit.register(lambda: "launch" in sys.argv and time.sleep(3))  # launch's exit, not a forked worker's
"""


def test_a_stop_while_a_rendezvous_heartbeat_runs_ends_launch_with_its_own_last_line(work, tmp_path_factory):
    """torchrun drops its rendezvous handler after a stop signal; launch stops the handler's
    keep-alive thread itself, so that thread never frees the handler and tries to join itself (a
    half traceback after launch's last line: RuntimeError: cannot join current thread, seen in CI)."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(HELD_HEARTBEAT)
    held = site / "held"
    run_dir = work / "runs/ddpjob"
    args = [*job("ok", "file"), "--epochs", "100"]  # still training at the first heartbeat, however fast it starts
    agent = spawn(["launch", *args], work, PYTHONPATH=f"{site}:{PYTHONPATH}", HEARTBEAT_HELD=str(held))
    try:
        wait_until(lambda: held.exists() and trained_steps(run_dir) >= 10, 180, "a heartbeat during training")
        agent.send_signal(signal.SIGINT)
        out = agent.communicate(timeout=240)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert "cannot join current thread" not in out and "Exception ignored" not in out, out[-3000:]
    assert_invariant(agent.returncode, out, run_dir, verified_steps(run_dir / "checkpoints"))
    assert agent.returncode == 75, out[-3000:]
