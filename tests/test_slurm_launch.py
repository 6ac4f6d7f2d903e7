"""Slurm detection in `ddpjob launch`: host lists with suffixes, `scontrol show hostnames`, and a
rendezvous port that jobs cannot silently share."""

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpjob import config, launch
from ddpjob.distenv import expand_hostlist, first_host
from ddpjob.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
HEAD = {  # node 0 of a 2-node job under srun: the node that hosts the rendezvous store
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "node[1-2]-ib",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
}


@pytest.fixture
def path(tmp_path, monkeypatch):
    """A PATH with nothing on it but what a test puts there (no real scontrol)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def fake_scontrol(bin_dir, script):
    exe = bin_dir / "scontrol"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def plan_for(env, argv=()):
    parser = config.make_parser("t", "t")
    config.add_config_flags(parser)
    cfg = config.load(parser.parse_args(list(argv)), env)
    return launch.resolve_plan(cfg, env, cuda_devices=0)


def free_slurm_job_id() -> tuple[int, int]:
    """A job id whose derived rendezvous port is free on this host, and that port."""
    for job in range(7000, 7000 + launch.SLURM_PORT_SPAN, 97):
        port = launch.slurm_rdzv_port({}, job)
        if not launch.port_in_use(port):
            return job, port
    raise AssertionError("no free port in the Slurm range")


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-02]-ib", ["node01-ib", "node02-ib"]),
        ("a[1-3,5],b-[01-02]-x", ["a1", "a2", "a3", "a5", "b-01-x", "b-02-x"]),
        ("gpu[03,05-07],cpu1", ["gpu03", "gpu05", "gpu06", "gpu07", "cpu1"]),
        ("rack1-node[010-012]", ["rack1-node010", "rack1-node011", "rack1-node012"]),
        ("r[1-2]n[1-2]-ib", ["r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("node-7,node-[2-3]", ["node-7", "node-2", "node-3"]),
        ("a1,b2", ["a1", "b2"]),
        ("solo", ["solo"]),
    ],
)
def test_host_lists_with_suffixes_and_several_ranges_expand_as_slurm_does(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist", ["", "a[1-2", "a]1[", "a[[1]]", "a[]", "a[3-1]", "a[x]", "a,,b", "a[1-]", ",a"])
def test_malformed_host_lists_are_one_line_naming_the_variable(nodelist):
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST="):
        expand_hostlist(nodelist)


def test_without_scontrol_the_parser_finds_the_suffixed_head_node(path):
    plan = plan_for({**HEAD, "SLURM_NODEID": "1"})
    assert plan.endpoint == "node1-ib:24242"  # not "node1", the name without its suffix
    assert "head node node1-ib" in plan.why


def test_scontrol_show_hostnames_and_node_addr_are_used_when_there_is_scontrol(path):
    fake_scontrol(
        path,
        'case "$2" in\n'
        '  hostnames) [ "$3" = "node[1-2]-ib" ] && printf "node1-ib\\nnode2-ib\\n" ;;\n'
        '  node) [ "$3" = node1-ib ] && echo "NodeName=node1-ib Arch=x86_64 NodeAddr=10.9.8.7 NodeHostName=n1" ;;\n'
        "esac\n",
    )
    plan = plan_for({**HEAD, "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[1-2]-ib"})
    assert plan.endpoint == "10.9.8.7:24242"
    assert "head node node1-ib" in plan.why


def test_a_failing_scontrol_falls_back_to_the_parser(path):
    fake_scontrol(path, "echo 'slurm_load_ctl_conf error' >&2; exit 1\n")
    plan = plan_for({**HEAD, "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]-ib,cpu1"})
    assert plan.endpoint == "gpu07-ib:24242"


def test_jobs_ten_thousand_apart_no_longer_share_a_port_and_ports_stay_below_the_ephemeral_range():
    assert launch.slurm_rdzv_port({}, 4242) != launch.slurm_rdzv_port({}, 14242)
    ports = {launch.slurm_rdzv_port({}, job) for job in range(100_000, 100_000 + launch.SLURM_PORT_SPAN)}
    assert len(ports) == launch.SLURM_PORT_SPAN  # consecutive jobs never share one
    assert min(ports) >= 20000 and max(ports) < 32768  # 32768+: Linux hands those out to outgoing connections


def test_master_port_sets_the_slurm_rendezvous_port(path):
    assert plan_for({**HEAD, "SLURM_NODEID": "1", "MASTER_PORT": "31001"}).endpoint == "node1-ib:31001"
    with pytest.raises(UsageError, match="MASTER_PORT=70000"):
        plan_for({**HEAD, "SLURM_NODEID": "1", "MASTER_PORT": "70000"})


def test_a_port_taken_on_the_head_node_is_one_line_naming_job_port_and_fix(path):
    job, port = free_slurm_job_id()
    other = job + launch.SLURM_PORT_SPAN  # the job whose store holds the same derived port
    assert launch.slurm_rdzv_port({}, other) == port
    with socket.socket() as store:  # the other job's rendezvous store on this head node
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
        store.bind(("", port))
        store.listen()
        with pytest.raises(UsageError) as err:
            plan_for({**HEAD, "SLURM_JOB_ID": str(other)})
        message = str(err.value)
        assert "\n" not in message
        assert f"rendezvous port {port} of Slurm job {other}" in message
        assert "already in use" in message and "MASTER_PORT=" in message
        # Only node 0 binds the port; an explicit endpoint or MASTER_PORT avoids it.
        assert plan_for({**HEAD, "SLURM_JOB_ID": str(other), "SLURM_NODEID": "1"}).endpoint.endswith(f":{port}")
        assert plan_for({**HEAD, "SLURM_JOB_ID": str(other)}, ["--rdzv-endpoint", "h:1"]).endpoint == "h:1"
        _, free = free_slurm_job_id()
        assert plan_for({**HEAD, "SLURM_JOB_ID": str(other), "MASTER_PORT": str(free)}).endpoint.endswith(f":{free}")


def test_a_port_taken_through_ipv6_only_is_seen_too(path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    _, port = free_slurm_job_id()
    try:
        store = socket.socket(socket.AF_INET6)
        store.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(("::", port))
    except OSError:
        pytest.skip("IPv6 sockets cannot be bound here")
    with store:
        store.listen()
        assert launch.port_in_use(port)


def test_the_previous_attempts_time_wait_is_not_a_collision():
    """A requeued job binds its port again at once; a closed connection's TIME_WAIT must not stop it."""
    _, port = free_slurm_job_id()
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server side closes first: its end (local port = `port`) goes to TIME_WAIT
        client.close()
    assert not launch.port_in_use(port)


