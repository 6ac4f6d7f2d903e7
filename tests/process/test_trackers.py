"""Experiment trackers with real parts: a real `mlflow server` (SQLite) on localhost and W&B in
offline mode, each across a SIGTERM -> checkpoint -> resume of a 2-process torchrun job: one run,
steps that neither restart nor repeat. A dead server only warns; a missing package is one line."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpjob.train.trackers import QUEUE_SIZE, Tracker, is_local_store
from helpers import PY, PYTHONPATH, clean_env, ddpjob, launched, ok, records, spawn, trained_steps, wait_until
from ports import free_port

pytestmark = pytest.mark.slow
# ~0.13 s per step (a sleep per sample fetched): the tracker starts, and a signal lands, mid-run; a
# test that has acted makes samples/acted, and the rest runs at full speed.
JOB = ["--data", "tests.plugins.recording:digits(delay=0.004, until='acted')", "--epochs", "10", "--log-every", "4"]
JOB += ["--save-every", "0", "--stop-check-every", "1"]


@contextlib.contextmanager
def serve_mlflow(home: Path) -> Iterator[str]:
    """A real MLflow tracking server on a free localhost port with a SQLite backend; its URL."""
    port = free_port()
    command = [str(Path(PY).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db"]
    command += ["--default-artifact-root", str(home / "artifacts"), "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        [*command, "--workers", "1"],
        cwd=home,
        # without mlflow's job runner and its huey consumers: about 25 s of CPU per server, unused here
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.DEVNULL,
        stderr=(home / "server.log").open("w"),
        start_new_session=True,  # its workers die with it
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
        except OSError:
            assert server.poll() is None, (home / "server.log").read_text()[-3000:]
            return False

    try:
        wait_until(answers, 240, "mlflow server")
        yield url
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)  # the server and its workers
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[str]:
    with serve_mlflow(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


def preempt_and_resume(work: Path, args: list[str], keep_state: bool = True, **env: str) -> tuple[int, int]:
    """Launch 2 processes, SIGTERM once the tracker runs and training is under way (exit 75, a
    checkpoint), launch again to the end; keep_state=False removes RUN_DIR/tracker.json in between, so
    that only the checkpoint names the run. Returns the step the first attempt stopped at and the last."""
    run_dir = work / "runs/ddpjob"
    (work / "samples").mkdir()
    env["TEST_SAMPLES_DIR"] = str(work / "samples")
    agent = spawn(["launch", "--nproc-per-node", "2", *JOB, *args], work, **env)
    wait_until(lambda: (run_dir / "tracker.json").exists() and trained_steps(run_dir) >= 8, 240, "tracker run")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=240)[0]
    assert agent.returncode == 75, out[-3000:]
    (stop,) = [r for r in records(run_dir) if r["event"] == "preempted"]
    assert stop["step"] > 0
    (work / "samples/acted").touch()
    if not keep_state:
        (run_dir / "tracker.json").unlink()
    ok(ddpjob(["launch", "--nproc-per-node", "2", *JOB, *args], work, timeout=400, **env))
    assert [r["step"] for r in records(run_dir) if r["event"] == "start"] == [0, stop["step"]]
    (final,) = [r for r in records(run_dir) if r["event"] == "final"]
    assert stop["step"] < final["step"]
    return int(stop["step"]), int(final["step"])


def default_store_runs(run_dir: Path) -> tuple[Any, list[Any]]:
    """A client of RUN_DIR's default SQLite store, and the runs of its experiment "ddpjob"."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    return client, client.search_runs([client.get_experiment_by_name("ddpjob").experiment_id])


def assert_one_run_of_monotonic_steps(steps: list[int], stop: int, total: int) -> None:
    assert steps == sorted(set(steps)), steps  # strictly increasing: none repeated, none backwards
    assert steps[-1] == total
    assert any(s <= stop for s in steps) and any(s > stop for s in steps)  # both attempts in it


def test_mlflow_server_holds_one_run_with_monotonic_steps_across_sigterm_and_resume(work, mlflow_server):
    import mlflow

    stop, total = preempt_and_resume(
        work, ["--tracker", "mlflow", "--tracker-uri", mlflow_server, "--tracker-project", "t1"], keep_state=False
    )
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("t1")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == json.loads((work / "runs/ddpjob/tracker.json").read_text())["run_id"]
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.003" and run.data.params["tracker"] == "mlflow"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert_one_run_of_monotonic_steps(steps, stop, total)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "start/world_size")] == [0, stop]


