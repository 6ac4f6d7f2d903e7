"""`ddpjob launch`: scheduler detection from each scheduler's real env shape, and real launches."""

import base64
import contextlib
import datetime
import os
import pickle
import shutil
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from ddpjob.cli import ForkedTrain
from ddpjob.errors import UsageError
from ddpjob.launch import agent
from ddpjob.launch.rendezvous_watch import Joined, RendezvousWatch, decode_state
from helpers import attempt_end
from kubeflow_operator import trainer_v2_env
from launch_cases import INDEXED, SLURM, config_and_plan
from ports import free_port

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


@pytest.fixture
def no_scontrol(monkeypatch):
    """Without scontrol the head node keeps its name; the Slurm e2e test covers the lookup of its address."""
    monkeypatch.setenv("PATH", "/nonexistent")


@pytest.mark.parametrize(
    "env, expected",
    [
        (SLURM, ("slurm", 2, 1, "node1:24242", "slurm-4242", 1)),
        (KUBEFLOW, ("kubeflow", 3, 2, "train-master-0:23456", "ddpjob", 2)),
        (INDEXED, ("kubernetes", 2, 1, "ddpjob-0.ddpjob-nodes:29500", "ddpjob", 1)),
        (trainer_v2_env("train", 3, 2, "2"), ("kubeflow", 3, 2, "train-node-0-0.train:29400", "ddpjob", 2)),
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
    _, plan = config_and_plan(env)
    assert (plan.scheduler, plan.nnodes, plan.node_rank, plan.endpoint, plan.rdzv_id, plan.nproc_per_node) == expected


@pytest.mark.parametrize(
    "given, endpoint",
    [
        ("[::1]", "[::1]:29500"),
        ("[::1]:1234", "[::1]:1234"),
        ("node1", "node1:29500"),
        ("10.0.0.9:1234", "10.0.0.9:1234"),
    ],
)
def test_an_endpoint_without_a_port_gets_the_default_one(given, endpoint):
    cfg, plan = config_and_plan({}, ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", given])
    assert plan.endpoint == endpoint
    assert f"--rdzv-endpoint={endpoint}" in agent.torchrun_args(cfg, plan, [])


def test_torchrun_arguments_for_a_multi_node_job(no_scontrol):
    cfg, plan = config_and_plan(SLURM, ["--max-restarts", "3", "--rdzv-timeout", "60"])
    args = agent.torchrun_args(cfg, plan, ["--epochs", "1"])
    assert "--nnodes=2" in args and "--rdzv-backend=c10d" in args and "--rdzv-endpoint=node1:24242" in args
    assert "--max-restarts=3" in args and "--rdzv-conf=is_host=0,join_timeout=60,read_timeout=60" in args
    assert any(a.startswith("--signals-to-handle=") and "SIGUSR1" in a for a in args)
    assert args[-5:] == ["-m", "ddpjob", "train", "--epochs", "1"]


def test_a_worker_only_elastic_kubeflow_pod_leaves_its_rank_and_the_store_host_to_the_rendezvous():
    env = {"PET_NNODES": "1:4", "PET_RDZV_ENDPOINT": "ddpjob-worker-0:23456", "PET_MAX_RESTARTS": "5"}
    cfg, plan = config_and_plan(env)
    args = agent.torchrun_args(cfg, plan, [])
    assert plan.node_rank is None and "--nnodes=1:4" in args and "--max-restarts=5" in args
    conf = next(a for a in args if a.startswith("--rdzv-conf="))
    assert "is_host" not in conf and "last_call_timeout=10" in conf  # torchrun matches the endpoint to this pod


def test_replicated_nodes_let_torchrun_find_the_rendezvous_host():
    cfg, plan = config_and_plan({"DDPJOB_NNODES": "3", "DDPJOB_RDZV_ENDPOINT": "job-node-1"})
    assert "--rdzv-conf=join_timeout=300,read_timeout=300" in agent.torchrun_args(cfg, plan, [])


def test_single_node_without_endpoint_is_standalone():
    cfg, plan = config_and_plan({})
    assert "--standalone" in agent.torchrun_args(cfg, plan, [])


class _Proc:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


STOPPED = "training stopped on SIGTERM at step 40, and its checkpoint"


@pytest.mark.parametrize(
    "codes, on_disk, expected, words",
    [
        (None, "", 143, "before any worker started: nothing had trained in this attempt"),
        ([75, 75], "verified", 75, STOPPED),
        (
            [3, 1],
            "",
            3,
            "worker local rank 0 exited with 3: its log says why; no checkpoint of the stop: "
            "the steps since the newest checkpoint are lost; exit codes by local rank: 3, 1",
        ),
        ([3, 1], "verified", 75, STOPPED),  # a rank gave up on rank 0, which sealed it after all
        ([75, 75], "recorded", 3, "no verified checkpoint of step 40, where training stopped (there is no checkpoint"),
        ([75, 75], "corrupt", 3, "its checkpoint fails verification (step-40.pt: checksum mismatch"),
        (
            [75, -9],
            "recorded",
            137,
            "rank 1 exited with 137: SIGKILL: it did not stop within --shutdown-timeout (7 s), or the OOM killer; no "
            "verified checkpoint of step 40",
        ),
        ([75, -9], "verified", 75, STOPPED),  # sealed, then a slow exit was killed
        ([75, -15], "verified", 75, "is verified (exit 75); exit codes by local rank: 75, 143"),
        ([-9, -9], "finished", 75, "training finished at step 40, and its checkpoint"),  # killed in the final eval
        ([-15, -15], "", 143, "while the workers were setting up: nothing had trained in this attempt"),
        ([0, 0], "verified", 0, "as the workers finished"),
    ],
)
def test_after_a_stop_signal_launch_exits_75_iff_the_stop_steps_checkpoint_verifies(
    tmp_path, codes, on_disk, expected, words
):

    import torch

    from ddpjob.checkpoint import stop_record
    from ddpjob.checkpoint.formats import single_file

    run_dir, ckpt = tmp_path / "run", tmp_path / "run/checkpoints"
    ckpt.mkdir(parents=True)
    stops = agent.AgentSignals(7, run_dir, ckpt)  # launch starts; then its workers write
    if on_disk:
        stop_record.record(run_dir, 40, 0 if on_disk == "finished" else signal.SIGTERM)
    if on_disk in ("verified", "corrupt", "finished"):
        single_file.save({"w": torch.ones(1000)}, ckpt / "step-40.pt")
    if on_disk == "corrupt":
        with open(ckpt / "step-40.pt", "r+b") as f:
            f.seek(-100, 2)
            f.write(b"x" * 10)
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
    nodes = frozenset({("node-a", 10, 0), ("node-b", 11, 0), ("node-c", 12, 0)})
    assert decode_state(_stored(state)) == Joined(nodes, False)
    assert decode_state(b"Y2FuaW1hZGFt") == Joined(frozenset(), False)  # written before any node joined


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_rendezvous_state_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="unexpected"):
        decode_state(_stored(_Payload()))
    assert not (tmp_path / "pwned").exists()


def _state(*hosts: str) -> bytes:
    """A stored rendezvous state whose participants are one node on each of ``hosts``."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = _RendezvousState()
    state.participants = {_NodeDesc(host, 4242, 0): i for i, host in enumerate(hosts)}
    return _stored(state)


def test_rendezvous_summary_counts_and_names_at_most_eight_hosts():
    from torch.distributed import TCPStore

    port = free_port()
    watch = RendezvousWatch(f"127.0.0.1:{port}", "job", 64, 300)  # nothing listens there yet
    assert "no count of joined nodes: reading the state from 127.0.0.1" in watch.summary()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60))  # a bound, not a wait
    store.set("torch.rendezvous.job", _state(*(f"n{i}" for i in range(10))))
    watch.poll(timeout_s=30)
    assert watch.summary() == "at least 10 of 64 nodes joined (n0, n1, n2, n3, n4, n5, n6, n7 and 2 more)"


def test_rendezvous_count_keeps_the_nodes_it_saw_after_the_store_host_timed_out_and_left():
    """The race, step by step on a real store: node 0 (the store host) reaches its join timeout
    first, removes itself from the state, and its store goes away; node 1 reads in between. Node 1
    still counts node 0, and says that its count is a lower bound ("at least")."""
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60))  # a bound, not a wait
    watch = RendezvousWatch(f"127.0.0.1:{port}", "job", 3, 300)
    store.set("torch.rendezvous.job", _state("node-0", "node-1"))
    watch.poll(timeout_s=30)
    store.set("torch.rendezvous.job", _state("node-1"))  # node 0 timed out: it leaves the state
    watch.poll(timeout_s=30)
    del store  # and its store goes away with it
    watch.poll(timeout_s=1)
    assert watch.summary() == "at least 2 of 3 nodes joined (node-0, node-1)"


def test_rendezvous_watch_leaves_no_read_under_way_when_launch_goes_on_to_exit():
    """A thread still inside torch's TCPStore connect when the interpreter shuts down aborts the
    process (SIGABRT): a failed rendezvous exited 134 instead of 1. Leaving the watch ends its reads."""
    with RendezvousWatch(f"127.0.0.1:{free_port()}", "job", 2, 2):  # nothing listens: every read fails
        time.sleep(1.5)  # the first read, at 1 s, is under way
    assert "ddpjob-rdzv-watch" not in [t.name for t in threading.enumerate()]


def run_result(*codes: int) -> object:
    """torch's RunResult of a failed worker group whose local ranks exited with `codes`."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {rank: ProcessFailure(rank, 1000 + rank, code, "") for rank, code in enumerate(codes)}
    return RunResult(state=WorkerState.FAILED, failures=failures)


@pytest.mark.parametrize(
    ("codes", "stopped"),
    [((75, 75), True), ((75,), True), ((75, 1), False), ((1, 75), False), ((2, 75), False), ((1, 1), False)],
)
def test_a_group_is_stopped_with_a_checkpoint_only_when_every_failed_worker_exited_75(codes, stopped):
    """A real failure beside a checkpointed stop must still spend a restart."""
    from ddpjob.launch.restarts import stopped_with_checkpoint

    assert stopped_with_checkpoint(run_result(*codes)) is stopped


def test_bad_input_is_the_reported_failure_when_a_peer_recorded_its_error_first_and_was_then_stopped(tmp_path):
    """Both ranks find the same bad input; rank 1 records it a second earlier but is still exiting when
    rank 0's exit 2 makes the agent SIGTERM it. torch's first failure is rank 1's -15 (launch exited
    143, which a scheduler retries); launch reports the exit 2."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpjob.launch.restarts import reported_failure

    def failure(rank: int, code: int, timestamp: int) -> ProcessFailure:
        error_file = tmp_path / f"{rank}.json"
        message = {"message": "bad input", "extraInfo": {"py_callstack": "", "timestamp": str(timestamp)}}
        error_file.write_text(json.dumps({"message": message}))
        return ProcessFailure(rank, 1000 + rank, code, str(error_file))

    stopped = ChildFailedError("ddpjob", {0: failure(0, 2, 16), 1: failure(1, -15, 15)})
    assert stopped.get_first_failure()[0] == 1  # torch's own choice: the rank the agent stopped
    assert reported_failure(stopped)[0] == 0 and reported_failure(stopped)[1].exitcode == 2
    crashed = ChildFailedError("ddpjob", {0: failure(0, 1, 16), 1: failure(1, -15, 15)})
    assert reported_failure(crashed)[0] == 1  # no bad input: torch's first failure, as before


def test_a_rendezvous_that_keeps_failing_is_free_only_so_many_times_in_a_row(tmp_path):
    """69 is retried without counting; a wrong endpoint, DNS name or blocked port never heals, so
    the failures in a row (nothing trained between) past --rdzv-retries exit 1, which counts."""
    from ddpjob.errors import EXIT_FAILED, EXIT_NO_RENDEZVOUS
    from ddpjob.launch.restarts import no_rendezvous_exit

    run = tmp_path / "run"
    codes = []
    for _ in range(5):
        code, _ = no_rendezvous_exit(str(run), 1, "pod", limit=3)
        codes.append(code)
        attempt_end(run, 1, code, no_rendezvous=True)
    assert codes == [EXIT_NO_RENDEZVOUS] * 3 + [EXIT_FAILED] * 2
    attempt_end(run, 0, 69, no_rendezvous=True)  # another node's failures are its own
    assert no_rendezvous_exit(str(run), 0, "pod", limit=3)[0] == EXIT_NO_RENDEZVOUS
    attempt_end(run, 1, 75)  # it trained (and stopped with a checkpoint) since: the count starts again
    code, line = no_rendezvous_exit(str(run), 1, "pod", limit=3)
    assert code == EXIT_NO_RENDEZVOUS and line == ""
    assert no_rendezvous_exit(str(run), 1, "pod", limit=0)[0] == EXIT_FAILED
    # a node with no rank (replicated compose service) is told apart by its host
    attempt_end(run, None, 69, no_rendezvous=True, host="a")
    assert no_rendezvous_exit(str(run), None, "a", limit=1)[0] == EXIT_FAILED
    assert no_rendezvous_exit(str(run), None, "b", limit=1)[0] == EXIT_NO_RENDEZVOUS


def _nodes(*nodes: tuple[str, int]) -> bytes:
    """A stored rendezvous state whose participants are ``(host, pid)`` nodes, each local id 0."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = _RendezvousState()
    state.participants = {_NodeDesc(host, pid, 0): i for i, (host, pid) in enumerate(nodes)}
    return _stored(state)


def test_rendezvous_count_counts_a_restarted_node_once_and_never_more_than_the_job_has():
    """A node's agent restarted (new pid) is the same node: the count stays a lower bound of node
    slots. Nodes seen together on one host are distinct (many nodes may share localhost); a stale
    entry beside its restart may still make one read show more than the job has: capped."""
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60))  # a bound, not a wait
    watch = RendezvousWatch(f"127.0.0.1:{port}", "job", 3, 300)
    store.set("torch.rendezvous.job", _nodes(("node-0", 100), ("node-1", 101)))
    watch.poll(timeout_s=30)
    store.set("torch.rendezvous.job", _nodes(("node-0", 200), ("node-1", 101)))  # node 0 restarted
    watch.poll(timeout_s=30)
    assert watch.summary() == "at least 2 of 3 nodes joined (node-0, node-1)"
    store.set("torch.rendezvous.job", _nodes(("localhost", 1), ("localhost", 2), ("localhost", 3), ("node-1", 101)))
    watch.poll(timeout_s=30)
    assert watch.summary() == "at least 3 of 3 nodes joined (localhost, node-0, node-1)"


