"""Checkpoints in an S3 bucket (--checkpoint-dir s3://...), against a real server: SeaweedFS, started
by the ``s3`` fixture (tests/s3server.py), which enforces credentials and ``If-None-Match``.

The guarantees of a local checkpoint dir, each shown on the store: a resumed run equals an
uninterrupted one bitwise (both formats, sync and async saves); a DCP checkpoint resumes at another
world size; a checkpoint without its manifest is never chosen and the next start removes it; a
worker killed mid-save leaves the previous checkpoint chosen; pruning keeps other runs' objects; the
commit is a conditional put; a stop exits 75 only with its checkpoint stored; a wrong key, a missing
bucket or an endpoint that does not resolve are one line and exit 2 before the first step; the
secret is never printed.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from ddpjob.checkpoint import catalogue, stop_record, storage
from ddpjob.checkpoint.formats import dcp_folder, single_file
from helpers import (
    PYTHONPATH,
    assert_bitwise_equal,
    ddpjob,
    launched,
    ok,
    records,
    spawn,
    torchrun,
    trained_steps,
    wait_until,
)
from s3server import BUCKET, SECRET

pytestmark = pytest.mark.slow
JOB = ["--log-every", "1000", "--epochs", "3"]
FORMATS = {  # id -> flags
    "file-sync": ["--checkpoint-format", "file"],
    "file-async": ["--checkpoint-format", "file", "--save-mode", "async"],
    "dcp-async": ["--checkpoint-format", "dcp", "--save-mode", "async"],
}


def model_of(path: storage.Where) -> dict:
    """The model weights of a checkpoint, local or in the store."""
    if catalogue.format_of(path) is dcp_folder:
        return dcp_folder.read_model(path)
    return single_file.read(path)["model"]


def steps_in(url: str) -> list[int]:
    """The committed (manifest) steps under a prefix, oldest first."""
    return sorted(s for s, _ in catalogue.complete(storage.location(url)))


def starts(work) -> list[int]:
    """The step each start of the run began at."""
    return [r["step"] for r in records(work / "runs/ddpjob") if r["event"] == "start"]


def no_secret(*outputs: str) -> None:
    assert not any(SECRET in out for out in outputs), "the secret key was printed"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_resumed_from_s3_is_bitwise_equal_to_an_uninterrupted_local_one(work, s3, fmt):
    flags = [*JOB, *FORMATS[fmt], "--save-every", "4", "--keep", "2"]
    ok(launched([*flags, "--max-steps", "14", "--run-dir", "whole"], work))
    first = ok(launched([*flags, "--max-steps", "9", "--checkpoint-dir", s3, "--run-dir", "split"], work))
    second = ok(launched([*flags, "--max-steps", "14", "--checkpoint-dir", s3, "--run-dir", "split"], work))
    no_secret(first, second)
    assert steps_in(s3) == [12, 14]  # --keep 2 pruned the run's older steps in the bucket
    name = "step-14" + ("" if "dcp" in fmt else ".pt")
    assert_bitwise_equal(model_of(work / "whole/checkpoints" / name), model_of(storage.location(f"{s3}/{name}")))
    assert not (work / "s3:").exists() and not list((work / "split").glob("checkpoints/step-*"))


def test_a_dcp_checkpoint_in_s3_resumes_at_another_world_size(work, s3):
    flags = [*JOB, "--checkpoint-format", "dcp", "--checkpoint-dir", s3, "--save-every", "0"]
    saved = re.search(r"params (\w+)", ok(launched([*flags, "--max-steps", "10"], work))).group(1)
    for world in (1, 3):  # load and stop: the same parameters at each size
        out = ok(launched([*flags, "--max-steps", "10"], work, nproc=world))
        assert re.search(r"params (\w+)", out).group(1) == saved
    out = ok(launched([*flags, "--max-steps", "14"], work, nproc=3))  # and train on
    assert "done: step 14" in out and steps_in(s3) == [10, 14]


@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_a_checkpoint_without_its_manifest_is_never_chosen_and_the_next_start_removes_it(work, s3, fmt):
    flags = [*JOB, "--checkpoint-format", fmt, "--checkpoint-dir", s3, "--save-every", "5", "--device", "cpu"]
    ok(ddpjob(["train", *flags, "--max-steps", "10"], work))
    newest = storage.location(f"{s3}/step-10" + (".pt" if fmt == "file" else ""))
    manifest = newest / dcp_folder.MARKER if fmt == "dcp" else single_file.manifest_path(newest)
    storage.of(manifest).delete(manifest)  # as if the save died before its commit: its record of writing stays
    storage.of(newest).write(newest.with_name(newest.name + storage.WRITING), lambda f: f.write(b"ddpjob"))
    out = ok(ddpjob(["train", *flags, "--max-steps", "12"], work))
    assert "removed 1 leftover(s) of killed saves: step-10" in out and "skipping" not in out, out[-2000:]
    assert (
        starts(work) == [0, 5] and steps_in(s3) == [5, 10, 12] and catalogue.verify(newest) is None
    )  # step 10 was saved anew


# A worker killed in a save, after its data went up and before the manifest (the commit): rank 0
# stops in FsspecStorage.commit at the second save, leaves a flag, and the test kills it (kill -9).
HANG_BEFORE_COMMIT = """
import os, time
from pathlib import Path
if os.environ.get("RANK", "0") == "0":
    from ddpjob.checkpoint import storage

    commit = storage.FsspecStorage.commit

    def hanging(self, where, data):
        if "step-10" in str(where):
            Path(os.environ["TEST_FLAG"]).write_text(str(os.getpid()))
            time.sleep(600)
        return commit(self, where, data)

    storage.FsspecStorage.commit = hanging
