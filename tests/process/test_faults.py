"""Fault injection with real processes and real signals: preemption, worker crashes, crashes
mid-save, storage faults, missing nodes, dead peers. Nothing is lost and nothing hangs."""

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ddpjob.checkpoint import atomic_fs, catalogue
from ddpjob.checkpoint.formats import dcp_folder, single_file
from ddpjob.errors import EXIT_NO_RENDEZVOUS
from helpers import (
    PY,
    assert_bitwise_equal,
    clean_env,
    ddpjob,
    final_params,
    in_every_worker,
    injected_ranks,
    ok,
    plain_env_ranks,
    records,
    spawn,
    trained_steps,
    wait_until,
    workers_of,
)
from ports import free_port

# The tests that time a rank, a signal or a deadline are `serial`; the storage faults and
# the records checks hold whatever the timing and run two at a time.
pytestmark = pytest.mark.slow
# Slow enough per step that a signal lands mid-epoch: 128 steps per epoch per rank, 256 in all.
JOB = [
    "--model",
    "ddpjob.plugins:synthetic_mlp(width=512)",
    "--data",
    "ddpjob.plugins:synthetic(samples=8192)",
    "--epochs",
    "2",
    "--log-every",
    "5",
    "--save-every",
    "0",
    "--stop-check-every",
    "1",
]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs in a private mount namespace (root)")


def launch(work: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return spawn(["launch", *args], work, **(env or {}))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("whole")
    ok(ddpjob(["launch", "--nproc-per-node", "2", *JOB], work, timeout=300))
    return final_params(work / "runs/ddpjob")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_stop_signal_checkpoints_exits_75_and_resumes_bitwise(work, uninterrupted, sig):
    run_dir = work / "runs/ddpjob"
    agent = launch(work, "--nproc-per-node", "2", *JOB)
    wait_until(lambda: trained_steps(run_dir) >= 20, 120, "training to start")
    sent = time.monotonic()
    agent.send_signal(sig)
    out = agent.communicate(timeout=180)[0]
    grace = time.monotonic() - sent
    print(f"\n{sig.name}: stopped, checkpointed and exited in {grace:.2f}s")
    assert agent.returncode == 75, out[-3000:]
    (stop,) = [r for r in records(run_dir) if r["event"] == "preempted"]
    assert stop["signal"] == sig and stop["step"] % 128 != 0  # mid-epoch
    assert catalogue.list_steps(run_dir / "checkpoints")[0][0] == stop["step"]

    out = ok(ddpjob(["launch", "--nproc-per-node", "2", *JOB], work, timeout=300))
    starts = [r for r in records(run_dir) if r["event"] == "start"]
    assert starts[-1]["step"] == stop["step"]  # the exact next batch
    assert_bitwise_equal(uninterrupted, final_params(run_dir))


def test_stop_signal_during_async_dcp_saves_seals_them_and_resumes_bitwise(work, uninterrupted):
    run_dir, args = (
        work / "runs/ddpjob",
        [*JOB, "--checkpoint-format", "dcp", "--save-mode", "async", "--save-every", "7"],
    )
    agent = launch(work, "--nproc-per-node", "2", *args)
    wait_until(lambda: trained_steps(run_dir) >= 30, 120, "training to start")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=180)[0]
    assert agent.returncode == 75, out[-3000:]
    (stop,) = [r for r in records(run_dir) if r["event"] == "preempted"]
    newest = catalogue.list_steps(run_dir / "checkpoints")[0]
    assert newest[0] == stop["step"] and dcp_folder.verify(newest[1]) is None
    assert not list((run_dir / "checkpoints").glob(".*tmp"))  # every save in flight was sealed

    ok(ddpjob(["launch", "--nproc-per-node", "2", *args], work, timeout=300))
    assert [r for r in records(run_dir) if r["event"] == "start"][-1]["step"] == stop["step"]
    final = catalogue.list_steps(run_dir / "checkpoints")[0][1]
    assert_bitwise_equal(uninterrupted, dcp_folder.read_model(final))


