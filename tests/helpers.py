"""Helpers to run ddpjob as real processes: the CLI, torchrun, and several agents as nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch

import starter

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
FAST = ["--epochs", "2", "--log-every", "1000"]
# This checkout's package first (not whichever ddpjob the venv has installed), then the repo for examples.*
PYTHONPATH = f"{REPO / 'src'}:{REPO}"


# what spawn() starts: a Popen, or a command forked from a starter (tests/starter.py), used alike
Process = subprocess.Popen[str] | starter.Started


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's env minus anything that would make a child think it is distributed."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("DDPJOB_", "SLURM_", "PET_"))}
    env["PYTHONPATH"] = PYTHONPATH
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def ddpjob(
    args: Sequence[str], cwd: Path, timeout: float = 120, fresh: bool = False, **env: str
) -> subprocess.CompletedProcess[str]:
    """`python -m ddpjob ARGS`, run to its end as subprocess.run runs it. Forked from a starter that has
    imported torch (tests/starter.py) unless ``fresh`` or its environment changes how python or torch
    start; then exec'd."""
    full = clean_env(**env)
    kind = None if fresh else starter.kind_of(args, cwd, full, clean_env())
    if kind is None:
        return subprocess.run(
            [PY, "-m", "ddpjob", *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout
        )
    return starter.run(args, cwd, full, kind, clean_env(), timeout)


def spawn(args: Sequence[str], cwd: Path, fresh: bool = False, stdout: IO[str] | None = None, **env: str) -> Process:
    """`python -m ddpjob ARGS` in the background, stdout and stderr together in its ``stdout`` (or in
    the file ``stdout``), as subprocess.Popen gives it. Forked from a starter as ddpjob() is (its pid
    the command's), unless ``fresh`` or its environment changes how python or torch start; then exec'd."""
    full = clean_env(**env)
    kind = None if fresh else starter.kind_of(args, cwd, full, clean_env())
    if kind is None:
        out = stdout or subprocess.PIPE
        return subprocess.Popen(
            [PY, "-m", "ddpjob", *args], cwd=cwd, env=full, stdout=out, stderr=subprocess.STDOUT, text=True
        )
    return starter.Started(args, cwd, full, kind, clean_env(), stdout)


def plain_env_ranks(args: Sequence[str], cwd: Path, port: int, world: int = 2, **env: str) -> list[Process]:
    """`ddpjob train` as `world` processes with only RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set."""
    return [
        spawn(
            ["train", *args],
            cwd,
            RANK=str(r),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **env,
        )
        for r in range(world)
    ]


def torchrun(
    args: Sequence[str], cwd: Path, nproc: int = 2, timeout: float = 180, **env: str
) -> subprocess.CompletedProcess[str]:
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "ddpjob",
        "train",
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)