# slurm/train.sbatch itself, with stand-ins for srun, its step and scancel that behave as Slurm's
# do: srun passes USR1 on to the step but answers TERM by killing the step (SIGKILL, "forcing job
# termination"); `scancel --signal=SIG JOB` signals the step's processes; the step is a node's
# launch, which exits 75 on a stop signal, as workers that checkpointed do. scontrol records its
# arguments. `ddpjob config` is the real one.
FAKES = {
    "srun": """#!/bin/bash
env > "$LOG_DIR/srun.env"
echo "srun $*" >> "$LOG_DIR/srun.log"
step &
pid=$!
trap 'kill -s USR1 $pid' USR1
trap 'echo "srun got TERM: forcing job termination" >> "$LOG_DIR/srun.log"; kill -s KILL $pid' TERM
while :; do wait $pid; rc=$?; kill -0 $pid 2>/dev/null || exit $rc; done
""",
    "step": """#!/bin/bash
stop() { echo "step got $1" >> "$LOG_DIR/srun.log"; exit "${STEP_EXIT:-75}"; }
trap 'stop TERM' TERM
trap 'stop USR1' USR1
echo $$ > "$LOG_DIR/step.pid"
for _ in $(seq 300); do sleep 0.1; done
""",
    "scancel": """#!/bin/bash
echo "scancel $*" >> "$LOG_DIR/scancel.log"
kill -s "${1#--signal=}" "$(cat "$LOG_DIR/step.pid")"
""",
    "scontrol": """#!/bin/bash
echo "scontrol $*" >> "$LOG_DIR/scontrol.log"
""",
}


