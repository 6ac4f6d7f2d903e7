"""`docker compose up` on a real Docker engine: a 2-node CPU job from compose.yaml and .env, the
elastic recipe (compose.elastic.yaml) as nodes join and leave, and the recipe without a shared volume
(compose.s3.yaml) checkpointing to a real S3 server."""

import io
import json
import shutil
import subprocess
import tarfile

import pytest
import torch

from ddpjob.checkpoint import catalogue, storage
from ddpjob.checkpoint.formats import single_file
from ddpjob.train.stop_signal import STOP_SIGNALS
from e2e import IMAGE, REPO, jsonl, volume_dir, wait_for
from helpers import assert_bitwise_equal
from s3server import BUCKET, S3Server

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


def test_compose_elastic_recipe_grows_and_shrinks_and_completes(tmp_path, docker_env):
    """compose.elastic.yaml as documented: head + 1 node train at world size 2, `up --scale node=2`
    adds a node (3), `docker stop` of a node takes it away (2), and the job completes at the final
    step with the same global batch, each change a `resize` record."""
    name = "ddpjob-e2e-elastic"
    shutil.copy(REPO / "compose.elastic.yaml", tmp_path / "compose.elastic.yaml")
    # The test's only addition: a data plug-in that sleeps per sample, so the job lasts ~1.5 s a step.
    (tmp_path / "compose.test.yaml").write_text(
        "services:\n"
        + "".join(
            f"  {service}:\n    volumes: ['{REPO}/tests/e2e/plugins:/plugins:ro']\n"
            "    environment: {PYTHONPATH: /plugins}\n"
            for service in ("head", "node")
        )
    )
    dotenv = (
        "DDPJOB_EPOCHS=4\nDDPJOB_DATA=slow_digits:digits(delay=0.03)\nDDPJOB_SAVE_EVERY=3\n"
        "DDPJOB_LOG_EVERY=1\nDDPJOB_STOP_CHECK_EVERY=2\n"
    )
    files = ["compose.yaml", "compose.elastic.yaml", "compose.test.yaml"]
    cmd = [*compose_project(tmp_path, name, dotenv), *(a for f in files for a in ("-f", str(tmp_path / f)))]
    env = {**docker_env, "COMPOSE_PROJECT_NAME": name}
    final = 4 * (1437 // 96)  # digits: 1437 training samples, 14 steps of the global batch 96 an epoch

    def logs():
        out = subprocess.run([*cmd, "logs", "--no-color"], env=env, capture_output=True, text=True)
        return (out.stdout + out.stderr)[-6000:]

    def metrics():
        runs = volume_dir(env, f"{name}_runs")
        return jsonl(runs / "metrics.jsonl") if runs else []

    def started(world):
        return [r for r in metrics() if r["event"] == "start" and r["world_size"] == world]

    def compose(*args, timeout=120):
        proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def exit_code(container, timeout):
        proc = subprocess.run(["docker", "wait", container], env=env, capture_output=True, text=True, timeout=timeout)
        return int(proc.stdout.strip()) if proc.returncode == 0 else proc.stderr

    subprocess.run([*cmd, "down", "--volumes"], env=env, capture_output=True)
    try:
        compose("up", "-d", "--no-build")  # head + 1 node
        try:
            wait_for(lambda: started(2), 180, "a start at world size 2 (head + node-1)")
            compose("up", "-d", "--no-build", "--no-recreate", "--scale", "node=2")  # a node joins
            wait_for(lambda: started(3), 180, "a start at world size 3 after --scale node=2")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from None
        subprocess.run(["docker", "stop", f"{name}-node-2"], env=env, capture_output=True, timeout=200)
        head = subprocess.run(
            [*cmd, "wait", "head"], env=env, capture_output=True, timeout=400
        ).returncode  # as documented
        out = logs()
        assert head == 0, out
        assert exit_code(f"{name}-node-2", 10) == 75, out  # it left after the agreed checkpoint
        assert exit_code(f"{name}-node-1", 60) == 0, out  # it trained on to the end with the head

        runs = volume_dir(env, f"{name}_runs")
        records = jsonl(runs / "metrics.jsonl")
        resizes = [(r["old_world_size"], r["world_size"]) for r in records if r["event"] == "resize"]
        assert (2, 3) in resizes and resizes[-1] == (3, 2), (resizes, out)
        assert {r["global_batch"] for r in records if r["event"] in ("start", "resize")} == {96}
        attempts = [r for r in jsonl(runs / "attempts.jsonl") if r.get("event") == "resize"]
        assert [(r["old_world_size"], r["world_size"]) for r in attempts] == resizes
        starts = [r for r in records if r["event"] == "start"]
        print("starts (step, world size):", [(r["step"], r["world_size"]) for r in starts], "resizes:", resizes)
        assert all(r["resumed_from"] for r in starts[1:]), starts  # every later start resumed, none started over
        assert max(r["step"] for r in records if r["event"] == "train") == final
        newest = max((runs / "checkpoints").glob("step-*.pt"), key=lambda p: int(p.stem[5:]))
        ckpt = torch.load(newest, weights_only=True)
        assert (newest.name, ckpt["step"], ckpt["world_size"]) == (f"step-{final}.pt", final, 2)
    finally:
        subprocess.run([*cmd, "down", "--volumes", "--timeout", "5"], env=env, capture_output=True)


def test_compose_runs_the_lm_example_preempted_and_resumed_to_its_held_out_loss(tmp_path, docker_env):
    """The image's examples/ (examples.lm) on 2 nodes from .env alone: `docker compose stop` mid-run
    (TERM) checkpoints and exits 75 on both nodes, `up` again resumes from that step to the end and
    the final record holds the held-out loss in bits per byte."""
    name = "ddpjob-e2e-lm"
    max_steps = 40
    # OMP_NUM_THREADS=1: two 1-process nodes on a shared 2-core host; torch's default thread count
    # (the host's cores, per node) makes a step 10-20x slower there.
    dotenv = (
        "DDPJOB_NNODES=2\nDDPJOB_MODEL=examples.lm:tiny_lm\nDDPJOB_DATA=examples.lm:stdlib_text\n"
        f"DDPJOB_EPOCHS=1\nDDPJOB_MAX_STEPS={max_steps}\nDDPJOB_BATCH_SIZE=4\nDDPJOB_LOG_EVERY=1\n"
        "DDPJOB_SAVE_EVERY=0\nDDPJOB_STOP_CHECK_EVERY=1\nOMP_NUM_THREADS=1\n"
    )
    cmd = compose_project(tmp_path, name, dotenv)
    env = {**docker_env, "COMPOSE_PROJECT_NAME": name}
    nodes = [f"{name}-node-1", f"{name}-node-2"]

    def compose(*args, timeout=200):
        return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)

    def records():
        runs = volume_dir(env, f"{name}_runs")
        return jsonl(runs / "metrics.jsonl") if runs else []

    def logs():
        out = compose("logs", "--no-color")
        return (out.stdout + out.stderr)[-6000:]

    def state(container):
        fmt = "{{.State.Status}} {{.State.ExitCode}}"
        out = subprocess.run(["docker", "inspect", "-f", fmt, container], env=env, capture_output=True, text=True)
        return out.stdout.strip()

    def trained_or_exited():
        if any(r["event"] == "train" and r["step"] >= 2 for r in records()):
            return "trained"
        return next((s for s in map(state, nodes) if s.startswith("exited")), None)

    compose("down", "--volumes")
    try:
        up = compose("up", "-d", "--no-build")
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            trained = wait_for(trained_or_exited, 180, "LM steps")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from None
        assert trained == "trained", logs()  # not a node that exited first (an examples.lm that did not import)
        stop = compose("stop")  # TERM through docker-init to `ddpjob launch` on both nodes
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert [state(n) for n in nodes] == ["exited 75", "exited 75"], logs()
        (preempted,) = [r for r in records() if r["event"] == "preempted"]
        assert 2 <= preempted["step"] < max_steps

        again = compose("up", "--no-build", "--abort-on-container-failure", timeout=300)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        final = records()
        starts = [r for r in final if r["event"] == "start"]
        assert [r["step"] for r in starts] == [0, preempted["step"]], starts
        assert starts[1]["resumed_from"].endswith(f"step-{preempted['step']}.pt")
        (last,) = [r for r in final if r["event"] == "final"]
        assert last["step"] == max_steps and 0 < last["bits_per_token"] < 8, last
    finally:
        compose("down", "--volumes", "--timeout", "5")


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_compose_kill_with_each_stop_signal_exits_75_with_a_verified_checkpoint_of_the_stop(tmp_path, docker_env, sig):
    """The stop-path table's compose rows (tests/test_stop_paths.py): `docker compose kill -s SIG`
    (`docker compose stop` is its TERM row) reaches `ddpjob launch` through docker-init on both
    nodes; both exit 75 with one verified checkpoint of the stop step."""
    name = f"ddpjob-e2e-{sig.name.lower()}"
    dotenv = (
        "DDPJOB_NNODES=2\nDDPJOB_EPOCHS=200\nDDPJOB_LOG_EVERY=1\nDDPJOB_SAVE_EVERY=0\n"
        "DDPJOB_STOP_CHECK_EVERY=1\nOMP_NUM_THREADS=1\n"
    )
    cmd = compose_project(tmp_path, name, dotenv)
    env = {**docker_env, "COMPOSE_PROJECT_NAME": name}
    nodes = [f"{name}-node-1", f"{name}-node-2"]

    def compose(*args):
        return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=200)

    def runs():
        return volume_dir(env, f"{name}_runs")

    def states():
        fmt = "{{.State.Status}} {{.State.ExitCode}}"
        out = [
            subprocess.run(["docker", "inspect", "-f", fmt, n], env=env, capture_output=True, text=True) for n in nodes
        ]
        return [o.stdout.strip() for o in out]

    compose("down", "--volumes")
    try:
        assert compose("up", "-d", "--no-build").returncode == 0
        wait_for(
            lambda: runs() and any(r["event"] == "train" for r in jsonl(runs() / "metrics.jsonl")), 180, "training"
        )
        assert compose("kill", "-s", sig.name).returncode == 0
        try:
            wait_for(lambda: all(s.startswith("exited") for s in states()), 180, "both nodes to exit")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {states()}\n{compose('logs', '--no-color').stdout[-6000:]}") from None
        assert states() == ["exited 75", "exited 75"], compose("logs", "--no-color").stdout[-4000:]
        (preempted,) = [r for r in jsonl(runs() / "metrics.jsonl") if r["event"] == "preempted"]
        saved = [s for s, p in catalogue.list_steps(runs() / "checkpoints") if catalogue.verify(p) is None]
        assert saved == [preempted["step"]] and preempted["signal"] == sig, saved
    finally:
        compose("down", "--volumes", "--timeout", "5")