def test_rendezvous_summary_of_a_state_nobody_joined_says_no_node_was_seen():
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60))  # a bound, not a wait
    watch = RendezvousWatch(f"127.0.0.1:{port}", "job", 3, 300)
    store.set("torch.rendezvous.job", b"Y2FuaW1hZGFt")
    watch.poll(timeout_s=30)
    assert watch.summary() == "no node of the 3 was seen to join"


def test_rendezvous_summary_returns_when_the_store_host_accepts_connections_but_never_answers():
    """torch's TCPStore connect ignores its timeout against such a host (blocked for minutes): the
    summary of a failed rendezvous must not wait on it."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody answers
        watch = RendezvousWatch(f"127.0.0.1:{silent.getsockname()[1]}", "job", 2, 300)
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.append(watch.summary()), daemon=True)
        reader.start()
        reader.join(timeout=30)  # a hang guard, not a speed figure: a bounded read takes a few seconds
        assert said, "summary() blocked on a store that never answers"
        assert said[0].startswith("no count of joined nodes: the store at 127.0.0.1:") and "did not answer" in said[0]


def test_the_documented_stop_signals_are_handled_and_forwarded():

    from ddpjob.train.stop_signal import STOP_SIGNALS

    documented = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT}
    assert set(STOP_SIGNALS) >= documented
    assert set(agent.HANDLED_SIGNALS.split(",")) >= {s.name for s in documented}  # what torchrun forwards


ELASTIC = ["--nnodes", "1:2", "--max-restarts", "2", "--rdzv-endpoint", "127.0.0.1:29999", "--node-rank", "0"]


def test_an_elastic_launch_probes_the_data_factory_as_rank_0_of_1(monkeypatch):
    """The factory runs in the agent as a worker would see it (RANK, WORLD_SIZE, LOCAL_RANK), so a
    stream that needs them is still found; the agent's own environment is left as it was."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="IterableDataset"):
        config_and_plan({}, [*ELASTIC, "--data", "tests.plugins.rank_data:ranked_stream"])
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(os.environ)


