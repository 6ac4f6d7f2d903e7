"""Checkpoint files: atomic save, integrity, weights_only load, prefixes both ways, mismatch errors."""

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpjob import config
from ddpjob.checkpoint import catalogue, checksum, manager, weights
from ddpjob.checkpoint.formats import single_file
from ddpjob.distenv import DistEnv
from ddpjob.errors import Retriable, StorageError, UsageError
from ddpjob.train.setup import build


def tutorial_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))


def test_saved_checkpoint_round_trips_with_weights_only(tmp_path):
    state = {
        "model": tutorial_model().state_dict(),
        "step": 3,
        "rng": [{"python": (3, tuple(range(5)), None)}],
        "torch_version": str(torch.__version__),
    }
    path = single_file.path_for(tmp_path, 3)
    single_file.save(state, path)
    assert single_file.verify(path) is None
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["0.weight"], state["model"]["0.weight"])
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_truncated_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, capsys):
    for step in (10, 20):
        single_file.save({"model": tutorial_model().state_dict(), "step": step}, single_file.path_for(tmp_path, step))
    newest = single_file.path_for(tmp_path, 20)
    newest.write_bytes(newest.read_bytes()[:-100])
    assert catalogue.latest_valid(tmp_path) == single_file.path_for(tmp_path, 10)
    warning = capsys.readouterr().err
    assert f"skipping checkpoint {newest}" in warning and "truncated" in warning


def test_checkpoint_without_manifest_is_never_resumed_from(tmp_path):
    single_file.save({"step": 1}, single_file.path_for(tmp_path, 1))
    torch.save({"step": 2}, single_file.path_for(tmp_path, 2))  # a save that died before its manifest
    assert catalogue.latest_valid(tmp_path) == single_file.path_for(tmp_path, 1)


