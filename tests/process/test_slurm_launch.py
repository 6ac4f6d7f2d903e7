"""Slurm detection in `ddpjob launch`: host lists with suffixes, `scontrol show hostnames`, and a
rendezvous port that jobs cannot silently share."""

import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import PYTHONPATH
from launch_cases import SLURM_HEAD, config_and_plan

REPO = Path(__file__).resolve().parents[2]


def fake_scontrol(bin_dir, script):
    exe = bin_dir / "scontrol"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_scontrol_show_hostnames_and_node_addr_are_used_when_there_is_scontrol(path):
    fake_scontrol(
        path,
        'case "$2" in\n'
        '  hostnames) [ "$3" = "node[1-2]-ib" ] && printf "node1-ib\\nnode2-ib\\n" ;;\n'
        '  node) [ "$3" = node1-ib ] && echo "NodeName=node1-ib Arch=x86_64 NodeAddr=10.9.8.7 NodeHostName=n1" ;;\n'
        "esac\n",
    )
    plan = config_and_plan({**SLURM_HEAD, "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[1-2]-ib"})[1]
    assert plan.endpoint == "10.9.8.7:24242"
    assert "head node node1-ib" in plan.why


def test_a_failing_scontrol_falls_back_to_the_parser(path):
    fake_scontrol(path, "echo 'slurm_load_ctl_conf error' >&2; exit 1\n")
    plan = config_and_plan({**SLURM_HEAD, "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]-ib,cpu1"})[1]
    assert plan.endpoint == "gpu07-ib:24242"


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
until [ -s "$LOG_DIR/step.pid" ]; do sleep 0.01; done
touch "$LOG_DIR/srun.ready"  # its traps are set and its step runs
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


def run_sbatch(tmp_path, sig, ready="srun.ready", args=("--epochs", "1"), **env):
    """Run the batch script with ddpjob flags `args` until file `ready` appears (srun's traps are set and
    its step runs), send it `sig`, then mark it sent (file `signalled`); (exit code, output, logs by name)."""
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
        ["bash", str(REPO / "slurm/train.sbatch"), *args],
        cwd=tmp_path,
        env=job_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / ready).is_file():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"the batch script never got to {ready}"
        time.sleep(0.05)
    proc.send_signal(sig)
    (tmp_path / "signalled").touch()
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