def test_compose_nodes_without_a_shared_volume_resume_from_s3_bitwise(tmp_path, docker_env, monkeypatch):
    """compose.s3.yaml as documented: 2 nodes, each with its own run dir (no volume), checkpoints in a
    bucket of a real S3 server (SeaweedFS on the Docker bridge's address), credentials from the
    environment. `docker compose stop` checkpoints to the bucket and exits 75 on both nodes; `up` in
    new containers (nothing local survives) resumes from the bucket, and the final weights equal an
    uninterrupted run's bitwise."""
    name, max_steps = "ddpjob-e2e-s3", 30
    bridge = subprocess.run(
        ["docker", "network", "inspect", "bridge", "-f", "{{(index .IPAM.Config 0).Gateway}}"],
        env=docker_env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    server = S3Server(tmp_path / "s3", ip=bridge).start()
    for key, value in server.env().items():  # for this process's reads of the bucket
        monkeypatch.setenv(key, value)
    shutil.copy(REPO / "compose.s3.yaml", tmp_path / "compose.s3.yaml")
    (tmp_path / "compose.test.yaml").write_text(  # the slow data plug-in: a job long enough to stop
        f"services:\n  node:\n    volumes: ['{REPO}/tests/e2e/plugins:/plugins:ro']\n"
        "    environment: {PYTHONPATH: /plugins}\n"
    )
    job = (
        "DDPJOB_NNODES=2\nDDPJOB_DATA=slow_digits:digits(delay=0.02)\nDDPJOB_EPOCHS=10\n"
        f"DDPJOB_MAX_STEPS={max_steps}\nDDPJOB_LOG_EVERY=1\nDDPJOB_SAVE_EVERY=0\nDDPJOB_STOP_CHECK_EVERY=1\n"
        "OMP_NUM_THREADS=1\n"
    )
    files = ["compose.yaml", "compose.s3.yaml", "compose.test.yaml"]
    cmd = [*compose_project(tmp_path, name, job), *(a for f in files for a in ("-f", str(tmp_path / f)))]
    env = {**docker_env, **server.env(), "COMPOSE_PROJECT_NAME": name}
    nodes = [f"{name}-node-1", f"{name}-node-2"]
    whole, split = f"s3://{BUCKET}/whole", f"s3://{BUCKET}/split"

    def compose(*args, timeout=200):
        return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)

    def prefix(url):  # the job's checkpoint dir, in the .env compose.s3.yaml reads it from
        (tmp_path / ".env").write_text(f"{job}DDPJOB_CHECKPOINT_DIR={url}\n")

    def steps(url):
        return sorted(s for s, _ in catalogue.complete(storage.location(url)))

    def inspect(fmt):
        out = [
            subprocess.run(["docker", "inspect", "-f", fmt, n], env=env, capture_output=True, text=True) for n in nodes
        ]
        return [o.stdout.strip() for o in out]

    def logs():
        out = compose("logs", "--no-color")
        return (out.stdout + out.stderr)[-6000:]

    def records():  # the metrics records in the nodes' own run dirs (rank 0's holds them)
        found = []
        for node in nodes:
            got = subprocess.run(["docker", "cp", f"{node}:/runs/metrics.jsonl", "-"], env=env, capture_output=True)
            if got.returncode == 0:  # a tar stream of the one file
                with tarfile.open(fileobj=io.BytesIO(got.stdout)) as tar:
                    text = tar.extractfile("metrics.jsonl").read().decode()  # type: ignore[union-attr]
                found += [json.loads(line) for line in text.split("\n")[:-1]]  # whole lines only
        return found

    def trained_or_exited():
        if any(r["event"] == "train" and r["step"] >= 3 for r in records()):
            return "trained"
        return next((s for s in inspect("{{.State.Status}}") if s == "exited"), None)

    compose("down", "--volumes")
    try:
        prefix(whole)
        once = compose("up", "--no-build", "--abort-on-container-failure", timeout=400)
        assert once.returncode == 0, (once.stdout + once.stderr)[-4000:]
        assert steps(whole) == [max_steps]
        assert server.env()["AWS_SECRET_ACCESS_KEY"] not in once.stdout + once.stderr
        compose("down", "--timeout", "5")

        prefix(split)
        up = compose("up", "-d", "--no-build")
        assert up.returncode == 0, up.stdout + up.stderr
        mounts = "{{range .Mounts}}{{.Type}}:{{.Destination}}:{{.RW}} {{end}}"
        assert inspect(mounts) == ["bind:/plugins:false"] * 2  # no volume: each node's /runs is its own
        try:
            trained = wait_for(trained_or_exited, 180, "3 steps")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from None
        assert trained == "trained", logs()
        stop = compose("stop")  # TERM: both nodes checkpoint to the bucket and exit 75
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert inspect("{{.State.Status}} {{.State.ExitCode}}") == ["exited 75", "exited 75"], logs()
        (preempted,) = steps(split)
        assert 0 < preempted < max_steps, preempted

        again = compose("up", "--no-build", "--force-recreate", "--abort-on-container-failure", timeout=400)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        # New containers: their run dirs begin with this start, which resumed from the bucket.
        starts = [r for r in records() if r["event"] == "start"]
        assert starts and all(r["step"] == preempted for r in starts), starts
        assert all(r["resumed_from"] == f"{split}/step-{preempted}.pt" for r in starts), starts
        assert steps(split)[-1] == max_steps
        name_ = f"step-{max_steps}.pt"
        assert_bitwise_equal(
            single_file.read(storage.location(f"{whole}/{name_}"))["model"],
            single_file.read(storage.location(f"{split}/{name_}"))["model"],
        )
    finally:
        compose("down", "--volumes", "--timeout", "5")
        server.stop()
