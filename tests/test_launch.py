"""`ddpjob launch`: scheduler detection from each scheduler's real env shape, and real launches."""

import base64
import datetime
import os
import pickle
import re
import socket

import pytest

from ddpjob import config, launch
from ddpjob.errors import UsageError
from ddpjob.rendezvous_watch import Joined, RendezvousWatch, decode_state
from helpers import FAST, ddpjob, free_port, ok, spawn

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
    "SLURMD_NODENAME": "node2",
}
KUBEFLOW = {
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "2",
    "PET_NODE_RANK": "2",
    "PET_MASTER_ADDR": "train-master-0",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "train-master-0",
    "MASTER_PORT": "23456",
    "RANK": "2",
    "WORLD_SIZE": "3",
}
INDEXED = {"JOB_COMPLETION_INDEX": "1", "JOB_NAME": "ddpjob", "JOB_SERVICE": "ddpjob-nodes", "DDPJOB_NNODES": "2"}


@pytest.fixture
def no_scontrol(monkeypatch):
    """Without scontrol the head node keeps its name; the Slurm e2e test covers the lookup of its address."""
    monkeypatch.setenv("PATH", "/nonexistent")


def plan_for(env, argv=()):
    parser = config.make_parser("t", "t")
    config.add_config_flags(parser)
    cfg = config.load(parser.parse_args(list(argv)), env)
    return cfg, launch.resolve_plan(cfg, env, cuda_devices=0)


@pytest.mark.parametrize(
    "env, expected",
    [
        (SLURM, ("slurm", 2, 1, "node1:24242", "slurm-4242", 1)),
        (KUBEFLOW, ("kubeflow", 3, 2, "train-master-0:23456", "ddpjob", 2)),
        (INDEXED, ("kubernetes", 2, 1, "ddpjob-0.ddpjob-nodes:29500", "ddpjob", 1)),
        ({}, ("plain", 1, 0, "", "ddpjob", 1)),
        (
            {"DDPJOB_NNODES": "3", "DDPJOB_RDZV_ENDPOINT": "job-node-1"},
            ("plain", 3, None, "job-node-1:29500", "ddpjob", 1),
        ),
        (
            {"DDPJOB_NNODES": "2", "DDPJOB_NODE_RANK": "1", "DDPJOB_RDZV_ENDPOINT": "node0"},
            ("plain", 2, 1, "node0:29500", "ddpjob", 1),
        ),
    ],
)
def test_detects_each_scheduler_from_its_env(env, expected, no_scontrol):
    _, plan = plan_for(env)
    assert (plan.scheduler, plan.nnodes, plan.node_rank, plan.endpoint, plan.rdzv_id, plan.nproc_per_node) == expected


def test_flags_override_detected_values():
    _, plan = plan_for(SLURM, ["--nproc-per-node", "4", "--rdzv-endpoint", "10.0.0.9:1234"])
    assert (plan.nproc_per_node, plan.endpoint, plan.scheduler) == (4, "10.0.0.9:1234", "slurm")


def test_torchrun_arguments_for_a_multi_node_job(no_scontrol):
    cfg, plan = plan_for(SLURM, ["--max-restarts", "3", "--rdzv-timeout", "60"])
    args = launch.torchrun_args(cfg, plan, ["--epochs", "1"])
    assert "--nnodes=2" in args and "--rdzv-backend=c10d" in args and "--rdzv-endpoint=node1:24242" in args
    assert "--max-restarts=3" in args and "--rdzv-conf=is_host=0,join_timeout=60,read_timeout=60" in args
    assert any(a.startswith("--signals-to-handle=") and "SIGUSR1" in a for a in args)
    assert args[-5:] == ["-m", "ddpjob", "train", "--epochs", "1"]


def test_a_worker_only_elastic_kubeflow_pod_leaves_its_rank_and_the_store_host_to_the_rendezvous():
    env = {"PET_NNODES": "1:4", "PET_RDZV_ENDPOINT": "ddpjob-worker-0:23456", "PET_MAX_RESTARTS": "5"}
    cfg, plan = plan_for(env)
    args = launch.torchrun_args(cfg, plan, [])
    assert plan.node_rank is None and "--nnodes=1:4" in args and "--max-restarts=5" in args
    conf = next(a for a in args if a.startswith("--rdzv-conf="))
    assert "is_host" not in conf and "last_call_timeout=10" in conf  # torchrun matches the endpoint to this pod