def sbatch_options(script: Path) -> list[str]:
    return [line.split()[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]


@pytest.mark.parametrize("script", sorted((REPO / "slurm").glob("*.sbatch")), ids=lambda p: p.name)
def test_every_batch_script_requests_gpus_and_cpus_per_node(script):
    """Without them a shared node grants one CPU and, where devices are constrained, no GPU: launch
    would count 0 GPUs and train on one CPU core."""
    options = sbatch_options(script)
    assert any(o.startswith(("--gpus-per-node=", "--gres=gpu:")) for o in options), options
    assert any(o.startswith("--cpus-per-task=") or o == "--exclusive" for o in options), options


@pytest.mark.parametrize("script", sorted((REPO / "slurm").glob("*.sbatch")), ids=lambda p: p.name)
def test_every_batch_scripts_output_folder_comes_with_a_clone(script):
    """Slurm opens --output and --error in the submit dir before the script's first line and does not
    make their folder: without it the job dies at once with nothing written anywhere."""
    files = [o.split("=", 1)[1] for o in sbatch_options(script) if o.startswith(("--output=", "--error="))]
    assert files, "no --output: Slurm's default slurm-%j.out lands in the submit dir"
    for folder in {str(Path(f).parent) for f in files}:
        tracked = subprocess.run(["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True).stdout
        assert tracked.strip(), f"{folder}/ holds no tracked file: a fresh clone would not have it"


GRANTS = [  # (what Slurm sets in the batch script's env, the --cpus-per-task srun must get)
    ({"SLURM_CPUS_PER_TASK": "64", "SLURM_JOB_CPUS_PER_NODE": "128(x2)", "SLURM_CPUS_ON_NODE": "128"}, "64"),
    ({"SLURM_JOB_CPUS_PER_NODE": "96(x2)", "SLURM_CPUS_ON_NODE": "96"}, "96"),
    # mixed node sizes (--exclusive on a partition of 72- and 36-CPU nodes): the batch host's 72
    # would make srun fail "More processors requested than permitted" on the 36-CPU node
    ({"SLURM_JOB_CPUS_PER_NODE": "72(x2),36", "SLURM_CPUS_ON_NODE": "72"}, "36"),
    ({"SLURM_JOB_CPUS_PER_NODE": "2,1", "SLURM_CPUS_ON_NODE": "2"}, "1"),
    ({"SLURM_JOB_CPUS_PER_NODE": "36,72(x3)", "SLURM_CPUS_ON_NODE": "72"}, "36"),
    ({"SLURM_CPUS_ON_NODE": "8"}, "8"),  # no allocation-wide count: this node's
]


@pytest.mark.parametrize(("granted", "passed"), GRANTS)
def test_srun_cpus_are_the_fewest_any_node_of_the_allocation_has(granted, passed):
    """The batch scripts' srun_cpus (slurm/srun-cpus.sh): --cpus-per-task when the job set it, else
    the smallest count of SLURM_JOB_CPUS_PER_NODE ("72(x2),36"), else the batch host's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | granted
    script = f"source {REPO / 'slurm/srun-cpus.sh'} && srun_cpus"
    proc = subprocess.run(["bash", "-uc", script], env=env, capture_output=True, text=True)
    assert (proc.returncode, proc.stdout.strip()) == (0, passed), proc.stderr


@pytest.mark.parametrize(("granted", "passed"), [GRANTS[0], GRANTS[2]])
def test_srun_is_given_the_cpus_granted_to_each_task(tmp_path, granted, passed):
    """srun (Slurm >= 22.05) does not inherit sbatch's --cpus-per-task: every worker and DataLoader
    worker of a node would share one CPU. With --exclusive the step gets all of the node's."""
    _, out, logs = run_sbatch(tmp_path, signal.SIGTERM, **granted)
    assert f"--cpus-per-task={passed}" in logs["srun"].splitlines()[0].split(), out


def test_preflight_srun_is_given_the_fewest_cpus_of_any_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\necho "srun $*" > "$LOG_DIR/srun.log"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "SLURM_"))} | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG_DIR": str(tmp_path),
        "SLURM_JOB_NAME": "ddpjob-preflight",
        "SLURM_JOB_ID": "7",
        "SLURM_SUBMIT_DIR": str(REPO),
        **GRANTS[2][0],
    }
    proc = subprocess.run(["bash", str(REPO / "slurm/preflight.sbatch")], cwd=tmp_path, env=env, text=True)
    assert proc.returncode == 0
    assert f"--cpus-per-task={GRANTS[2][1]}" in (tmp_path / "srun.log").read_text().split()


def image_env() -> dict[str, str]:
    """The variables docker/Dockerfile's ENV instructions set in the image."""
    text = (REPO / "docker/Dockerfile").read_text().replace("\\\n", " ")
    pairs = [w for line in text.splitlines() if line.startswith("ENV ") for w in shlex.split(line)[1:]]
    return dict(p.split("=", 1) for p in pairs)


@pytest.mark.parametrize("image_run_dir", [image_env()["DDPJOB_RUN_DIR"], "/elsewhere"])
def test_under_pyxis_the_run_dir_is_the_jobs_whatever_the_image_sets(tmp_path, image_run_dir):
    """Pyxis starts the step in the image with the image's ENV over the job's environment: the
    ddpjob image's DDPJOB_RUN_DIR=/runs (unmounted there) would take the checkpoints, and every
    requeue would start at step 0. What the step's `ddpjob launch` resolves must be the job's."""
    _, out, logs = run_sbatch(tmp_path, signal.SIGTERM, DDPJOB_PYXIS_IMAGE="ddpjob:cpu")
    srun = logs["srun"].splitlines()[0].split()
    assert "--container-image=ddpjob:cpu" in srun, out
    args = srun[srun.index("launch") + 1 :]
    job_env = dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines() if "=" in line)
    in_container = {**job_env, **image_env(), "DDPJOB_RUN_DIR": image_run_dir, "PYTHONPATH": PYTHONPATH}
    resolved = subprocess.run(
        [sys.executable, "-m", "ddpjob", "config", *args], env=in_container, capture_output=True, text=True, check=True
    ).stdout
    assert f"DDPJOB_RUN_DIR={tmp_path / 'run'}" in resolved.splitlines()


