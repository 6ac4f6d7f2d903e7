"""Sharded (DCP) checkpoints loadable at other world sizes, conversions, and async saves equal to sync ones."""

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ddpjob.checkpoint import catalogue
from ddpjob.checkpoint.formats import dcp_folder, single_file
from helpers import PYTHONPATH, assert_bitwise_equal, ddpjob, final_params, launched, ok, records

pytestmark = pytest.mark.slow
DCP = ["--log-every", "1000", "--epochs", "3", "--save-every", "0", "--checkpoint-format", "dcp"]


def params_line(out: str) -> str:
    return re.search(r"done: step \d+ .* params (\w+)", out).group(1)


def test_dcp_saved_at_world_size_2_loads_at_1_and_4_with_the_same_parameters(work):
    saved = params_line(ok(launched([*DCP, "--max-steps", "20"], work)))
    folder = work / "runs/ddpjob/checkpoints/step-20"
    assert folder.is_dir() and dcp_folder.verify(folder) is None
    for world in (1, 4):  # --max-steps 20 again: load and stop, no training step
        assert params_line(ok(launched([*DCP, "--max-steps", "20"], work, nproc=world))) == saved


def test_dcp_resume_is_bitwise_equal_to_an_uninterrupted_run(work):
    ok(launched([*DCP, "--max-steps", "25", "--run-dir", "whole"], work))
    ok(launched([*DCP, "--max-steps", "9", "--run-dir", "split"], work))
    ok(launched([*DCP, "--max-steps", "25", "--run-dir", "split"], work))
    whole, split = (dcp_folder.read_model(work / d / "checkpoints/step-25") for d in ("whole", "split"))
    assert_bitwise_equal(whole, split)