def launched(
    args: Sequence[str], cwd: Path, nproc: int = 2, timeout: float = 180, **env: str
) -> subprocess.CompletedProcess[str]:
    """`ddpjob launch --nproc-per-node N ARGS`: N workers of one node as a user starts them (on CPU
    forked from launch: launch/worker_fork.py); torchrun() where a test is about plain torchrun."""
    return ddpjob(["launch", "--nproc-per-node", str(nproc), *args], cwd, timeout=timeout, **env)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def final_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The newest checkpoint file of a run, whole: model, optimizer, progress, what it records."""
    from ddpjob.checkpoint import catalogue
    from ddpjob.checkpoint.formats import single_file

    newest = catalogue.list_steps(run_dir / "checkpoints")[0][1]
    return single_file.read(newest)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return final_checkpoint(run_dir)["model"]


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records (empty before the first). Only whole lines: while the job
    runs, the last one may be half written."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def samples_by_step(run_dir: Path, samples_dir: Path) -> dict[int, list[int]]:
    """Optimizer step -> the sorted sample indices it trained on, from the files of the
    tests/plugins/recording.py data and the run's 'start' records: each process belongs to the
    first start after it made its data (every rank makes it before the collective that precedes
    rank 0's start record), fetches global_batch / world_size samples per step from that start's
    step on, and counts only up to the next start's step (later work was redone)."""
    starts = [r for r in records(run_dir) if r["event"] == "start"]
    seen: dict[int, list[int]] = {}
    for path in samples_dir.glob("*.txt"):
        made = int(path.name.split("-")[0]) / 1e9
        after_made = [i for i, s in enumerate(starts) if s["time"] >= made - 0.001]  # the record's rounding
        assert after_made, f"{path.name}: its process made its data after the run's last start record"
        index = after_made[0]
        start, after = starts[index], starts[index + 1]["step"] if index + 1 < len(starts) else None
        per_step = start["global_batch"] // start["world_size"]
        for k, line in enumerate(path.read_text().split()):
            step = start["step"] + 1 + k // per_step
            if after is None or step <= after:
                seen.setdefault(step, []).append(int(line))
    return {step: sorted(ids) for step, ids in sorted(seen.items())}


def lr_by_step(run_dir: Path) -> dict[int, float]:
    """Optimizer step -> the LR it used (the last record of a step that was trained twice)."""
    return {r["step"]: r["lr"] for r in records(run_dir) if r["event"] == "train"}


def trained_steps(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir) if r["event"] == "train"), default=0)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def forked_rank(pid: int) -> int | None:
    """The rank of a worker that launch forked (its name is ddpjob-rRANK: launch/worker_fork.py), else None."""
    try:
        comm = (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return None
    return int(comm[len("ddpjob-r") :]) if comm.startswith("ddpjob-r") and comm[len("ddpjob-r") :].isdigit() else None


def workers_of(agent_pid: int) -> list[int]:
    """The `ddpjob train` processes whose parent is the agent (torchrun runs inside launch): exec'd
    (`train` in their command line) or forked (named ddpjob-rRANK; their command line is launch's)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        pid = int(stat.parent.name)
        if ppid == agent_pid and (b"train" in cmdline or forked_rank(pid) is not None):
            pids.append(pid)
    return sorted(pids)


def rank_of(pid: int) -> int:
    """The RANK a worker process was started with (a forked one's /proc environ is launch's)."""
    if (rank := forked_rank(pid)) is not None:
        return rank
    environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])


# The sitecustomize of in_every_worker: CODE runs in each worker as it starts, exec'd (python runs
# sitecustomize with the worker's environment) or forked (launch's sitecustomize ran once, in launch:
# the worker's entry runs CODE first). Each run leaves a mark, so a test can check that it ran.
INJECTOR = """
import os, runpy
from pathlib import Path

def _inject():
    Path({marks!r}, str(os.getpid())).write_text(os.environ.get("RANK", ""))
    runpy.run_path({code!r})

if "LOCAL_RANK" in os.environ:
    _inject()
else:
    try:
        from ddpjob import cli
    except ImportError:
        pass
    else:
        _run = cli.ForkedTrain.run

        def _run_injected(argv):
            _inject()
            return _run(argv)

        cli.ForkedTrain.run = staticmethod(_run_injected)
"""


def in_every_worker(site: Path, code: str) -> dict[str, str]:
    """The env (PYTHONPATH) under which CODE runs in every worker of a job as it starts, with the
    worker's environment (RANK, LOCAL_RANK), whether launch forks its workers or exec's them."""
    (site / "marks").mkdir(parents=True, exist_ok=True)
    (site / "injected.py").write_text(code)
    (site / "sitecustomize.py").write_text(INJECTOR.format(marks=str(site / "marks"), code=str(site / "injected.py")))
    return {"PYTHONPATH": f"{site}:{PYTHONPATH}"}


def injected_ranks(site: Path) -> list[str]:
    """The RANK of each process in which in_every_worker's code ran."""
    return sorted(p.read_text() for p in (site / "marks").iterdir())


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def attempt_end(
    run_dir: Path, node_rank: int | None, code: int, no_rendezvous: bool = False, host: str = "pod"
) -> None:
    """An attempt's end record in RUN_DIR/attempts.jsonl, as launch writes it."""
    from ddpjob.train.metrics import append_attempt

    extra = {"no_rendezvous": True} if no_rendezvous else {}
    append_attempt(str(run_dir), node_rank=node_rank, host=host, event="end", exit_code=code, **extra)