def test_an_elastic_launch_whose_data_factory_fails_warns_that_it_could_not_check(capsys):
    config_and_plan({}, [*ELASTIC, "--data", "tests.plugins.rank_data:failing"])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "--data" in line]
    assert "could not check" in line and "the data server is down" in line


def test_launch_dry_run_calls_no_data_factory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEST_DATA_CALLS", str(tmp_path / "calls"))
    monkeypatch.chdir(tmp_path)
    assert agent.main(["--dry-run", *ELASTIC, "--data", "tests.plugins.rank_data:recorded"], ForkedTrain()) == 0
    assert "launch: torchrun" in capsys.readouterr().out
    assert not (tmp_path / "calls").exists()


def _stop_at_40(tmp_path, fs_timeout):
    """Launch's AgentSignals, then its workers' record of a stop at step 40; (them, the checkpoint dir)."""
    from ddpjob.checkpoint import stop_record

    run_dir, ckpt = tmp_path / "run", tmp_path / "run/checkpoints"
    ckpt.mkdir(parents=True)
    stops = agent.AgentSignals(7, run_dir, ckpt, fs_timeout)
    stop_record.record(run_dir, 40, signal.SIGTERM)
    return stops, ckpt


def _outcome(stops, codes):
    stops.pcontext = SimpleNamespace(
        subprocess_handlers={r: SimpleNamespace(proc=_Proc(c)) for r, c in enumerate(codes)}
    )
    return stops.outcome(signal.SIGTERM)


