"""`ddpjob launch`: scheduler detection from each scheduler's real env shape, and real launches.

(The tests of test_launch.py that start processes.)
"""

import re
import socket
import subprocess
import sys

import pytest

from ddpjob.errors import UsageError
from helpers import FAST, attempt_end, clean_env, ddpjob, ok, spawn
from launch_cases import INDEXED, SLURM, config_and_plan
from ports import free_port


def test_flags_override_detected_values():
    _, plan = config_and_plan(SLURM, ["--nproc-per-node", "4", "--rdzv-endpoint", "10.0.0.9:1234"])
    assert (plan.nproc_per_node, plan.endpoint, plan.scheduler) == (4, "10.0.0.9:1234", "slurm")


@pytest.mark.parametrize(
    "env, words",
    [
        ({"JOB_COMPLETION_INDEX": "0", "JOB_NAME": "j"}, ["JOB_SERVICE", "manifest"]),
        (
            {"JOB_COMPLETION_INDEX": "3", "JOB_NAME": "j", "JOB_SERVICE": "s", "DDPJOB_NNODES": "2"},
            ["node rank 3", "2 nodes"],
        ),
        ({"DDPJOB_NNODES": "2"}, ["rendezvous endpoint", "--rdzv-endpoint"]),
        ({**SLURM, "SLURM_NNODES": "two"}, ["SLURM_NNODES='two'"]),
    ],
)
def test_bad_scheduler_env_is_a_one_line_error(env, words):
    with pytest.raises(UsageError) as err:
        config_and_plan(env)
    for word in words:
        assert word in str(err.value)


def test_dry_run_prints_the_command_and_the_reason(work):
    out = ok(ddpjob(["launch", "--dry-run", "--epochs", "1"], work, **INDEXED))
    assert "scheduler=kubernetes" in out and "JOB_COMPLETION_INDEX" in out
    assert "torchrun --nproc-per-node=1" in out and "-m ddpjob train --epochs 1" in out


