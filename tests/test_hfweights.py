"""Weights as Hugging Face ships them: one .safetensors file (module.-prefixed too) and sharded sets,
read memory-mapped by --init-from (every rank, or rank 0 and broadcast), written by ckpt convert."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddpjob import checkpoint, ckpt_tools, hfweights, train
from helpers import assert_bitwise_equal, ddpjob, final_params, ok, torchrun

SHORT = ["--epochs", "1", "--log-every", "1000"]
# One step with a learning rate too small to move any weight: the run saves the weights it started from.
UNMOVED = [*SHORT, "--max-steps", "1", "--lr", "1e-30"]


def trained(work: Path) -> dict[str, torch.Tensor]:
    ok(ddpjob(["train", *SHORT, "--max-steps", "5", "--run-dir", "src"], work))
    return checkpoint.read(work / "src/checkpoints/step-5.pt")["model"]


def mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, file) of this process's memory mappings of .safetensors files."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, Path(fields[5]).name))
    return found


@pytest.mark.slow
def test_sharded_set_initialises_two_ranks_with_the_source_weights_by_mmap_and_by_rank0(work):
    source = trained(work)
    convert = ["ckpt", "convert", "src/checkpoints/step-5.pt", "hf", "--to", "safetensors", "--max-shard-size", "40KB"]
    assert "6 tensors in 3 shards and model.safetensors.index.json" in ok(ddpjob(convert, work))
    index = json.loads((work / "hf/model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(index["weight_map"]) == sorted(source)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in source.values())
    for mode, path in (("mmap", "hf"), ("rank0", "hf/model.safetensors.index.json")):
        out = ok(torchrun([*UNMOVED, "--init-from", path, "--load-mode", mode, "--run-dir", mode], work))
        assert "DDP start-up broadcast skipped" in out
        assert_bitwise_equal(final_params(work / mode), source)


@pytest.mark.slow
def test_single_safetensors_file_with_module_prefixes_initialises_the_model(work):
    source = trained(work)
    convert = ["ckpt", "convert", "src/checkpoints/step-5.pt", "w.safetensors", "--to", "safetensors"]
    ok(ddpjob([*convert, "--add-prefix", "module."], work))
    with safe_open(str(work / "w.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(f"module.{k}" for k in source)
    ok(ddpjob(["train", *UNMOVED, "--init-from", "w.safetensors", "--run-dir", "dst"], work))
    assert_bitwise_equal(final_params(work / "dst"), source)


def test_sharded_weights_load_as_views_of_the_shard_files_not_copies(tmp_path):
    """A rank holds one copy: the model built on the meta device takes the tensors of the shards'
    memory maps as its parameters (assign), nothing is copied on the way."""
    source = train.build("ddpjob.plugins:digits_mlp", 0, None, "")
    hfweights.write(source.state_dict(), tmp_path / "hf", "40KB")
    model = train.build("ddpjob.plugins:digits_mlp", 1, hfweights.read(tmp_path / "hf"), "hf")
    maps = mapped_files()
    for name, param in model.state_dict().items():
        files = [f for start, end, f in maps if start <= param.data_ptr() < end]
        assert files and files[0].startswith("model-0000"), f"{name} is not in a shard's mapping"
        assert torch.equal(param, source.state_dict()[name])
    assert len({f for _, _, f in maps if f.startswith("model-0000")}) == 3


@pytest.mark.parametrize("max_shard_size", ["", "1B"])
def test_tied_weights_are_stored_once_and_tied_again_on_load(tmp_path, max_shard_size):
    """safetensors refuses tensors that share memory: the copy under the second name is dropped
    (as Hugging Face does), and loading gives it back from the weight the model ties it to."""
    tied = train.build("tests.plugins.tied:model", 0, None, "")
    torch.save(tied.state_dict(), tmp_path / "tied.pt")
    dst = tmp_path / ("hf" if max_shard_size else "tied.safetensors")  # a folder: one shard, model.safetensors
    out = ckpt_tools.convert(tmp_path / "tied.pt", dst, "safetensors", "", max_shard_size)
    assert "1 tensors" in out and "1 tied tensor(s) stored once" in out
    state = hfweights.read(dst)
    assert list(state) == ["encode.weight"]
    model = train.build("tests.plugins.tied:model", 1, state, "st")
    assert model.decode.weight is model.encode.weight
    assert torch.equal(model.encode.weight, tied.encode.weight)


def test_shards_hold_at_most_the_size_asked_and_a_larger_tensor_alone():
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(30), "d": torch.zeros(5)}  # 40, 40, 120, 20 B
    assert [list(s) for s in hfweights.shard(state, 100)] == [["a", "b"], ["c"], ["d"]]
    assert [hfweights.parse_size(s) for s in ("2GB", "500MB", "1GiB", "4096", "1.5KB")] == [
        2 * 10**9,
        500 * 10**6,
        2**30,
        4096,
        1500,
    ]