def test_a_node_whose_storage_lags_waits_up_to_fs_timeout_for_the_checkpoint_its_workers_saved(tmp_path):
    """Multi-node on NFS: rank 0 (another node) sealed step 40 and every worker here exited 75, but
    this node's view shows the checkpoint only later. Launch waits for it, and exits 75."""
    import torch

    from ddpjob.checkpoint.formats import single_file

    stops, ckpt = _stop_at_40(tmp_path, fs_timeout=60)
    elsewhere = tmp_path / "node0-view"
    elsewhere.mkdir()
    single_file.save({"w": torch.ones(1000)}, elsewhere / "step-40.pt")

    def catch_up():  # the data first, the manifest last, as a lagging client sees them
        time.sleep(1.5)
        shutil.copyfile(elsewhere / "step-40.pt", ckpt / "step-40.pt")
        manifest = single_file.manifest_path(elsewhere / "step-40.pt")
        shutil.copyfile(manifest, ckpt / manifest.name)

    lag = threading.Thread(target=catch_up)
    lag.start()
    try:
        code, reason = _outcome(stops, [75, 75])
    finally:
        lag.join()
    assert code == 75 and "step-40.pt is verified" in reason, reason


def test_a_node_whose_worker_failed_its_save_does_not_wait_for_the_checkpoint(tmp_path, monkeypatch):
    from ddpjob.checkpoint import stop_record

    def no_wait(seconds):
        raise AssertionError(f"waited {seconds} s for a checkpoint a worker failed to save")

    monkeypatch.setattr(stop_record.time, "sleep", no_wait)
    stops, _ = _stop_at_40(tmp_path, fs_timeout=60)
    code, reason = _outcome(stops, [75, 3])
    assert code == 3 and "no verified checkpoint of step 40" in reason, reason