"""


@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_a_worker_killed_mid_save_leaves_the_previous_checkpoint_chosen(work, s3, fmt, tmp_path_factory):
    site, flag = tmp_path_factory.mktemp("site"), work / "in-commit"
    (site / "sitecustomize.py").write_text(HANG_BEFORE_COMMIT)
    flags = [*JOB, "--checkpoint-format", fmt, "--checkpoint-dir", s3, "--save-every", "5", "--device", "cpu"]
    job = spawn(["train", *flags, "--max-steps", "20"], work, PYTHONPATH=f"{site}:{PYTHONPATH}", TEST_FLAG=str(flag))
    try:
        wait_until(flag.exists, 120, "the save of step 10 to reach its commit")
        os.kill(int(flag.read_text()), signal.SIGKILL)
        job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    assert steps_in(s3) == [5]  # step 10's data is there, uncommitted
    assert catalogue.latest_valid(storage.location(s3)).name.startswith("step-5")
    out = ok(ddpjob(["train", *flags, "--max-steps", "10"], work))
    assert "removed 1 leftover(s) of killed saves: step-10" in out, out[-2000:]
    assert starts(work) == [0, 5] and steps_in(s3) == [5, 10]


def test_pruning_removes_only_this_runs_old_steps(s3):
    """Two lineages in one prefix: --keep 1 for run A leaves run B's checkpoints alone."""
    where = storage.location(s3)
    for step, run in ((1, "B"), (2, "A"), (3, "A"), (4, "B"), (5, "A")):
        single_file.save({"step": step}, single_file.path_for(where, step), run)
    catalogue.prune(where, keep=1, run="A", saved=5)
    assert steps_in(s3) == [1, 4, 5]


def test_the_commit_is_a_conditional_put_that_a_second_writer_loses(s3):
    where = storage.location(s3)
    store = storage.of(where)
    store.commit(where / "ddpjob.sum", b"first")
    with pytest.raises(OSError, match="committed by another writer"):
        store.commit(where / "ddpjob.sum", b"second")
    assert (where / "ddpjob.sum").read_bytes() == b"first"


def test_a_stop_exits_75_only_with_its_checkpoint_in_the_store(work, s3):
    flags = ["--nproc-per-node", "2", *JOB, "--epochs", "50", "--log-every", "1", "--checkpoint-dir", s3]
    flags += ["--save-every", "0", "--data", "tests.plugins.recording:digits(delay=0.005)"]
    agent = spawn(["launch", *flags], work, TEST_SAMPLES_DIR=str(work))
    try:
        wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 5, 120, "training to start")
        agent.send_signal(signal.SIGTERM)
        out = agent.communicate(timeout=120)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 75, out[-3000:]
    stop = stop_record.read(work / "runs/ddpjob").step
    assert stop in steps_in(s3) and catalogue.verify(storage.location(f"{s3}/step-{stop}.pt")) is None
    no_secret(out)