def test_flipped_byte_fails_the_checksum(tmp_path):
    path = single_file.path_for(tmp_path, 1)
    single_file.save({"model": tutorial_model().state_dict()}, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "checksum" in single_file.verify(path)
    with pytest.raises(UsageError, match="integrity"):
        single_file.read(path)


def test_prune_keeps_the_newest_of_its_own_run_and_never_touches_another_runs(tmp_path):
    for step, run in ((1, "old"), (2, "old"), (3, "mine"), (4, "mine"), (5, "mine"), (9, "old")):
        single_file.save({"step": step}, single_file.path_for(tmp_path, step), run=run)
    catalogue.prune(tmp_path, keep=2, run="mine", saved=5)
    assert [s for s, _ in catalogue.list_steps(tmp_path)] == [9, 5, 4, 2, 1]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-4")) == ["step-4.pt", "step-4.pt.sum"]
    assert not single_file.manifest_path(single_file.path_for(tmp_path, 3)).exists()


def test_a_save_that_fails_midway_leaves_no_temporary_and_no_checkpoint(tmp_path):
    state = {"model": tutorial_model().state_dict(), "bad": lambda: 0}  # fails once the temporary is open
    target = single_file.path_for(tmp_path, 1)
    with pytest.raises(Exception, match="pickle"):
        single_file.save(state, target)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_dir_raises_storage_error_and_leaves_no_temp(tmp_path):
    if os.geteuid() == 0:
        target = single_file.path_for(tmp_path / "missing-dir", 1)  # root ignores modes: use a missing dir
    else:
        tmp_path.chmod(0o500)
        target = single_file.path_for(tmp_path, 1)
    with pytest.raises(StorageError, match="cannot write checkpoint"):
        single_file.save({"step": 1}, target)
    assert not target.parent.exists() or list(target.parent.iterdir()) == []


def test_temporaries_are_created_exclusively_and_never_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = single_file.path_for(tmp_path, 1)
    from ddpjob.checkpoint import atomic_fs

    atomic_fs.temp_name(target).symlink_to(victim)  # a link planted at the predictable temporary name
    single_file.save({"step": 1}, target)
    assert victim.read_text() == "keep me" and single_file.verify(target) is None
    assert not atomic_fs.temp_name(target).exists()


def test_leftovers_of_killed_saves_are_removed_and_checkpoints_kept(tmp_path):
    single_file.save({"step": 1}, single_file.path_for(tmp_path, 1))
    (tmp_path / ".step-2.pt.tmp-otherhost-123").write_bytes(b"x" * 100)
    (tmp_path / ".step-2.pt.sum.tmp-otherhost-123").write_text("{}")
    (tmp_path / ".step-3.tmp").mkdir()
    (tmp_path / ".step-3.tmp" / "__0_0.distcp").write_bytes(b"x")
    removed = catalogue.remove_temporaries(tmp_path)
    assert len(removed) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1.pt", "step-1.pt.sum"]


def test_loaded_checkpoints_keep_every_tensor_in_host_memory_so_rng_states_restore(tmp_path):
    from ddpjob.train import rng

    model = tutorial_model().state_dict()
    rng.seed_all(5)
    path = single_file.path_for(tmp_path, 1)
    single_file.save({"rng": [rng.get_state()], "model": model}, path)
    expected = torch.rand(3)
    loaded = single_file.read(path)
    assert all(t.device.type == "cpu" for t in tensors_in(loaded))
    rng.set_state(loaded["rng"][0])
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("wrap", ["plain", "dp", "ddp-style", "lightning", "ours"])
def test_weights_load_from_any_wrapper_into_a_plain_model(tmp_path, wrap):
    src = tutorial_model()
    state = {
        "plain": src.state_dict(),
        "dp": nn.DataParallel(src).state_dict(),
        "ddp-style": weights.add_prefix(src.state_dict()),
        "lightning": {"state_dict": src.state_dict()},
        "ours": {"model": src.state_dict(), "step": 1},
    }[wrap]
    path = tmp_path / "w.pt"
    torch.save(state, path)
    loaded = weights.model_state(single_file.read(path), str(path))
    dst = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    weights.load_weights(dst, loaded, str(path))
    for key, value in src.state_dict().items():
        assert torch.equal(dst.state_dict()[key], value)


def test_prefix_added_for_a_wrapped_model_and_stripped_back():
    sd = tutorial_model().state_dict()
    wrapped = weights.add_prefix(sd)
    assert list(wrapped) == ["module." + k for k in sd]
    nn.DataParallel(tutorial_model()).load_state_dict(wrapped)  # loads into a wrapped model as-is
    assert list(weights.strip_prefix({"module._orig_mod.0.weight": 1})) == ["0.weight"]


def test_meta_built_model_takes_checkpoint_tensors_without_a_copy(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(tutorial_model().state_dict(), path)
    loaded = weights.model_state(single_file.read(path, mmap=True), str(path))
    model = build("examples.tutorial:model", 0, loaded, str(path))
    assert model[0].weight.data_ptr() == loaded["0.weight"].data_ptr()
    assert all(p.requires_grad for p in model.parameters())


def test_shape_and_key_mismatch_lists_every_problem():
    sd = tutorial_model().state_dict()
    sd["2.weight"] = torch.zeros(7, 10)
    sd["extra.bias"] = torch.zeros(1)
    del sd["0.bias"]
    with pytest.raises(UsageError) as err:
        weights.load_weights(tutorial_model(), sd, "ck.pt")
    lines = str(err.value).splitlines()
    assert "3 problems" in lines[0]
    assert any("missing key 0.bias" in ln for ln in lines)
    assert any("unexpected key extra.bias" in ln for ln in lines)
    assert any("2.weight: checkpoint (7, 10) vs model (5, 10)" in ln for ln in lines)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    "content, words",
    [
        (b"not a checkpoint at all", ["not a readable PyTorch checkpoint"]),
        (pickle.dumps({"x": Evil()}, protocol=2), ["refused by torch.load(weights_only=True)"]),
    ],
)
def test_bad_files_give_one_clear_error(tmp_path, content, words):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(UsageError) as err:
        single_file.read(path)
    for word in words:
        assert word in str(err.value)


def test_pickled_code_in_a_zip_checkpoint_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, path)
    with pytest.raises(UsageError, match="weights_only"):
        single_file.read(path)