def test_launch_stops_a_heartbeat_thread_from_its_own_thread_and_waits_for_a_hung_one_at_most_its_bound():
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    hung = threading.Event()

    class Handler:  # torch's dynamic rendezvous handler, as far as launch uses it
        def __init__(self) -> None:
            self.timer = _PeriodicTimer(datetime.timedelta(seconds=0.01), hung.wait, 30)  # a heartbeat that hangs
            self.timer.start()

        def _stop_heartbeats(self) -> None:
            self.timer.cancel()

    handler = Handler()
    time.sleep(0.1)  # the heartbeat is under way
    start = time.monotonic()
    agent.stop_heartbeats(handler, wait_s=0.5)
    assert time.monotonic() - start < 3  # not the 30 s of the hung heartbeat
    assert not handler.timer._finalizer.alive  # disarmed: freeing the handler later joins nothing
    hung.set()
    handler.timer._thread.join(5)
    assert not handler.timer._thread.is_alive()


@pytest.mark.parametrize(
    ("method", "signals", "fails"),
    [("_start_workers", 1, False), ("_start_workers", 1, True), ("_start_workers", 2, False), ("_shutdown", 1, False)],
    ids=["start-returns", "start-fails", "second-signal-counted", "shutdown-returns"],
)
def test_a_stop_signal_while_the_agent_starts_or_stops_its_workers_is_raised_once_that_has_returned(
    monkeypatch, tmp_path, method, signals, fails
):
    """A real signal through the handlers installed() puts in place, sent from inside the agent's start
    of its workers (after the first worker exists, before the agent has recorded them) or its stop of
    them: it is raised only once that has returned, so the agent knows, and has closed, its workers."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def start_or_stop(agent_self, *args, **kwargs):
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGUSR1)  # delivered here, at the next bytecode
        agent_self.done = True  # the agent's self._pcontext = start_processes(...), or its close
        if fails:
            raise RuntimeError("a worker failed to exec")
        return {0: 1234}

    monkeypatch.setattr(LocalElasticAgent, method, start_or_stop)
    stops, the_agent = agent.AgentSignals(7, tmp_path, tmp_path), SimpleNamespace(done=False)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        with stops.installed("SIGUSR1"), pytest.raises(SignalException) as raised:
            getattr(LocalElasticAgent, method)(the_agent, None)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert the_agent.done and raised.value.sigval == signal.SIGUSR1 and stops.count == signals
    assert isinstance(raised.value.__cause__, RuntimeError) == fails
    assert getattr(LocalElasticAgent, method) is start_or_stop and not stops.holding  # put back


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_once_torchrun_has_returned_the_stop_signals_are_ignored_not_left_to_their_default(tmp_path, ends):
    """CPython puts back SIG_DFL for every signal it handled as the interpreter exits: a TERM then (Slurm
    signals every process of a step, train.sbatch forwards it again) would kill launch on its way to
    exit 75. So installed() leaves each of its signals ignored, however torchrun ended."""
    names = (signal.SIGUSR1, signal.SIGUSR2)
    previous = [signal.getsignal(sig) for sig in names]
    stops = agent.AgentSignals(7, tmp_path, tmp_path)
    try:
        with contextlib.suppress(RuntimeError), stops.installed(",".join(sig.name for sig in names)):
            assert all(signal.getsignal(sig) == stops.handle for sig in names)
            if ends == "raises":
                raise RuntimeError("torchrun failed")
        assert [signal.getsignal(sig) for sig in names] == [signal.SIG_IGN, signal.SIG_IGN]
        assert stops.done
    finally:
        for sig, handler in zip(names, previous, strict=True):
            signal.signal(sig, handler)


def test_a_stop_record_from_before_the_agent_last_started_workers_is_read_past_and_left(monkeypatch, tmp_path):
    """An earlier attempt's or round's record is not the new workers': launch reads past it from the
    agent's start of them on, and leaves it (another node's launch may still need it: node 0 replaced,
    or the others re-formed, while node 1 stops). A later record is read, even in the same inode."""
    import torch
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ddpjob.checkpoint import stop_record
    from ddpjob.checkpoint.formats import single_file

    monkeypatch.setattr(LocalElasticAgent, "_start_workers", lambda agent_self, worker_group: {0: 1234})
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    stops = agent.AgentSignals(7, tmp_path, ckpt)
    stop_record.record(tmp_path, 40, signal.SIGTERM)  # an earlier round's stop, with its checkpoint
    single_file.save({"w": torch.ones(10)}, ckpt / "step-40.pt")
    assert agent.stopped_saved(stops.recorded(saved=False))
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        with stops.installed("SIGUSR1"):
            LocalElasticAgent._start_workers(None, None)  # the agent starts a new round's workers
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert stops.recorded(saved=False) is None and (tmp_path / stop_record.NAME).exists()
    path = tmp_path / stop_record.NAME
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))  # as a later file in its inode
    assert stop_record.read(tmp_path, stops.stale) == stop_record.Stop(40, signal.SIGTERM)
    stop_record.record(tmp_path, 41, signal.SIGUSR1)
    assert stops.recorded(saved=False).stop == stop_record.Stop(41, signal.SIGUSR1)


@pytest.mark.parametrize("recorded", ["before", "during", "during-a-restart"])
def test_after_the_store_went_away_only_a_stop_agreed_before_the_agent_stopped_the_workers_counts(
    monkeypatch, tmp_path, recorded
):
    """Node 0 gone: a stop the workers had recorded before the agent's own shutdown of them is the
    nodes stopping together (75 when verified); one they record during it (the agent's SIGTERM, a
    step whose checkpoint happens to exist) is not: node 0 died, and that is a failure. Also when
    the agent stopped them for a restart, and its re-rendezvous then failed (a second shutdown)."""
    import torch
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ddpjob.checkpoint import stop_record
    from ddpjob.checkpoint.formats import single_file

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    single_file.save({"w": torch.ones(10)}, ckpt / "step-10.pt")

    def shutdown(agent_self, *args, **kwargs):
        if recorded.startswith("during") and not (tmp_path / stop_record.NAME).exists():
            stop_record.record(tmp_path, 10, signal.SIGTERM)

    monkeypatch.setattr(LocalElasticAgent, "_shutdown", shutdown)
    stops = agent.AgentSignals(7, tmp_path, ckpt)
    if recorded == "before":
        stop_record.record(tmp_path, 10, signal.SIGTERM)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        with stops.installed("SIGUSR1"):
            if recorded == "during-a-restart":
                LocalElasticAgent._shutdown(None)  # _restart_workers -> _stop_workers; then a failed rendezvous
            LocalElasticAgent._shutdown(None)  # torch's run() on its way out after the RendezvousError
    finally:
        signal.signal(signal.SIGUSR1, previous)
    found = stops.stopped_before_the_agent()
    assert agent.stopped_saved(found) == (recorded == "before"), found


def test_a_stop_signal_while_launch_reads_the_stop_record_in_a_shutdown_is_held_too(monkeypatch, tmp_path):
    """The read of what the workers agreed, at the start of the agent's shutdown, is inside the hold:
    a signal there must not cut short the closing of the workers."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ddpjob.checkpoint import stop_record

    read = stop_record.read

    def signalled_read(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered here, at the next bytecode
        return read(*args, **kwargs)

    closed = []
    monkeypatch.setattr(stop_record, "read", signalled_read)
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda agent_self, *args, **kwargs: closed.append(True))
    stops = agent.AgentSignals(7, tmp_path, tmp_path)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        with stops.installed("SIGUSR1"), pytest.raises(SignalException):
            LocalElasticAgent._shutdown(None)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert closed == [True]