def wandb_records(path: Path) -> Iterator[object]:
    """The protobuf records of a W&B .wandb file (a LevelDB-style log of 32 KiB blocks after a
    7-byte header); wandb itself no longer ships a Python reader."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_wandb_offline_keeps_one_run_id_with_monotonic_steps_across_sigterm_and_resume(work):
    wandb_dir = work / "wandb-home"
    wandb_dir.mkdir()
    stop, total = preempt_and_resume(work, ["--tracker", "wandb"], WANDB_MODE="offline", WANDB_DIR=str(wandb_dir))
    attempts = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    run_id = json.loads((work / "runs/ddpjob/tracker.json").read_text())["run_id"]
    assert len(attempts) == 2 and all(a.name.endswith(f"-{run_id}") for a in attempts)
    steps, configs = [], []
    for attempt in attempts:
        for record in wandb_records(attempt / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")  # type: ignore[attr-defined]
            if kind == "history":
                keys = {item.key or "/".join(item.nested_key) for item in record.history.item}  # type: ignore[attr-defined]
                if "train/loss" in keys:
                    steps.append(record.history.step.num)  # type: ignore[attr-defined]
            elif kind == "run":
                configs.append({item.key for item in record.run.config.update})  # type: ignore[attr-defined]
    assert_one_run_of_monotonic_steps(steps, stop, total)
    assert "lr" in configs[0] and all("lr" not in c for c in configs[1:])  # the config once, with the new run


def test_default_mlflow_store_is_sqlite_in_the_run_dir(work):

    args = ["--max-steps", "12", "--log-every", "4", "--tracker", "mlflow", "--tracker-every", "0"]
    ok(ddpjob(["train", "--device", "cpu", *args], work))
    store = work / "runs/ddpjob/mlflow.db"
    assert store.is_file()
    client, (run,) = default_store_runs(store.parent)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [4, 8, 12]
    assert run.data.params["max_steps"] == "12"


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A server that accepts connections and never answers: its URL."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in [*held, listener]:
            conn.close()


def exit_hook(work: Path) -> dict[str, str]:
    """Env for a child whose sitecustomize marks work/loaded, and work/finalized from an exit hook
    registered first (so run last): that mark is made only if the interpreter is finalized."""
    hook = work / "hook"
    hook.mkdir()
    marks = {name: str(work / name) for name in ("loaded", "finalized")}
    (hook / "sitecustomize.py").write_text(
        f"import atexit, pathlib\npathlib.Path({marks['loaded']!r}).touch()\n"
        f"atexit.register(pathlib.Path({marks['finalized']!r}).touch)\n"
    )
    return {"PYTHONPATH": f"{hook}:{PYTHONPATH}", "WANDB_API_KEY": "a" * 40, "WANDB_DIR": str(work)}


def ended_without_finalizing(work: Path, proc: subprocess.CompletedProcess[str]) -> None:
    """The sender was given up on, and the process ended with os._exit (its output flushed), not by
    finalizing the interpreter beside that thread, still inside mlflow or wandb: that teardown
    aborted the job (SIGABRT, exit -6) in about 1 run in 16 after it had done its work."""
    assert "not sent within --tracker-timeout" in proc.stderr, proc.stderr[-3000:]
    assert (work / "loaded").exists() and not (work / "finalized").exists()


@pytest.mark.parametrize("kind", ["mlflow", "wandb"])
@pytest.mark.parametrize("server", ["refused", "never answers"])
def test_a_tracking_server_that_is_down_or_never_answers_warns_and_the_job_ends(work, kind, server):
    env = exit_hook(work)  # W&B online: a key of the right form
    with (
        black_hole() if server == "never answers" else contextlib.nullcontext(f"http://127.0.0.1:{free_port()}") as url
    ):
        started = time.monotonic()
        args = ["--max-steps", "12", "--tracker", kind, "--tracker-uri", url, "--tracker-timeout", "2"]
        proc = ddpjob(["train", "--device", "cpu", *args], work, timeout=240, **env)
    took = time.monotonic() - started
    out = ok(proc)
    assert "[ddpjob] done: step 12" in out
    assert "warning: tracker:" in proc.stderr, proc.stderr[-3000:]
    ended_without_finalizing(work, proc)
    print(f"\n{kind} server {server}: job ended in {took:.1f}s")
    assert took < 90  # about 10 s here; MLflow alone retries a request for minutes


def test_a_model_error_with_a_tracker_that_never_answers_exits_1_with_its_traceback(work):
    env = exit_hook(work)
    with black_hole() as url:
        args = ["--model", "tests.plugins.failing:model(at=6)", "--max-steps", "12", "--log-every", "2"]
        args += ["--tracker", "wandb", "--tracker-uri", url, "--tracker-timeout", "2"]
        proc = ddpjob(["train", "--device", "cpu", *args], work, timeout=240, **env)
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "ValueError: the model failed" in proc.stderr, proc.stderr[-3000:]
    ended_without_finalizing(work, proc)


def test_tracking_server_dying_mid_run_only_warns(work):
    run_dir = work / "runs/ddpjob"
    (work / "samples").mkdir()
    (work / "server").mkdir()
    with serve_mlflow(work / "server") as url:
        args = [*JOB, "--max-steps", "80", "--tracker", "mlflow", "--tracker-uri", url, "--tracker-timeout", "3"]
        job = spawn(["train", "--device", "cpu", *args], work, TEST_SAMPLES_DIR=str(work / "samples"))

        def sent_some() -> bool:
            state = json.loads((run_dir / "tracker.json").read_text()) if (run_dir / "tracker.json").exists() else {}
            return state.get("logged", {}).get("train", 0) >= 8

        wait_until(sent_some, 240, "the tracker to send steps")
    # the server is gone (killed) while training goes on
    out = job.communicate(timeout=300)[0]
    assert job.returncode == 0, out[-3000:]
    assert "[ddpjob] done:" in out and "warning: tracker:" in out, out[-3000:]
    (final,) = [r for r in records(run_dir) if r["event"] == "final"]
    assert json.loads((run_dir / "tracker.json").read_text())["logged"]["train"] < final["step"]  # died mid-run


def test_a_full_queue_drops_records_and_never_blocks_the_caller(tmp_path):
    tracker = Tracker("mlflow", True, str(tmp_path))  # not started: nothing takes records off the queue
    began = time.perf_counter()
    for step in range(QUEUE_SIZE + 50):
        tracker.log("train", step, {"train/loss": 1.0})
    spent = time.perf_counter() - began
    assert tracker.dropped == 50
    assert spent < 5.0, f"{QUEUE_SIZE + 50} log() calls took {spent:.2f}s"  # put_nowait only: microseconds each


@pytest.mark.parametrize("command", ["train", "launch"])
def test_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, command):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # as if not installed\n")
    env = clean_env()
    env["PYTHONPATH"] = f"{hidden}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [PY, "-m", "ddpjob", command, "--tracker", "wandb", "--epochs", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--tracker wandb needs the optional package wandb" in lines[0]
    assert "pip install 'ddpjob[trackers]'" in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("tracker_json", ["kept", "lost"])
def test_steps_trained_again_after_a_lost_checkpoint_are_not_sent_twice(work, tracker_json):
    """As after a hard kill: the run holds steps up to 24, the newest checkpoint left is step 12.
    Without tracker.json (node-local RUN_DIR, deleted) the run itself says which steps it holds."""

    args = ["train", "--device", "cpu", "--log-every", "4", "--save-every", "12", "--tracker", "mlflow"]
    args += ["--tracker-every", "0"]
    ok(ddpjob([*args, "--max-steps", "24"], work))
    for path in (work / "runs/ddpjob/checkpoints").glob("step-24*"):
        path.unlink()
    if tracker_json == "lost":
        (work / "runs/ddpjob/tracker.json").unlink()
    ok(ddpjob([*args, "--max-steps", "32"], work))
    starts = [r["step"] for r in records(work / "runs/ddpjob") if r["event"] == "start"]
    assert starts == [0, 12]  # resumed at 12: steps 13-24 trained again
    client, (run,) = default_store_runs(work / "runs/ddpjob")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [4, 8, 12, 16, 20, 24, 28, 32]


def test_a_dcp_checkpoint_of_two_ranks_names_the_run_without_tracker_json(work):
    """DCP keeps the extras of one rank of its choosing: every rank must carry rank 0's run id."""

    args = ["--log-every", "4", "--save-every", "4", "--checkpoint-format", "dcp", "--tracker", "mlflow"]
    args += ["--model", "ddpjob.plugins:digits_mlp(hidden=64)"]  # with this model's sizes DCP keeps rank 1's
    ok(launched([*args, "--max-steps", "8"], work))
    (work / "runs/ddpjob/tracker.json").unlink()
    ok(launched([*args, "--max-steps", "16"], work))
    assert [r["step"] for r in records(work / "runs/ddpjob") if r["event"] == "start"] == [0, 8]
    client, (run,) = default_store_runs(work / "runs/ddpjob")  # one run, not two
    assert client.get_metric_history(run.info.run_id, "train/loss")[-1].step == 16