def test_a_file_holding_no_state_dict_is_rejected(tmp_path):
    with pytest.raises(UsageError, match="no model state dict"):
        weights.model_state({"step": 3}, "x.pt")


def tensors_in(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else []
    return [t for v in values for t in tensors_in(v)]


def test_an_existing_dcp_folder_is_replaced_whole_and_nothing_is_left_aside(tmp_path):
    from ddpjob.checkpoint import atomic_fs

    final, tmp = tmp_path / "step-1", tmp_path / ".step-1.tmp"
    for folder, content in ((final, b"old"), (tmp, b"new")):
        folder.mkdir()
        (folder / "data").write_bytes(content)
    atomic_fs.replace_folder(tmp, final)
    assert (final / "data").read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["step-1"]


def test_each_rank_is_bound_to_its_local_gpu_before_anything_touches_cuda(monkeypatch):
    """On 8 GPUs per node, local rank 5 must make cuda:5 current, or NCCL's object collectives and
    pinned memory land on cuda:0. (Stand-ins for torch.cuda: no GPU here; the GPU check runs it.)"""
    from ddpjob.config import Config
    from ddpjob.distenv import DistEnv
    from ddpjob.train import process

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    env = DistEnv(13, 5, 16, 8, 1, "node-a", 29500, "torchrun")
    device = process.pick_device(Config(device="cuda"), env)
    assert device == torch.device("cuda", 5) and current == [device]


def test_a_folder_set_aside_by_a_swap_that_died_midway_is_restored_not_removed(tmp_path):
    from ddpjob.checkpoint import atomic_fs

    aside = atomic_fs.temp_name(tmp_path / "step-5", "old")
    aside.mkdir()
    (aside / "data").write_bytes(b"the checkpoint")
    catalogue.remove_temporaries(tmp_path)
    assert (tmp_path / "step-5" / "data").read_bytes() == b"the checkpoint" and not aside.exists()


def test_tied_weights_stay_tied_when_built_from_a_checkpoint(tmp_path):
    model = build("tests.plugins.tied:model", 0, None, "")
    state = weights.model_state(model.state_dict(), "x")
    rebuilt = build("tests.plugins.tied:model", 0, state, "x")
    assert rebuilt.encode.weight is rebuilt.decode.weight
    assert len(list(rebuilt.parameters())) == len(list(model.parameters()))
    assert rebuilt.encode.weight.data_ptr() == state["encode.weight"].data_ptr()  # the loaded tensor: one copy


def test_ranks_sharing_the_verification_find_a_flipped_byte_in_the_block_of_whoever_checks_it(tmp_path, monkeypatch):
    from ddpjob.checkpoint import checksum

    monkeypatch.setattr(checksum, "BLOCK", 4096)
    path = single_file.path_for(tmp_path, 1)
    single_file.save({"w": torch.arange(10_000, dtype=torch.float32)}, path)  # about 10 blocks
    blocks = single_file.manifest(path)["blocks"]
    assert len(blocks) > 4
    data = bytearray(path.read_bytes())
    data[3 * 4096 + 5] ^= 0x01  # block 3
    path.write_bytes(bytes(data))
    verdicts = [single_file.verify(path, (part, 2)) for part in (0, 1)]
    assert verdicts[0] is None and "block 3 of" in verdicts[1]
    assert single_file.verify(path, None) is None  # sizes alone cannot see it
    assert "checksum mismatch" in single_file.verify(path)


def test_a_skipped_corrupt_later_checkpoint_of_the_run_neither_counts_for_keep_nor_is_pruned(tmp_path):
    for step in (10, 30):
        single_file.save({"step": step}, single_file.path_for(tmp_path, step), run="mine")
    single_file.save({"step": 20}, single_file.path_for(tmp_path, 20), run="mine")  # saved after resuming from 10
    catalogue.prune(tmp_path, keep=1, run="mine", saved=20)
    assert [s for s, _ in catalogue.list_steps(tmp_path)] == [30, 20]


def test_block_checksums_are_checked_where_files_cannot_be_memory_mapped(tmp_path, monkeypatch):
    import mmap as mmap_module

    from ddpjob.checkpoint import checksum

    path = single_file.path_for(tmp_path, 1)
    single_file.save({"w": torch.arange(1000.0)}, path)

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap_module, "mmap", refuse)
    monkeypatch.setattr(checksum.mmap, "mmap", refuse)
    assert single_file.verify(path) is None
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    assert "checksum mismatch" in single_file.verify(path)