def container_mounts(srun_line: str, runtime: str) -> set[str]:
    """The paths srun's container sees from the host: Pyxis --container-mounts=SRC:DST,..., or
    apptainer exec --bind SRC[:DST],... (the destinations)."""
    words = srun_line.split()
    if runtime == "pyxis":
        (value,) = [w.removeprefix("--container-mounts=") for w in words if w.startswith("--container-mounts=")]
    else:
        value = words[words.index("--bind") + 1]
    return {entry.split(":")[1] if ":" in entry else entry for entry in value.split(",")}


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_a_container_mounts_a_run_dir_and_checkpoint_dir_outside_the_submit_dir(tmp_path, runtime):
    """An absolute DDPJOB_RUN_DIR elsewhere (/lustre/...) that the container does not mount takes
    the checkpoints into the container's throwaway root: every requeue would start at step 0."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/apptainer").write_text("#!/bin/bash\n")  # the config check passes
    (tmp_path / "bin/apptainer").chmod(0o755)
    image = {"pyxis": {"DDPJOB_PYXIS_IMAGE": "ddpjob:cpu"}, "apptainer": {"DDPJOB_APPTAINER": "ddpjob.sif"}}[runtime]
    checkpoints = tmp_path / "scratch/ckpt"
    _, out, logs = run_sbatch(tmp_path, signal.SIGTERM, DDPJOB_CHECKPOINT_DIR=str(checkpoints), **image)
    run_dir = tmp_path / "run"
    assert not run_dir.is_relative_to(REPO)  # outside the submit dir, which is mounted anyway
    mounts = container_mounts(logs["srun"].splitlines()[0], runtime)
    assert {str(REPO), str(run_dir), str(checkpoints)} <= mounts, out
    assert run_dir.is_dir() and checkpoints.is_dir()  # a mount's source must exist


@pytest.mark.parametrize("form", ["--run-dir={}", "--run-dir {}", "--checkpoint-dir={}", "--checkpoint-dir {}"])
def test_a_container_mounts_a_dir_given_as_a_flag(tmp_path, form):
    elsewhere = tmp_path / "lustre/team/x"
    args = form.format(elsewhere).split()
    _, out, logs = run_sbatch(tmp_path, signal.SIGTERM, args=args, DDPJOB_PYXIS_IMAGE="ddpjob:cpu")
    assert str(elsewhere) in container_mounts(logs["srun"].splitlines()[0], "pyxis"), out


FAKE_DDPJOB = """#!/bin/bash
# `ddpjob config` as slow as importing torch from a shared filesystem: it ends after the signal was sent
if [ "$1" = config ]; then
    touch "$LOG_DIR/config.started"
    until [ -e "$LOG_DIR/signalled" ]; do sleep 0.01; done
fi
"""


@pytest.mark.parametrize(("sig", "requeued"), [(signal.SIGUSR1, ["scontrol requeue 100"]), (signal.SIGTERM, [])])
def test_a_signal_while_ddpjob_config_runs_is_handled_not_fatal(tmp_path, sig, requeued):
    """--signal=B:USR1 can come while `ddpjob config` still imports torch: without a trap yet, bash
    dies of it (exit 138) and the job is not requeued. The step is then not started at all."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/ddpjob").write_text(FAKE_DDPJOB)
    (venv / "bin/ddpjob").chmod(0o755)
    code, out, logs = run_sbatch(tmp_path, sig, ready="config.started", DDPJOB_VENV=str(venv))
    assert code == 75, out
    assert logs["scontrol"].splitlines() == requeued, out
    assert logs["srun"] == "" and "before the job step started" in out