def test_a_local_store_is_imported_and_its_run_started_before_the_first_step(tmp_path):
    """Importing mlflow and building its SQLite store hold the GIL for seconds: done in start(), not
    in the thread while rank 0 trains; bench/loop.py measured that cost at 70% of the first steps."""
    tracker = Tracker("mlflow", True, str(tmp_path), params={"lr": 0.1})
    tracker.start()
    try:
        assert tracker.run_id, "start() returned before the run was started"
        assert json.loads((tmp_path / "tracker.json").read_text())["run_id"] == tracker.run_id
    finally:
        tracker.close(0)


def test_resume_never_starts_a_new_tracker_run(work):

    args = ["train", "--device", "cpu", "--max-steps", "8", "--log-every", "4", "--tracker", "mlflow"]
    args += ["--tracker-every", "0"]
    ok(ddpjob(args, work))
    ok(ddpjob([*args, "--resume", "never", "--checkpoint-dir", "runs/ddpjob/afresh"], work))  # same RUN_DIR
    client, runs = default_store_runs(work / "runs/ddpjob")
    assert len(runs) == 2
    for run in runs:  # each run holds its own steps: the second one's were not skipped as sent
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [4, 8]


@pytest.mark.parametrize(
    "uri, local",
    [
        *[("sqlite:////tmp/m.db", True), ("file:///tmp/mlruns", True), ("./mlruns", True), ("mlruns", True)],
        *[("databricks", False), ("databricks://profile", False), ("databricks-uc", False), ("uc", False)],
        *[("http://h:5000", False), ("postgresql://u:p@h/db", False)],
    ],
)
def test_only_a_store_on_this_machine_counts_as_local(uri, local):
    """A local store's run is started before the first step (no network); databricks has no scheme
    but is a server."""
    assert is_local_store(uri) == local