BAD_STORES = {  # id -> (checkpoint dir, env, words of the one line)
    "wrong secret key": (f"s3://{BUCKET}/x", {"AWS_SECRET_ACCESS_KEY": "wrong"}, ["refused the credentials"]),
    "missing bucket": ("s3://no-such-bucket/x", {}, ["bucket no-such-bucket does not exist"]),
    "endpoint that does not resolve": (
        f"s3://{BUCKET}/x",
        {"AWS_ENDPOINT_URL": "http://no-such-host.invalid:8333"},
        ["no-such-host.invalid", "does not resolve"],
    ),
}


@pytest.mark.parametrize("case", BAD_STORES)
def test_a_bad_store_is_one_line_and_exit_2_before_the_first_step(work, s3, case):
    url, env, words = BAD_STORES[case]
    proc = torchrun([*JOB, "--checkpoint-dir", url, "--max-steps", "5"], work, **env)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[node ")]  # the workers' (torchrun's own follow)
    errors = [ln for ln in lines if "ddpjob: error" in ln]
    # Each rank checks the store and says the same line; the first to exit 2 has torchrun stop the other,
    # which may not have printed yet: one or two lines, never two different ones.
    # (torchrun's summary names the earliest error by the clock: a rank that said its line first and was
    # still exiting when the other's exit 2 stopped it reads -15 there, so the 2 is looked for in every row)
    assert re.search(r"exitcode\s*: 2\b", proc.stderr) and 1 <= len(errors) <= 2, proc.stderr[-3000:]
    assert len({ln.split("] ", 1)[1] for ln in errors}) == 1, errors
    assert all(w in errors[0].lower() for w in words) and not any("Traceback" in ln for ln in lines), errors
    assert trained_steps(work / "runs/ddpjob") == 0
    no_secret(proc.stdout, proc.stderr)


def test_ckpt_inspect_and_convert_take_urls(work, s3):
    ok(ddpjob(["train", *JOB, "--checkpoint-dir", s3, "--max-steps", "5", "--device", "cpu"], work))
    out = ok(ddpjob(["ckpt", "inspect", f"{s3}/step-5.pt"], work))
    assert "ok (matches its manifest)" in out and "step/epoch: 5" in out
    ok(ddpjob(["ckpt", "convert", f"{s3}/step-5.pt", f"{s3}/weights-dcp", "--to", "dcp"], work))
    ok(ddpjob(["ckpt", "convert", f"{s3}/weights-dcp", "local.pt"], work))
    assert_bitwise_equal(model_of(storage.location(f"{s3}/step-5.pt")), single_file.read(work / "local.pt"))
    init = ok(ddpjob(["train", *JOB, "--init-from", f"{s3}/weights-dcp", "--max-steps", "1", "--device", "cpu"], work))
    assert "init" in init.lower()


@pytest.fixture
def proxy(s3_server, monkeypatch):
    """The server behind a FaultProxy: AWS_ENDPOINT_URL names the proxy, in this process too (its
    store made anew for it, and the one before given back after: each process keeps one per protocol)."""
    from s3server import FaultProxy

    found = FaultProxy(s3_server.ports["s3.port"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", found.endpoint)
    monkeypatch.setattr(storage, "_STORES", {})
    yield found
    found.close()


def test_transient_store_failures_are_retried_and_the_run_completes(work, s3, proxy):
    """503 SlowDown, then connection resets, from the start-up probe on: retried with backoff, never exit 2."""
    proxy.slow_down(5)
    proxy.reset(5)
    flags = [*JOB, "--checkpoint-dir", s3, "--save-every", "4", "--max-steps", "8", "--device", "cpu"]
    out = ok(ddpjob(["train", *flags], work, AWS_ENDPOINT_URL=proxy.endpoint))
    assert proxy.failed == 10 and steps_in(s3) == [4, 8], out[-2000:]


@pytest.mark.parametrize("on_error, code", [("warn", 0), ("fail", 3)])
def test_a_store_down_past_the_save_timeout_is_a_save_error(work, s3, proxy, on_error, code):
    flags = [*JOB, "--log-every", "1", "--checkpoint-dir", s3, "--save-every", "8", "--max-steps", "10"]
    flags += ["--save-timeout", "4", "--on-save-error", on_error, "--device", "cpu"]
    flags += ["--data", "tests.plugins.recording:digits(delay=0.02)"]  # 0.6 s a step: 4 s from step 1 to the save
    env = {"AWS_ENDPOINT_URL": proxy.endpoint, "TEST_SAMPLES_DIR": str(work)}
    job = spawn(["train", *flags], work, **env)
    wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 1, 120, "training to start")
    proxy.down()  # after the start-up probe, before the first save, for good
    out = job.communicate(timeout=180)[0]
    assert job.returncode == code, out[-3000:]
    assert "cannot write checkpoint" in out and "Traceback" not in out, out[-3000:]
    proxy.up()  # for this process's look at the store
    assert steps_in(s3) == [] and proxy.failed > 0


def test_doctor_probes_a_checkpoint_dir_in_the_store(work, s3):
    good = ddpjob(["doctor", "--checkpoint-dir", s3, "--device", "cpu"], work)
    assert re.search(r"ok\s+checkpoints: .*probe object", good.stdout + good.stderr), good.stdout + good.stderr
    bad = ddpjob(["doctor", "--checkpoint-dir", s3, "--device", "cpu"], work, AWS_SECRET_ACCESS_KEY="wrong")
    out = bad.stdout + bad.stderr
    assert re.search(r"FAIL\s+checkpoints: .*refused the credentials", out) and bad.returncode != 0, out
    no_secret(out)


@pytest.mark.parametrize("flag", ["--init-from", "--resume"])
def test_a_store_down_when_a_named_checkpoint_is_looked_up_is_retriable_not_bad_input(work, s3, proxy, flag):
    """The store answers nothing while rank 0 looks up the checkpoint a flag names: retried for
    --save-timeout, then a failure a restart retries (exit 1), never exit 2 (no scheduler retries that)."""
    proxy.down()
    flags = [*JOB, flag, f"{s3}/step-1.pt", "--max-steps", "1", "--save-timeout", "3", "--device", "cpu"]
    proc = ddpjob(["train", *flags], work, AWS_ENDPOINT_URL=proxy.endpoint)
    errors = [ln for ln in proc.stderr.splitlines() if "ddpjob: error" in ln]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proxy.failed > 0


@pytest.mark.parametrize("flag", ["--init-from", "--resume"])
def test_a_named_checkpoint_at_an_endpoint_that_does_not_resolve_is_one_line_and_exit_2(work, s3, flag):
    """As for --checkpoint-dir: a typo in AWS_ENDPOINT_URL is bad input, said at once, not retried."""
    flags = [*JOB, flag, f"{s3}/step-1.pt", "--max-steps", "1", "--save-timeout", "3", "--device", "cpu"]
    proc = ddpjob(["train", *flags], work, AWS_ENDPOINT_URL="http://no-such-host.invalid:8333")
    errors = [ln for ln in proc.stderr.splitlines() if "ddpjob: error" in ln]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "no-such-host.invalid" in errors[0] and "does not resolve" in errors[0], errors
    assert "retrying" not in proc.stderr, proc.stderr[-3000:]


def test_the_next_start_aborts_the_incomplete_uploads_of_a_killed_writer_and_no_one_elses(s3):
    """A writer killed mid-upload leaves a multipart upload open (its parts are stored, and billed);
    the start's cleanup aborts those under its prefix, not those of a prefix that merely begins with
    the same letters (s3://b/run1 and s3://b/run10)."""
    where, sibling = storage.location(s3), storage.location(f"{s3}0")
    fs = storage.of(where).fs
    for prefix in (where, sibling):
        bucket, _, key = prefix.url.split("://", 1)[1].partition("/")
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{key}/step-5.pt")
        fs.call_s3(
            "upload_part", Bucket=bucket, Key=f"{key}/step-5.pt", UploadId=upload["UploadId"], PartNumber=1, Body=b"x"
        )

    def open_uploads(prefix: storage.ObjectPath) -> int:
        bucket, _, key = prefix.url.split("://", 1)[1].partition("/")
        return len(fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/").get("Uploads", []))

    assert open_uploads(where) == open_uploads(sibling) == 1
    assert catalogue.remove_temporaries(where) == ["1 incomplete upload(s)"]
    assert open_uploads(where) == 0 and open_uploads(sibling) == 1


def test_a_start_never_deletes_step_named_objects_that_no_save_of_ddpjob_left(work, s3):
    """The start cleans what killed saves left, and only that: a user's step-4.pt copied in without
    its manifest, or another tool's DCP folder step-3/ (torchtitan names its own so), stay, as they
    do in a local checkpoint dir (where only ddpjob's temporaries are removed)."""
    where = storage.location(s3)
    store = storage.of(where)
    mine = {where / "step-4.pt": b"a user's weights", where / "step-3" / ".metadata": b"meta"}
    mine[where / "step-3" / "__0_0.distcp"] = b"tensors"
    for key, data in mine.items():
        store.write(key, lambda f, data=data: f.write(data))
    flags = [*JOB, "--checkpoint-dir", s3, "--resume", "never", "--max-steps", "2", "--save-every", "0"]
    out = ok(ddpjob(["train", *flags, "--device", "cpu"], work))
    assert "leftover" not in out, out[-2000:]
    assert {key: key.read_bytes() for key in mine} == mine and steps_in(s3) == [2]
    assert not [p.name for p in store.list(where) if p.name.endswith(storage.WRITING)]  # the save's record went


def test_a_corrupt_newest_checkpoint_in_the_store_is_skipped_for_the_one_before(work, s3):
    """Integrity as on a filesystem: a flipped byte that keeps the object's size is seen by the
    manifest's block checksums, and the start resumes from the newest checkpoint that verifies."""
    flags = [*JOB, "--checkpoint-format", "file", "--checkpoint-dir", s3, "--save-every", "5", "--device", "cpu"]
    ok(ddpjob(["train", *flags, "--max-steps", "10"], work))
    newest = storage.location(f"{s3}/step-10.pt")
    data = bytearray(newest.read_bytes())
    data[len(data) // 3] ^= 0x01
    storage.of(newest).fs.pipe_file(newest.url.split("://", 1)[1], bytes(data))
    out = ok(ddpjob(["train", *flags, "--max-steps", "12"], work))
    assert f"skipping checkpoint {newest}: checksum mismatch in block" in out, out[-2000:]
    assert starts(work) == [0, 5]


@pytest.mark.serial  # it times a deadline: at normal priority, beside the parallel tier held back (make process)
@pytest.mark.parametrize("failing", ["resets every connection", "answers 503 SlowDown"])
def test_a_store_failing_every_request_ends_an_operation_near_the_save_timeout(monkeypatch, failing):
    """--save-timeout is how long a store operation is retried, then a save error. botocore's and s3fs's
    own retries under ddpjob's took 17 to 40 s for a deadline of 3 s; within 3 tries of botocore's now."""
    from s3server import FaultProxy

    store_down = FaultProxy(target_port=1)  # never reached: every request fails before it
    if failing == "resets every connection":
        store_down.down()
    else:
        store_down.slow_down(10**6)
    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setattr(storage, "RETRY_FOR", storage.RETRY_FOR)
    for name, value in (("AWS_ENDPOINT_URL", store_down.endpoint), ("AWS_ACCESS_KEY_ID", "k")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    storage.set_retry_for(3)
    manifest = storage.ObjectPath("s3://bucket/run/step-1.pt.sum")
    started = time.monotonic()
    with pytest.raises(Exception) as failed:
        manifest.store.commit(manifest, b"{}")
    took = time.monotonic() - started
    store_down.listener.close()
    assert storage.retriable(failed.value) and store_down.failed >= 3, failed.value
    assert 3 <= took < 3 + 7, took  # the last try starts by the deadline; botocore's waits are at most 1 + 2 s