def test_dcp_folder_of_another_model_is_one_line_and_launch_exits_2(work):
    """Each rank that gets to say it says the same one line (the agent stops the others once one has
    exited 2); launch exits 2 even where a rank, still exiting after its line, was stopped first by the
    clock (torchrun's own summary then names that rank's SIGTERM)."""
    ok(launched([*DCP, "--max-steps", "5"], work))
    other = ["--model", "ddpjob.plugins:digits_mlp(hidden=64)"]
    proc = ddpjob(["launch", "--nproc-per-node", "2", *DCP, "--max-steps", "10", *other], work, timeout=180)
    assert proc.returncode == 2 and "(bad input: not restarted)" in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[node ")]
    errors = [ln for ln in lines if "ddpjob: error" in ln]
    assert 1 <= len(errors) <= 2 and all("holds another job's checkpoints" in ln for ln in errors), errors
    assert not any("Traceback" in ln for ln in lines)


# Loaded through PYTHONPATH: the first read of a .distcp file fails with EIO, as a flaky NFS mount
# or object store would; a flag file makes it once across processes.
EIO_ONCE = """
import errno, os
from pathlib import Path

import torch.distributed.checkpoint.filesystem as fs

create_stream = fs.FileSystem.create_stream


def failing_once(self, path, mode):
    flag = Path(os.environ["TEST_EIO_FLAG"])
    if "r" in mode and str(path).endswith(".distcp") and not flag.exists():
        flag.touch()
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
    return create_stream(self, path, mode)


fs.FileSystem.create_stream = failing_once
"""


def test_a_transient_storage_error_during_a_dcp_resume_is_retriable_and_the_retry_resumes(work, tmp_path_factory):
    """EIO (as ESTALE, ETIMEDOUT) while reading a sound checkpoint is no bad input: one line, a
    failure exit that is not 2 (a scheduler retries it), and the retry resumes."""
    args = ["train", "--device", "cpu", *DCP, "--save-every", "3"]
    ok(ddpjob([*args, "--max-steps", "6"], work))
    site, flag = tmp_path_factory.mktemp("site"), work / "eio-injected"
    (site / "sitecustomize.py").write_text(EIO_ONCE)
    env = {"PYTHONPATH": f"{site}:{PYTHONPATH}", "TEST_EIO_FLAG": str(flag)}
    proc = ddpjob([*args, "--max-steps", "9"], work, **env)
    assert flag.exists(), proc.stderr[-2000:]  # the error was injected
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "Input/output error" in errors[0] and "retr" in errors[0], errors
    ok(ddpjob([*args, "--max-steps", "9"], work, **env))
    assert [r["step"] for r in records(work / "runs/ddpjob") if r["event"] == "start"] == [0, 6]


def test_incomplete_dcp_folder_is_skipped(work):
    ok(launched([*DCP, "--max-steps", "10", "--save-every", "5"], work))
    newest = work / "runs/ddpjob/checkpoints/step-10"
    next(newest.glob("*.distcp")).write_bytes(b"")
    assert catalogue.latest_valid(newest.parent) == newest.with_name("step-5")


def test_file_and_dcp_convert_both_ways_without_change(work):
    ok(ddpjob(["train", "--epochs", "1", "--log-every", "1000"], work))
    src = catalogue.list_steps(work / "runs/ddpjob/checkpoints")[0][1]
    ok(ddpjob(["ckpt", "convert", str(src), "as_dcp", "--to", "dcp"], work))
    ok(ddpjob(["ckpt", "convert", "as_dcp", "back.pt", "--to", "ddpjob"], work))
    original = single_file.read(src)["model"]
    assert_bitwise_equal(original, dcp_folder.read_model(work / "as_dcp"))
    assert_bitwise_equal(original, single_file.read(work / "back.pt")["model"])


def test_async_and_sync_saves_write_identical_loadable_checkpoints(work):
    """Async saves write from a thread beside the heartbeat thread and DataLoader worker processes."""
    args = ["--epochs", "2", "--max-steps", "30", "--save-every", "10", "--log-every", "1000", "--keep", "5"]
    ok(launched([*args, "--save-mode", "sync", "--run-dir", "sync"], work))
    busy = ["--heartbeat", "0.2", "--num-workers", "2"]
    ok(launched([*args, *busy, "--save-mode", "async", "--run-dir", "async"], work))
    for step in (10, 20, 30):
        sync, async_ = (single_file.read(work / m / f"checkpoints/step-{step}.pt") for m in ("sync", "async"))
        assert_bitwise_equal(sync["model"], async_["model"])
        for key in ("exp_avg", "exp_avg_sq"):
            for i, state in sync["optimizer"]["state"].items():
                assert torch.equal(state[key], async_["optimizer"]["state"][i][key])
        assert sync["progress"] == async_["progress"] and sync["step"] == async_["step"] == step
        assert sync["epoch"] == async_["epoch"] == sync["progress"]["epoch"]  # top level, as the format says
    assert_bitwise_equal(final_params(work / "sync"), final_params(work / "async"))


def dcp_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder (model and optimizer), by its flattened key."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if hasattr(m, "size")}
    dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)
    return tensors


def test_async_dcp_saves_equal_sync_ones_and_resume_bitwise(work):
    args = [*DCP, "--max-steps", "30", "--save-every", "10", "--keep", "5"]
    for mode in ("sync", "async"):
        ok(launched([*args, "--save-mode", mode, "--run-dir", mode], work))
    for step in (10, 20, 30):
        sync, async_ = (work / m / f"checkpoints/step-{step}" for m in ("sync", "async"))
        assert dcp_folder.verify(async_) is None and not list((work / "async/checkpoints").glob(".*tmp"))
        tensors = dcp_tensors(sync)
        assert any(".exp_avg" in key for key in tensors) and len(tensors) > 8
        assert_bitwise_equal(tensors, dcp_tensors(async_))
    ok(launched([*DCP, "--max-steps", "15", "--save-every", "10", "--save-mode", "async", "--run-dir", "split"], work))
    ok(launched([*DCP, "--max-steps", "30", "--save-mode", "async", "--run-dir", "split"], work))
    assert_bitwise_equal(
        dcp_tensors(work / "sync/checkpoints/step-30"), dcp_tensors(work / "split/checkpoints/step-30")
    )