@pytest.mark.parametrize("content", ['{"kind": "mlflow", "run_id": 3, "logged": {"train": "x"}}', "{not json", "[]"])
def test_an_unreadable_tracker_json_on_resume_warns_and_a_new_run_starts(tmp_path, capsys, content):
    (tmp_path / "tracker.json").write_text(content)
    tracker = Tracker("mlflow", True, str(tmp_path))
    tracker.load_state_dict({"kind": "mlflow", "run_id": "gone"})  # as a resumed checkpoint names its run
    tracker.start()
    tracker.close(0)
    assert tracker.run_id and not tracker.dead
    assert "tracker.json is unreadable" in capsys.readouterr().err


@pytest.mark.parametrize("every, sent", [(30.0, [50]), (0.0, list(range(1, 51)))])
def test_records_faster_than_tracker_every_are_thinned_to_the_newest_per_kind(tmp_path, every, sent):
    import mlflow

    tracker = Tracker("mlflow", True, str(tmp_path), every=every)
    tracker.start()
    for step in range(1, 51):  # far faster than one a second: one batch at close
        tracker.log("train", step, {"train/loss": float(step)})
    tracker.log("eval", 50, {"eval/val_loss": 0.5})
    tracker.close(0)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert [m.step for m in client.get_metric_history(tracker.run_id, "train/loss")] == sent
    assert [m.value for m in client.get_metric_history(tracker.run_id, "train/loss")][-1] == 50.0
    assert [m.step for m in client.get_metric_history(tracker.run_id, "eval/val_loss")] == [50]


def test_a_fresh_start_in_a_run_dir_with_tracker_json_starts_a_new_tracker_run(work):
    """The tracker run follows the checkpoint lineage: a start that resumes no checkpoint (here an
    empty --checkpoint-dir in a RUN_DIR whose tracker.json names the earlier run) is a new run,
    which holds all its own steps; only a resume continues a run."""

    args = ["train", "--device", "cpu", "--max-steps", "8", "--log-every", "4", "--tracker", "mlflow"]
    args += ["--tracker-every", "0"]
    ok(ddpjob(args, work))
    first = json.loads((work / "runs/ddpjob/tracker.json").read_text())["run_id"]
    ok(ddpjob([*args, "--checkpoint-dir", "runs/ddpjob/afresh"], work))
    client, runs = default_store_runs(work / "runs/ddpjob")
    assert len(runs) == 2
    for run in runs:
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [4, 8]
    assert json.loads((work / "runs/ddpjob/tracker.json").read_text())["run_id"] != first