WORKER_STARTS = {  # (--worker-start, --device, a GPU visible) -> forked; None: bad input
    ("auto", "auto", False): True,
    ("auto", "auto", True): False,
    ("auto", "cpu", False): True,
    ("auto", "cpu", True): True,
    ("auto", "cuda", False): False,
    ("auto", "cuda", True): False,
    ("fork", "auto", False): True,
    ("fork", "auto", True): None,
    ("fork", "cpu", False): True,
    ("fork", "cpu", True): True,
    ("fork", "cuda", False): None,
    ("fork", "cuda", True): None,
    ("exec", "auto", False): False,
    ("exec", "auto", True): False,
    ("exec", "cpu", False): False,
    ("exec", "cpu", True): False,
    ("exec", "cuda", False): False,
    ("exec", "cuda", True): False,
}


def test_workers_are_forked_only_where_none_may_use_cuda_for_every_setting_and_device():
    """A CUDA context does not survive a fork: auto forks CPU workers only, and fork where a worker may
    use CUDA is bad input. The table must cover every choice the config offers."""
    from ddpjob import config
    from ddpjob.launch.worker_fork import SETTINGS, forks

    devices = config.FIELDS["device"].metadata["choices"]
    assert set(WORKER_STARTS) == {(s, d, c) for s in SETTINGS for d in devices for c in (False, True)}
    for (setting, device, cuda), forked in WORKER_STARTS.items():
        if forked is None:
            with pytest.raises(UsageError, match="does not survive a fork"):
                forks(setting, device, cuda)
        else:
            assert forks(setting, device, cuda) is forked, (setting, device, cuda)


def test_a_torch_whose_agent_starts_workers_otherwise_is_one_line_naming_exec(monkeypatch):
    """Another torch without SubprocessHandler._popen: launch cannot fork its workers, and says so
    before any worker or rendezvous (not a traceback, not a silent exec)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    from ddpjob.launch.worker_fork import forking

    monkeypatch.delattr(subprocess_handler.SubprocessHandler, "_popen")
    with pytest.raises(UsageError, match=r"no _popen.*--worker-start exec"), forking(ForkedTrain()):
        pass