# A parameter drawn at random must not be in the test's id: each xdist worker collects the tests
# itself, and their lists must agree. Each row draws its step within its third of steps 12..199.
@pytest.mark.parametrize("third", [0, 1, 2])
def test_sigkilled_worker_is_restarted_and_the_run_is_bitwise_equal(work, uninterrupted, third):
    run_dir = work / "runs/ddpjob"
    kill_at = random.randrange(12 + 63 * third, min(200, 75 + 63 * third))
    # from about step kill_at on, each step is 0.1 s slower for 64 steps: the kill lands before the
    # job ends however late this test sees the step (32 samples per step per rank)
    slow = ["--data", f"tests.plugins.stalls:slow_from(after={32 * (kill_at - 2)})"]
    agent = launch(
        work, "--nproc-per-node", "2", "--max-restarts", "1", *JOB[:-4], *slow, "--save-every", "10", "--log-every", "1"
    )
    wait_until(lambda: trained_steps(run_dir) >= kill_at, 120, f"step {kill_at}")
    victim = random.choice(workers_of(agent.pid))
    os.kill(victim, signal.SIGKILL)
    out = agent.communicate(timeout=300)[0]
    print(f"\nkilled worker pid {victim} at step >= {kill_at}")
    assert agent.returncode == 0, out[-3000:]
    starts = [r for r in records(run_dir) if r["event"] == "start"]
    assert [s["restart"] for s in starts] == [0, 1]
    assert starts[1]["step"] > 0 and starts[1]["resumed_from"]
    assert_bitwise_equal(uninterrupted, final_params(run_dir))


@pytest.mark.serial
def test_sigkilled_worker_of_a_two_node_job_is_restarted_bitwise(work, uninterrupted):
    run_dir = work / "runs/ddpjob"
    port = free_port()
    nodes = [
        launch(
            work,
            "--max-restarts",
            "1",
            *JOB[:-4],
            "--save-every",
            "10",
            "--log-every",
            "1",
            env={"DDPJOB_NNODES": "2", "DDPJOB_NODE_RANK": str(n), "DDPJOB_RDZV_ENDPOINT": f"127.0.0.1:{port}"},
        )
        for n in range(2)
    ]
    kill_at = random.randrange(12, 200)
    wait_until(lambda: trained_steps(run_dir) >= kill_at, 120, f"step {kill_at}")
    os.kill(workers_of(nodes[1].pid)[0], signal.SIGKILL)
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    # The agent whose worker died counts a restart; the other re-rendezvouses without counting one,
    # and either may hold rank 0 (which writes the metrics): look at the resume itself.
    starts = [s for s in records(run_dir) if s["event"] == "start"]
    assert len(starts) == 2 and starts[1]["step"] > 0 and starts[1]["resumed_from"]
    assert_bitwise_equal(uninterrupted, final_params(run_dir))


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_newest(tmp_path):
    single_file.save({"step": 1}, single_file.path_for(tmp_path, 1))
    writer = subprocess.Popen(
        [
            PY,
            "-c",
            (
                "import sys, torch; from pathlib import Path; from ddpjob.checkpoint.formats import single_file as checkpoint; "
                "checkpoint.save({'w': torch.ones(300, 1024, 1024)}, checkpoint.path_for(Path(sys.argv[1]), 2))"
            ),
            str(tmp_path),
        ],
        env=clean_env(),
    )
    wait_until(lambda: any(".tmp-" in p.name for p in tmp_path.iterdir()), 60, "the write to start")
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert catalogue.latest_valid(tmp_path) == single_file.path_for(tmp_path, 1)
    assert single_file.read(single_file.path_for(tmp_path, 1))["step"] == 1


def test_truncated_newest_checkpoint_is_skipped_on_resume(work):
    run_dir = work / "runs/ddpjob"
    ok(ddpjob(["train", "--epochs", "2", "--max-steps", "30", "--save-every", "10", "--log-every", "1000"], work))
    newest = single_file.path_for(run_dir / "checkpoints", 30)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    out = ok(ddpjob(["train", "--epochs", "2", "--max-steps", "40", "--log-every", "1000"], work))
    assert "skipping checkpoint runs/ddpjob/checkpoints/step-30.pt" in out and "truncated" in out
    starts = [r for r in records(run_dir) if r["event"] == "start"]
    assert starts[-1]["resumed_from"].endswith("step-20.pt") and starts[-1]["step"] == 20