SECRET = "S3cretPw0rd"


@pytest.mark.parametrize("where", ["user info", "query token"])
def test_a_secret_in_the_tracker_uri_is_never_shown_or_stored(work, mlflow_server, where):
    """The run connects with the real URI (user info: the server takes it and holds the run; a token
    in the query: the server refuses the path, a warning quotes the URI). Every output, every file
    of the run dir, the checkpoint's stored config and the tracker's params hold it redacted."""
    import mlflow

    host = mlflow_server.removeprefix("http://")
    uri = f"http://alice:{SECRET}@{host}" if where == "user info" else f"{mlflow_server}/x?access_token={SECRET}"
    args = ["launch", "--nproc-per-node", "1", "--max-steps", "8", "--log-every", "4", "--save-every", "4"]
    args += ["--tracker", "mlflow", "--tracker-uri", uri, "--tracker-project", f"secret-{where[0]}"]
    args += ["--tracker-timeout", "10", "--tracker-every", "0"]
    proc = ddpjob(args, work, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert SECRET not in proc.stdout + proc.stderr
    assert "***" in proc.stdout  # the config line, redacted
    run_dir = work / "runs/ddpjob"
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    stored = torch_load(run_dir / "checkpoints/step-8.pt")["config"]
    assert SECRET not in json.dumps(stored) and "***" in stored["tracker_uri"]
    if where == "user info":
        client = mlflow.MlflowClient(tracking_uri=mlflow_server)
        (run,) = client.search_runs([client.get_experiment_by_name("secret-u").experiment_id])
        assert SECRET not in json.dumps(run.data.params) and run.data.params["tracker_uri"].startswith("http://***@")
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [4, 8]
    else:
        assert "***" in proc.stderr  # the warning that the run cannot start, quoting the URI redacted


def torch_load(path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=True)


def test_wandb_offline_stores_no_secret_of_the_command_line(work):
    """W&B saves the program's arguments and its settings in the run's files: a password in
    --tracker-uri (or any argument) must reach them redacted."""
    wandb_dir = work / "wandb-home"
    wandb_dir.mkdir()
    args = ["train", "--device", "cpu", "--max-steps", "4", "--log-every", "2", "--tracker", "wandb"]
    args += ["--tracker-uri", f"http://alice:{SECRET}@127.0.0.1:9", "--tracker-timeout", "20"]
    proc = ddpjob(args, work, timeout=300, WANDB_MODE="offline", WANDB_DIR=str(wandb_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (attempt,) = (wandb_dir / "wandb").glob("offline-run-*")
    files = [p for p in [*attempt.rglob("*"), *work.rglob("*")] if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in proc.stdout + proc.stderr


def test_resuming_a_checkpoint_without_a_tracker_run_twice_continues_one_run(work):
    """A checkpoint saved with --tracker none names no run. Resumed with --tracker mlflow and stopped
    before its next save (its newer checkpoint lost), twice: tracker.json's run is of the same
    checkpoint lineage, so the second attempt continues it: one run, no step twice."""
    args = ["train", "--device", "cpu", "--log-every", "2", "--save-every", "4", "--tracker-every", "0"]
    ok(ddpjob([*args, "--max-steps", "4", "--tracker", "none"], work))
    for _ in range(2):
        ok(ddpjob([*args, "--max-steps", "8", "--tracker", "mlflow"], work))
        for path in (work / "runs/ddpjob/checkpoints").glob("step-8*"):
            path.unlink()
    assert [r["step"] for r in records(work / "runs/ddpjob") if r["event"] == "start"] == [0, 4, 4]
    client, runs = default_store_runs(work / "runs/ddpjob")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")] == [6, 8]


def test_a_sender_still_running_from_before_a_command_does_not_end_that_command_early(capsys):
    """Only a sender that this command started makes it end with os._exit (which here would end
    pytest itself): one left by earlier work in the same process does not."""
    from ddpjob import cli
    from ddpjob.train import trackers

    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    stuck.start()
    trackers.SENDERS.append(stuck)
    try:
        assert cli.main(["config", "--lr", "0.5"]) == 0
    finally:
        release.set()
        stuck.join()
        trackers.SENDERS.remove(stuck)
    assert "DDPJOB_LR=0.5" in capsys.readouterr().out