def test_a_manifest_with_too_few_block_checksums_is_unreadable_not_trusted(tmp_path):
    import json

    path = single_file.path_for(tmp_path, 1)
    single_file.save({"w": torch.arange(1000.0)}, path)
    manifest = single_file.manifest(path)
    manifest["blocks"] = []
    single_file.manifest_path(path).write_text(json.dumps(manifest))
    assert "unreadable manifest" in single_file.verify(path)


def _saved(tmp_path) -> Path:
    path = single_file.path_for(tmp_path / "ckpts", 4)
    path.parent.mkdir()
    single_file.save({"model": tutorial_model().state_dict(), "step": 4}, path, run="lineage1")
    return path


def _failing(error: int, path):
    def fail(*args, **kwargs):
        raise OSError(error, os.strerror(error), str(path))

    return fail


@pytest.mark.parametrize("error", [errno.EIO, errno.ESTALE])
def test_a_storage_error_reading_a_checkpoint_file_is_retriable(tmp_path, monkeypatch, error):
    path = _saved(tmp_path)
    monkeypatch.setattr(torch, "load", _failing(error, path))
    with pytest.raises(Retriable, match="a restart retries"):
        single_file.read(path)


@pytest.mark.parametrize("error", [errno.EACCES, errno.EPERM])
@pytest.mark.parametrize("where", ["checksum", "load"])
def test_permission_denied_on_a_checkpoint_under_resume_auto_is_bad_input_naming_the_file(
    tmp_path, monkeypatch, error, where
):
    """Not transient: a retry would fail the same way, forever (exit 2, not a retried exit 1)."""
    path = _saved(tmp_path)
    if where == "checksum":
        monkeypatch.setattr(checksum, "block_digests", _failing(error, path))
    else:
        monkeypatch.setattr(torch, "load", _failing(error, path))
    cfg = config.Config(checkpoint_dir=str(tmp_path / "ckpts"), resume="auto")
    env = DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
    with pytest.raises(UsageError) as caught:
        manager.Checkpointer(cfg, env).begin()
    assert str(path) in str(caught.value) and "permission" in str(caught.value).lower()
    assert "read access" in str(caught.value) and "\n" not in str(caught.value)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_dcp_folder_whose_extra_would_run_code_is_one_line_and_runs_none(tmp_path, monkeypatch):
    """The extra item (progress, config, ...) is a pickle inside DCP's bytes: read with weights_only
    like the rest, and a class it would import is refused in one line (UsageError), not a traceback."""
    import io

    import torch.distributed.checkpoint as dcp

    from ddpjob.checkpoint.formats import dcp_folder

    monkeypatch.chdir(tmp_path)
    payload = io.BytesIO()
    torch.save({"progress": _RunsCode()}, payload)
    payload.seek(0)
    dcp.save({"model": {"w": torch.ones(3)}, "extra": payload}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    with pytest.raises(UsageError, match=r"^refused by torch.load\(weights_only=True\)"):
        dcp_folder.read_extra(tmp_path / "step-1")
    assert not (tmp_path / "pwned").exists()