def in_tmpfs(work: Path, size: str, options: str, args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    """Run ddpjob train (under plain torchrun if nproc > 1: launch's preflight would refuse the
    tiny disk) with its checkpoint dir on a tiny tmpfs in a private mount namespace; what the
    tmpfs held at exit is copied to WORK/ck-after."""
    (work / "ck").mkdir()
    script = f'mount -t tmpfs -o size={size},{options} tmpfs ck && "$@"; rc=$?; cp -a ck ck-after; exit $rc'
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    train = ["-m", "ddpjob", "train", "--checkpoint-dir", "ck", *args]
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "_", PY, *torchrun, *train],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@root_only
@pytest.mark.parametrize(("fmt", "nproc", "size"), [("file", 1, "700k"), ("dcp", 2, "1m")])
def test_disk_full_during_save_fails_fast_and_keeps_the_previous_checkpoint(work, fmt, nproc, size):
    args = ["--epochs", "2", "--save-every", "5", "--keep", "50", "--log-every", "1000", "--checkpoint-format", fmt]
    proc = in_tmpfs(work, size, "rw", args, nproc)
    assert proc.returncode == (3 if nproc == 1 else 1), proc.stderr[-2000:]  # torchrun: 1 when a worker fails
    worker_lines = [ln for ln in proc.stderr.splitlines() if nproc == 1 or ln.startswith("[node ")]
    lines = [ln for ln in worker_lines if "ddpjob: error" in ln]
    # each rank that gets to say it names the cause; torchrun may stop the others first, once one failed
    assert 1 <= len(lines) <= nproc and not any("Traceback" in ln for ln in worker_lines), proc.stderr[-3000:]
    assert all("cannot write checkpoint" in ln and "No space left on device" in ln for ln in lines), lines
    assert nproc == 1 or re.search(r"exitcode\s*: 3\b", proc.stderr)  # any row: the first may be a SIGTERM
    saved = catalogue.list_steps(work / "ck-after")
    assert saved and catalogue.latest_valid(work / "ck-after") == saved[0][1]  # the newest one is whole


@root_only
def test_disk_full_with_warn_policy_trains_on(work):
    proc = in_tmpfs(
        work,
        "700k",
        "rw",
        ["--epochs", "2", "--save-every", "5", "--keep", "5", "--log-every", "1000", "--on-save-error", "warn"],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: checkpoint NOT saved" in proc.stderr and "done: step 88" in proc.stdout


@root_only
def test_read_only_checkpoint_dir_is_bad_input_before_training(work):
    proc = in_tmpfs(work, "1m", "ro", ["--epochs", "1"])
    assert proc.returncode == 2
    assert "is not writable" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.serial
def test_missing_store_host_fails_within_the_rendezvous_timeout_saying_no_count_is_known(work):
    port = free_port()
    start = time.monotonic()
    flags = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "6"]
    proc = spawn(["launch", *flags, "--node-rank", "1", "--run-dir", "runs/1"], work)  # node 0 never comes
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == EXIT_NO_RENDEZVOUS, out[-2000:]
    assert f"rendezvous at 127.0.0.1:{port} for 2 nodes failed" in out
    assert "no count of joined nodes: reading the state from" in out and "Traceback" not in out, out[-2000:]
    assert time.monotonic() - start < 6 + 20  # timeout + start-up and connect retries


