"""`docker compose up` on a real Docker engine: a 2-node CPU job from compose.yaml and .env."""

import shutil
import subprocess

import pytest

from e2e import IMAGE, REPO

pytestmark = pytest.mark.e2e


def compose_project(tmp_path, name, dotenv):
    """compose.yaml as shipped, in a project dir whose .env holds the job settings."""
    shutil.copy(REPO / "compose.yaml", tmp_path / "compose.yaml")
    (tmp_path / ".env").write_text(dotenv)
    return ["docker", "compose", "--project-directory", str(tmp_path), "-p", name]


def up(cmd, env, timeout=300):
    env = {**env, "COMPOSE_PROJECT_NAME": cmd[-1]}
    try:
        return subprocess.run(
            [*cmd, "up", "--no-build", "--abort-on-container-failure"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        subprocess.run([*cmd, "down", "--volumes", "--timeout", "5"], env=env, capture_output=True)


def test_compose_up_runs_a_two_node_job_to_a_loadable_checkpoint(tmp_path, docker_env):
    cmd = compose_project(tmp_path, "ddpjob-e2e", "DDPJOB_NNODES=2\nDDPJOB_EPOCHS=3\n")
    env = {**docker_env, "COMPOSE_PROJECT_NAME": "ddpjob-e2e"}
    subprocess.run([*cmd, "down", "--volumes"], env=env, capture_output=True)
    proc = subprocess.run(
        [*cmd, "up", "--no-build", "--abort-on-container-failure"], env=env, capture_output=True, text=True, timeout=300
    )
    try:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert "node-1  | [ddpjob] launch:" in out and "node-2  | [ddpjob] launch:" in out  # which node is which
        assert "done: step 66" in out
        check = (
            "import torch, pathlib; p = max(pathlib.Path('/runs/checkpoints').glob('step-*.pt'), "
            "key=lambda p: int(p.stem[5:])); c = torch.load(p, weights_only=True); "
            "print(p.name, c['step'], c['world_size'], any(k.startswith('module.') for k in c['model']))"
        )
        loaded = subprocess.run(
            ["docker", "run", "--rm", "-v", "ddpjob-e2e_runs:/runs", "--entrypoint", "python", IMAGE, "-c", check],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert loaded.stdout.split() == ["step-66.pt", "66", "2", "False"], loaded.stderr[-2000:]
    finally:
        subprocess.run([*cmd, "down", "--volumes", "--timeout", "5"], env=env, capture_output=True)


def test_compose_stack_exits_with_the_jobs_status_on_bad_input(tmp_path, docker_env):
    cmd = compose_project(tmp_path, "ddpjob-e2e-bad", "DDPJOB_NNODES=2\nDDPJOB_BATCH_SIZE=zero\n")
    proc = up(cmd, docker_env, timeout=120)
    assert proc.returncode != 0
    assert "DDPJOB_BATCH_SIZE='zero' is not an integer" in proc.stdout + proc.stderr


def test_compose_nodes_run_under_an_init_without_capabilities_or_new_privileges(tmp_path, docker_env):
    """compose.yaml's init, cap_drop and no-new-privileges, as the node's processes see them."""
    cmd = compose_project(tmp_path, "ddpjob-e2e-sec", "DDPJOB_NNODES=1\n")
    env = {**docker_env, "COMPOSE_PROJECT_NAME": "ddpjob-e2e-sec"}
    probe = "tr '\\0' ' ' < /proc/1/cmdline; echo; grep -E '^(CapEff|CapBnd|NoNewPrivs):' /proc/self/status"
    try:
        proc = subprocess.run(
            [*cmd, "run", "--rm", "--entrypoint", "sh", "node", "-c", probe],  # ddpjob:cpu is there: no build
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        subprocess.run([*cmd, "down", "--volumes", "--timeout", "5"], env=env, capture_output=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pid1, *status = proc.stdout.strip().splitlines()
    assert "docker-init" in pid1  # PID 1 reaps zombies and forwards signals; ddpjob is its child
    fields = dict(line.split(":\t") for line in status)
    assert fields == {"CapEff": "0000000000000000", "CapBnd": "0000000000000000", "NoNewPrivs": "1"}, fields


def test_containers_run_as_a_non_root_user(docker_env):
    proc = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "id", IMAGE, "-u"],
        env=docker_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "1000"