@pytest.mark.slow
def test_launch_runs_two_nodes_on_loopback(work):
    port = free_port()
    nodes = [
        spawn(
            ["launch", *FAST],
            work,
            DDPJOB_NNODES="2",
            DDPJOB_NODE_RANK=str(n),
            DDPJOB_RDZV_ENDPOINT=f"127.0.0.1:{port}",
        )
        for n in range(2)
    ]
    outs = [n.communicate(timeout=180)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert sum("done:" in o for o in outs) == 1
    assert (work / "runs/ddpjob/logs" / socket.gethostname()).is_dir()


@pytest.mark.slow
def test_launch_exits_with_the_workers_bad_input_code(work):
    # launch imports the factory before it starts anything, but only the workers call it: that the
    # callable returns no nn.Module is found by each worker, which exits 2, and launch passes it on. The
    # agent stops the other worker once one has exited, so the other may be stopped before it says it.
    proc = ddpjob(["launch", "--nproc-per-node", "2", "--model", "ddpjob.plugins:digits"], work)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = worker_errors(proc.stderr)
    assert 1 <= len(errors) <= 2, errors
    assert all("ddpjob: error: model factory 'ddpjob.plugins:digits' returned tuple" in e for e in errors), errors
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(
        r"launch: node 0 \(.*\): worker rank \d exited with 2 \(bad input: not restarted\): model factory", last
    )


@pytest.mark.slow
def test_a_workers_bad_input_ends_the_job_at_once_whatever_max_restarts(work):
    # 3 micro-batches of 32 do not split over 2 workers: every restart would fail the same way.
    proc = ddpjob(["launch", "--nproc-per-node", "2", "--max-restarts", "5", "--global-batch-size", "96"], work)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = worker_errors(proc.stderr)
    assert 1 <= len(errors) <= 2, errors  # each worker at most once (the other may be stopped first): no restart
    last = proc.stderr.strip().splitlines()[-1]
    assert "exited with 2 (bad input: not restarted)" in last and errors[0].split("ddpjob: error: ")[1] in last, last


@pytest.mark.slow
def test_an_empty_validation_set_is_bad_input_at_start_up_and_not_retried(work):
    data = ["--data", "tests.plugins.empty_val:data", "--model", "ddpjob.plugins:synthetic_mlp(width=64)"]
    proc = ddpjob(["launch", "--nproc-per-node", "2", "--max-restarts", "3", *data], work)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = worker_errors(proc.stderr)
    assert 1 <= len(errors) <= 2 and all("returned an empty validation dataset" in e for e in errors), errors
    assert not (work / "runs/ddpjob/metrics.jsonl").exists()  # found before training, not after an epoch
    assert "returned an empty validation dataset" in proc.stderr.strip().splitlines()[-1]


# torchrun's agent in this process (launch.run_torchrun) over a worker that exits 75, as ranks do that
# stopped with a checkpoint (a verified one of the recorded stop step), twice, then 0; each start logs
# torchrun's restart count in starts.log.
AGENT = """
import sys
from ddpjob import config; from ddpjob.launch import agent as launch
from ddpjob.launch.plan import Plan
nodes, endpoint = sys.argv[1:3]
parser = config.make_parser("t", "t")
config.add_config_flags(parser)
cfg = config.load(parser.parse_args(["--max-restarts", "1", "--elastic-wait", "1", "--run-dir", "run"]), {})
low, high = config.parse_nodes(nodes, "nodes")
plan = Plan("plain", "test", high, 0, endpoint, "stops", 1, low, cfg.max_restarts)
code, reason = launch.run_torchrun(launch.torchrun_args(cfg, plan, [], worker=("worker.py",)), plan, cfg)
print(f"exit {code}: {reason}")
sys.exit(code)
"""


WORKER = """
import os, pathlib, sys
from ddpjob.checkpoint import stop_record
from ddpjob.checkpoint.formats import single_file
log = pathlib.Path("starts.log")
with log.open("a") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
starts = len(log.read_text().split())
if starts <= 2:
    pathlib.Path("run/checkpoints").mkdir(parents=True, exist_ok=True)
    single_file.save({"step": starts}, pathlib.Path(f"run/checkpoints/step-{starts}.pt"))
    stop_record.record("run", starts, 15)
sys.exit(75 if starts <= 2 else 0)
"""


@pytest.mark.parametrize(
    ("nodes", "code", "starts"),
    [
        pytest.param("1", 75, ["0"], id="fixed"),  # the agent ends with 75 at once; the scheduler restarts it free
        # elastic: re-formed twice with --max-restarts 1, no restart counted. Alone (`serial`): each
        # re-forming waits --elastic-wait 1 s for more nodes, a deadline a loaded machine can miss
        pytest.param("1:2", 0, ["0", "0", "0"], id="elastic", marks=pytest.mark.serial),
    ],
)
def test_workers_that_stopped_with_a_checkpoint_spend_no_restart(work, nodes, code, starts):
    (work / "agent.py").write_text(AGENT)
    (work / "worker.py").write_text(WORKER)
    endpoint = f"127.0.0.1:{free_port()}" if ":" in nodes else ""
    proc = subprocess.run(
        [sys.executable, "agent.py", nodes, endpoint],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (work / "starts.log").read_text().split() == starts


# A stop signal to launch once torchrun has returned, as the restart policy's patch is taken back
# (the rendezvous watch ends there too): what the workers did decides the exit code, not the signal.
SIGNAL_AS_THE_POLICY_ENDS = """
import contextlib, os, signal
from ddpjob.launch import agent
policy = agent.restart_policy

@contextlib.contextmanager
def signalled_as_it_ends(elastic):
    try:
        with policy(elastic):
            yield
    finally:  # also as torchrun's ChildFailedError passes
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, at the next bytecode

agent.restart_policy = signalled_as_it_ends
"""


@pytest.mark.parametrize(("worker_code", "line"), [(0, "exit 0: finished"), (3, "exit 3: worker rank 0 exited with 3")])
def test_a_stop_signal_after_torchrun_returned_leaves_the_workers_exit_code(work, worker_code, line):
    (work / "agent.py").write_text(SIGNAL_AS_THE_POLICY_ENDS + AGENT)
    (work / "worker.py").write_text(f"import sys\nsys.exit({worker_code})\n")
    proc = subprocess.run(
        [sys.executable, "agent.py", "1", ""], cwd=work, env=clean_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == worker_code and line in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def worker_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[node 0 rank ") and "ddpjob: error:" in line]


def test_launch_exits_1_once_the_rendezvous_failed_more_times_in_a_row_than_allowed(work):
    """Through the real agent: node 1 of 2 (node 0 never comes) has failed --rdzv-retries (default 3)
    times in a row already: this failure exits 1 (counted by the Job's backoffLimit), and is recorded."""
    import json

    from ddpjob.errors import EXIT_FAILED

    run = work / "runs/1"
    for _ in range(3):
        attempt_end(run, 1, 69, no_rendezvous=True, host=socket.gethostname())
    flags = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "2"]
    proc = spawn(["launch", *flags, "--node-rank", "1", "--run-dir", "runs/1"], work)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_FAILED, out[-2000:]
    assert "4 in a row" in out and "--rdzv-retries 3" in out and "Traceback" not in out, out[-2000:]
    last = json.loads((run / "attempts.jsonl").read_text().splitlines()[-1])
    assert last["exit_code"] == EXIT_FAILED and last["no_rendezvous"] is True