@pytest.mark.serial
def test_missing_node_is_counted_by_every_node_that_came_though_the_store_host_left_first(work):
    """Nodes 0 and 1 of 3 come, node 2 never does. Node 1 waits 10 s longer (its own --rdzv-timeout),
    and cannot join before node 0's store is up, so node 0's timeout ends first and node 0 leaves
    with its store while node 1 still waits: the race in which node 1 once said "1 of 3". What is
    guaranteed: both nodes were in the state together for most of node 0's 15 s, both read it every
    second from 1 s after launch, and each counts every node it saw ("at least", never fewer)."""
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", "3", "--rdzv-endpoint", endpoint]
    procs = [
        spawn(
            ["launch", *flags, "--node-rank", str(rank), "--rdzv-timeout", str(timeout), "--run-dir", f"runs/{rank}"],
            work,
        )
        for rank, timeout in ((0, 15), (1, 25))
    ]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == EXIT_NO_RENDEZVOUS, out[-2000:]
        assert f"rendezvous at {endpoint} for 3 nodes failed" in out and "Traceback" not in out, out[-2000:]
        assert "at least 2 of 3 nodes joined (" in out, out[-2000:]
    assert "failed (RendezvousTimeoutError)" in outs[0]  # node 0 left first, at its own timeout


@pytest.mark.serial
@pytest.mark.parametrize(
    ("fault", "within", "words"),
    [
        (signal.SIGKILL, 10, r"Connection (reset|closed) by peer"),  # its sockets close: noticed at once
        (signal.SIGSTOP, 10 + 10, r"Timed out waiting 10000ms|timeout caused pair closure"),  # cut off by the timeout
    ],
)
def test_dead_or_hung_peer_fails_the_survivor_in_one_line_instead_of_hanging(work, fault, within, words):
    procs = plain_env_ranks([*JOB, "--collective-timeout", "10"], work, free_port())
    wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 10, 120, "training to start")
    procs[1].send_signal(fault)
    start = time.monotonic()
    try:
        out = procs[0].communicate(timeout=60)[0]
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, out[-2000:]
    assert time.monotonic() - start < within
    assert "rank 0: a collective failed (" in out and re.search(words, out) and "Traceback" not in out, out[-2000:]


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, as two nodes on one link: (ns, ifname, addr)."""
    hosts = [("ddpjob-part-a", "ddpj-pa", "198.19.1.1"), ("ddpjob-part-b", "ddpj-pb", "198.19.1.2")]
    sh = subprocess.run
    for ns, _, _ in hosts:
        sh(["ip", "netns", "del", ns], capture_output=True)  # left over from an interrupted run
        sh(["ip", "netns", "add", ns], check=True)
        sh(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    (a, a_if, _), (b, b_if, _) = hosts
    sh(["ip", "link", "add", a_if, "netns", a, "type", "veth", "peer", "name", b_if, "netns", b], check=True)
    for ns, ifname, addr in hosts:
        sh(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", ifname], check=True)
        sh(["ip", "-n", ns, "link", "set", ifname, "up"], check=True)
    yield hosts
    for ns, _, _ in hosts:
        sh(["ip", "netns", "del", ns], check=True)


@pytest.mark.serial
@root_only
def test_node_losing_its_network_fails_every_rank_within_the_collective_timeout(work, two_hosts):
    port = free_port()
    procs = []
    for rank, (ns, ifname, _) in enumerate(two_hosts):
        env = clean_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=two_hosts[0][2], MASTER_PORT=str(port))
        cmd = ["ip", "netns", "exec", ns, PY, "-m", "ddpjob", "train", *JOB, "--collective-timeout", "10"]
        env["GLOO_SOCKET_IFNAME"] = ifname
        procs.append(
            subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 10, 120, "training to start")
    ns, ifname, _ = two_hosts[1]
    subprocess.run(["ip", "-n", ns, "link", "set", ifname, "down"], check=True)  # node 1 is cut off
    start = time.monotonic()
    outs = [p.communicate(timeout=60)[0] for p in procs]
    elapsed = time.monotonic() - start
    print(f"\nnetwork loss: both ranks exited in {elapsed:.1f}s:", *[o.splitlines()[-1] for o in outs], sep="\n")
    assert elapsed < 10 + 10
    for rank, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 1, out[-2000:]
        assert f"rank {rank}: a collective failed (" in out and "Traceback" not in out, out[-2000:]


def test_metrics_and_attempts_append_across_restarts(work):
    for attempt in range(2):  # two fresh starts of one run dir, each with a checkpoint dir of its own
        ok(
            ddpjob(
                [
                    "launch",
                    "--epochs",
                    "1",
                    "--log-every",
                    "1000",
                    "--resume",
                    "never",
                    "--checkpoint-dir",
                    f"ck{attempt}",
                ],
                work,
            )
        )
    attempts = [json.loads(ln) for ln in (work / "runs/ddpjob/attempts.jsonl").read_text().splitlines()]
    assert [a["event"] for a in attempts] == ["start", "end", "start", "end"]
    assert all(a["exit_code"] == 0 and a["reason"] == "finished" for a in attempts if a["event"] == "end")
    assert [r["event"] for r in records(work / "runs/ddpjob")].count("start") == 2


# At destroy_process_group in each worker: whether a DDP module is still alive (a reference from the
# failure's traceback); its reducer freed after the group is gone can abort the process at exit.
DDP_AT_DESTROY = """
import os
if "LOCAL_RANK" in os.environ:
    import weakref
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    destroy, init, made = dist.destroy_process_group, DDP.__init__, weakref.WeakSet()

    def noting_init(self, *args, **kwargs):  # a WeakSet sees frozen objects, which gc.get_objects() does not
        made.add(self)
        init(self, *args, **kwargs)
        self.noted_cycle = [self]  # in a cycle for sure: only a collection frees it

    def noting_live_ddp(*args, **kwargs):
        import gc

        with open(os.path.join(os.environ["DDP_NOTES"], os.environ["RANK"]), "w") as f:
            f.write(f"{len(made) > 0} {gc.get_freeze_count() > 0}")  # a DDP alive, anything frozen
        return destroy(*args, **kwargs)

    DDP.__init__ = noting_init
    dist.destroy_process_group = noting_live_ddp