def test_replicated_nodes_let_torchrun_find_the_rendezvous_host():
    cfg, plan = plan_for({"DDPJOB_NNODES": "3", "DDPJOB_RDZV_ENDPOINT": "job-node-1"})
    assert "--rdzv-conf=join_timeout=300,read_timeout=300" in launch.torchrun_args(cfg, plan, [])


def test_single_node_without_endpoint_is_standalone():
    cfg, plan = plan_for({})
    assert "--standalone" in launch.torchrun_args(cfg, plan, [])


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
        plan_for(env)
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
    # callable returns no nn.Module is found by each worker, which exits 2, and launch passes it on.
    proc = ddpjob(["launch", "--nproc-per-node", "2", "--model", "ddpjob.plugins:digits"], work)
    assert proc.returncode == 2, proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"[node 0 rank {rank}] ddpjob: error: model factory 'ddpjob.plugins:digits' returned" in proc.stderr
    assert re.search(r"launch: node 0 \(.*\): worker rank \d exited with 2$", proc.stderr, re.M), proc.stderr[-2000:]


class _Proc:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


@pytest.mark.parametrize(
    "codes, expected, words",
    [
        (None, 75, "before any worker started"),
        ([75, 75], 75, "workers checkpointed and stopped"),
        (
            [3, 1],
            3,
            "worker local rank 0 exited with 3, not 75 (checkpointed): its log says why; exit codes by local rank: 3, 1",
        ),
        (
            [75, -9],
            137,
            "rank 1 exited with 137, not 75 (checkpointed): SIGKILL: it did not stop within --shutdown-timeout (7 s)",
        ),
        ([75, -15], 143, "exit codes by local rank: 75, 143"),
        ([-15, -15], 75, "while the workers were setting up; nothing to checkpoint"),
        ([0, 0], 0, "as the workers finished"),
    ],
)
def test_after_a_stop_signal_launch_reports_what_the_workers_did(codes, expected, words):
    import signal
    from types import SimpleNamespace

    stops = launch.StopSignals(shutdown_timeout=7)
    stops.count = 2
    if codes is not None:
        handlers = {rank: SimpleNamespace(proc=_Proc(code)) for rank, code in enumerate(codes)}
        stops.pcontext = SimpleNamespace(subprocess_handlers=handlers)
    code, reason = stops.outcome(signal.SIGTERM)
    assert code == expected and words in reason and reason.startswith("got SIGTERM (and 1 more stop signals"), reason


def _stored(state: object) -> bytes:
    """The value torch's c10d rendezvous backend keeps in the store: base64 of a pickle."""
    return base64.b64encode(pickle.dumps(state))


def test_rendezvous_state_decodes_to_the_nodes_that_joined():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = _RendezvousState()
    state.participants = {_NodeDesc("node-a", 10, 0): 0, _NodeDesc("node-b", 11, 0): 1}
    state.wait_list = {_NodeDesc("node-c", 12, 0)}
    state.deadline = datetime.datetime.now(datetime.timezone.utc)
    state.last_heartbeats = {n: datetime.datetime.now(datetime.timezone.utc) for n in state.participants}
    assert decode_state(_stored(state)) == Joined(("node-a", "node-b", "node-c"), False)
    assert decode_state(b"Y2FuaW1hZGFt") == Joined((), False)  # written before any node joined


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_rendezvous_state_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="unexpected"):
        decode_state(_stored(_Payload()))
    assert not (tmp_path / "pwned").exists()


def test_rendezvous_summary_counts_and_names_at_most_eight_hosts():
    watch = RendezvousWatch(f"127.0.0.1:{free_port()}", "job", 64, 300)  # nothing listens there
    assert "no count of joined nodes: reading the state from 127.0.0.1" in watch.summary()
    watch.last = Joined(tuple(f"n{i}" for i in range(10)), False)
    assert watch.summary() == "10 of 64 nodes joined (n0, n1, n2, n3, n4, n5, n6, n7 and 2 more)"