def run_sbatch(tmp_path, sig, **env):
    """Run the batch script until its step runs, send it `sig`; (exit code, output, logs by name)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, script in FAKES.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "SLURM_", "MASTER_"))}
    job_env = {
        **base,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG_DIR": str(tmp_path),
        "SLURM_JOB_NAME": "ddpjob",
        "SLURM_JOB_ID": "100",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_SUBMIT_DIR": str(REPO),
        "DDPJOB_VENV": str(Path(sys.executable).parent.parent),
        "DDPJOB_RUN_DIR": str(tmp_path / "run"),
        **env,
    }
    proc = subprocess.Popen(
        ["bash", str(REPO / "slurm/train.sbatch"), "--epochs", "1"],
        cwd=tmp_path,
        env=job_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "step.pid").is_file():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the batch script never started its step"
        time.sleep(0.05)
    time.sleep(0.2)  # the script is in its wait loop now
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    logs = {
        name: (tmp_path / f"{name}.log").read_text() if (tmp_path / f"{name}.log").is_file() else "" for name in FAKES
    }
    return proc.returncode, out, logs


def test_an_array_task_requeues_itself_not_the_whole_array(tmp_path):
    # The first task of an array to start has the array's own job id: `scontrol requeue 100` would
    # requeue every task of array 100.
    code, out, logs = run_sbatch(tmp_path, signal.SIGUSR1, SLURM_ARRAY_JOB_ID="100", SLURM_ARRAY_TASK_ID="3")
    assert "step got USR1" in logs["srun"]
    assert logs["scontrol"].splitlines() == ["scontrol requeue 100_3"], out
    assert code == 75 and "requeueing job 100_3" in out


def test_term_reaches_the_step_through_scancel_not_through_srun(tmp_path):
    """srun would SIGKILL the step on TERM: no checkpoint, exit 137. Through scancel the workers stop
    with a checkpoint (75), and the job ends without a requeue."""
    code, out, logs = run_sbatch(tmp_path, signal.SIGTERM)
    assert logs["scancel"].splitlines() == ["scancel --signal=TERM 100"]
    assert "step got TERM" in logs["srun"] and "forcing job termination" not in logs["srun"]
    assert code == 75 and logs["scontrol"] == "" and "got TERM, forwarding" in out


def test_term_in_an_array_task_goes_to_this_task_only(tmp_path):
    code, _, logs = run_sbatch(tmp_path, signal.SIGTERM, SLURM_ARRAY_JOB_ID="100", SLURM_ARRAY_TASK_ID="3")
    assert logs["scancel"].splitlines() == ["scancel --signal=TERM 100_3"] and code == 75


def test_no_kill_on_bad_exit_so_the_first_nodes_75_does_not_kill_the_others(tmp_path):
    _, _, logs = run_sbatch(tmp_path, signal.SIGUSR1)
    srun_line = logs["srun"].splitlines()[0]
    assert "--kill-on-bad-exit=0" in srun_line and "--wait=" in srun_line


def test_requeue_on_term_for_clusters_that_never_send_usr1(tmp_path):
    code, out, logs = run_sbatch(tmp_path, signal.SIGTERM, DDPJOB_REQUEUE_ON_TERM="1")
    assert "step got TERM" in logs["srun"]
    assert logs["scontrol"].splitlines() == ["scontrol requeue 100"], out
    assert code == 75


def test_no_requeue_when_the_workers_did_not_checkpoint(tmp_path):
    code, out, logs = run_sbatch(tmp_path, signal.SIGUSR1, STEP_EXIT="1")
    assert code == 1 and logs["scontrol"] == ""
    assert "not requeueing job 100: the workers exited with 1" in out


def test_the_batch_scripts_own_settings_do_not_reach_ddpjob(tmp_path):
    """ddpjob rejects DDPJOB_* keys it does not know; DDPJOB_VENV & co. are the script's, not ddpjob's."""
    code, out, _ = run_sbatch(
        tmp_path, signal.SIGTERM, DDPJOB_REQUEUE_ON_TERM="0", DDPJOB_APPTAINER="", DDPJOB_PYXIS_IMAGE=""
    )
    assert code == 75, out  # `ddpjob config` ran first and accepted the environment
    srun_env = (tmp_path / "srun.env").read_text().splitlines()
    assert [line for line in srun_env if line.startswith("DDPJOB_")] == [f"DDPJOB_RUN_DIR={tmp_path / 'run'}"]