"""


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_failed_loop_frees_its_ddp_model_before_the_process_group_is_destroyed(work, tmp_path_factory, start):
    """Forked (launch's objects frozen at the fork, then set-up's by the loop) or exec'd (set-up's), the
    tear-down thaws everything before its collection, which frees DDP."""
    site, notes = tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("notes")
    env = {**in_every_worker(site, DDP_AT_DESTROY), "DDP_NOTES": str(notes)}
    loss = "tests.plugins.anyjob:failing_loss(at=3)"
    args = ["launch", "--nproc-per-node", "2", "--worker-start", start, "--device", "cpu", "--max-steps", "5"]
    args += ["--loss", loss]
    proc = ddpjob(args, work, **env)
    assert proc.returncode == 1 and injected_ranks(site) == ["0", "1"], proc.stderr[-3000:]
    # the rank that exits first tore down; the agent may then stop the other before its destroy
    noted = {p.name: p.read_text() for p in notes.iterdir()}
    assert noted and set(noted.values()) == {"False False"}, noted


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_an_exception_in_the_users_loss_fails_the_run_and_every_record_says_so(work, save_mode):
    """The user's loss raises in step 7's forward (every rank): the job fails with exit 1 (a failure that
    a scheduler may retry, not 75: no checkpoint of a half-done step), metrics.jsonl's last record and
    attempts.jsonl's end say exit 1 at step 6, and the checkpoints of steps 2, 4 and 6 are sealed (an
    async write in flight finished before the process left), nothing newer and no temporary."""
    run_dir = work / "runs/ddpjob"
    args = ["--epochs", "1", "--max-steps", "10", "--save-every", "2", "--save-mode", save_mode]
    proc = ddpjob(["launch", "--nproc-per-node", "2", *args, "--loss", "tests.plugins.anyjob:failing_loss(at=7)"], work)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the user's loss failed in micro-batch 7" in proc.stdout + proc.stderr
    end = records(run_dir)[-1]
    assert (end["event"], end["step"], end["exit_code"]) == ("end", 6, 1), end
    attempts = [json.loads(ln) for ln in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert attempts[-1]["event"] == "end" and attempts[-1]["exit_code"] == 1, attempts[-1]
    saved = catalogue.list_steps(run_dir / "checkpoints")
    assert [step for step, _ in saved] == [6, 4, 2]
    assert all(catalogue.verify(path) is None for _, path in saved)
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if atomic_fs.is_temp(p.name)]
