"""Checkpoint files: atomic save, integrity, weights_only load, prefixes both ways, mismatch errors.

(The tests of test_checkpoint.py that start processes.)
"""

from pathlib import Path

import pytest
import torch
from torch import nn

from ddpjob.checkpoint import catalogue, weights
from helpers import ddpjob, ok, spawn, wait_until


def tutorial_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))


def tensors_in(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else []
    return [t for v in values for t in tensors_in(v)]


def awkward_state() -> dict:
    """Everything a loaded checkpoint may hold: an OrderedDict state dict with _metadata, odd
    dtypes, 0-dim, empty and non-contiguous tensors, RNG bytes, nested lists and tuples."""
    model = tutorial_model().state_dict()
    torch.manual_seed(1)
    return {
        "model": model,
        "extra": [(torch.randn(3, 4).t(), "t"), torch.tensor(7), torch.empty(0, 5), torch.randn(4).bfloat16()],
        "mask": torch.rand(6) > 0.5,
        "rng": torch.get_rng_state(),
        "step": 11,
        "name": "run",
    }


def _broadcast_rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    got = weights.broadcast(awkward_state() if rank == 0 else None, None)
    torch.save(got, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_rank0_broadcast_gives_every_rank_the_same_state_tensor_by_tensor(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_broadcast_rank, args=(f"file://{tmp_path}/store", str(tmp_path)), nprocs=2)
    want, got = awkward_state(), torch.load(tmp_path / "1.pt", weights_only=True)
    assert got.keys() == want.keys() and got["step"] == 11 and got["name"] == "run"
    assert got["model"]._metadata == want["model"]._metadata  # BatchNorm & co. check their versions
    pairs = list(zip(tensors_in(want), tensors_in(got), strict=True))
    assert len(pairs) == 10
    for a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert got["extra"][0][1] == "t" and isinstance(got["extra"][0], tuple)


def test_the_checkpoint_a_process_resumed_from_is_not_pruned_while_it_maps_it(work):
    """A resume memory-maps step-N.pt and the model takes those tensors as they are: pages never
    written stay backed by the file. Pruning it under the live process (--keep 1) would leave the
    mapping on a deleted file (on NFS another node's unlink makes it stale: SIGBUS)."""
    args = ["train", "--device", "cpu", "--log-every", "1000", "--save-every", "4", "--keep", "1"]
    ok(ddpjob([*args, "--max-steps", "4"], work))
    (work / "samples").mkdir()
    slow = ["--data", "tests.plugins.recording:digits(delay=0.004)", "--max-steps", "400"]
    worker = spawn([*args, *slow], work, TEST_SAMPLES_DIR=str(work / "samples"))
    try:
        folder = work / "runs/ddpjob/checkpoints"

        def pruned() -> bool:  # a save writes its checksum, then prunes: reading between them was a CI flake
            return (folder / "step-12.pt.sum").exists() and not (folder / "step-8.pt").exists()

        wait_until(lambda: pruned() or worker.poll() is not None, 240, "three saves and the prune of step 8")
        maps = Path(f"/proc/{worker.pid}/maps").read_text()
        assert worker.poll() is None, worker.communicate()[0][-3000:]
    finally:
        worker.kill()
        worker.communicate()
    mapped = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "step-" in line}
    assert mapped == {str(folder / "step-4.pt")}, mapped  # still mapped, and not deleted under it
    assert (folder / "step-4.pt").exists() and not (folder / "step-8.pt").exists()  # others still pruned


@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_a_run_dir_holding_another_jobs_checkpoints_is_named_with_the_fix(work, fmt):
    """Two jobs in the same (default) run dir: the second one finds the first one's checkpoints.
    The error says so and names --run-dir, not "wrong --model?"."""
    args = ["train", "--device", "cpu", "--max-steps", "2", "--save-every", "2", "--log-every", "1000"]
    args += ["--checkpoint-format", fmt]
    ok(ddpjob(args, work))
    proc = ddpjob([*args, "--model", "ddpjob.plugins:digits_mlp(hidden=32)"], work)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert "another job" in line and "--run-dir" in line and "digits_mlp(hidden=32)" in line, line


def test_a_periodic_save_close_to_the_save_timeout_is_kept(work):
    """A save of 0.925 x --save-timeout: the other ranks accept it, and it stays on disk (it was once
    removed for passing 0.9 x the timeout, and with --on-save-error warn silently)."""
    run_dir = work / "runs/ddpjob"
    proc = ddpjob(
        [
            "launch",
            "--nproc-per-node",
            "2",
            "--model",
            "tests.plugins.slow_save:model(seconds=18.5,width=256)",
            "--data",
            "ddpjob.plugins:synthetic(samples=2048)",
            "--max-steps",
            "10",
            "--save-every",
            "5",
            "--save-timeout",
            "20",
            "--on-save-error",
            "warn",
        ],
        work,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [s for s, p in catalogue.list_steps(run_dir / "checkpoints") if catalogue.verify(p) is None]
    assert 5 in steps and "NOT saved" not in proc.stderr, (steps, proc.stderr[-3000:])
