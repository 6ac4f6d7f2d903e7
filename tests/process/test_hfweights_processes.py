"""Weights as Hugging Face ships them: one .safetensors file (module.-prefixed too) and sharded sets,
read memory-mapped by --init-from (every rank, or rank 0 and broadcast), written by ckpt convert.

(The tests of test_hfweights.py that start processes.)
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddpjob.checkpoint.formats import hf_safetensors, single_file
from ddpjob.train import setup
from helpers import assert_bitwise_equal, ddpjob, final_params, launched, ok, spawn, wait_until
from ports import free_port

SHORT = ["--epochs", "1", "--log-every", "1000"]


# One step with a learning rate too small to move any weight: the run saves the weights it started from.
UNMOVED = [*SHORT, "--max-steps", "1", "--lr", "1e-30"]


def trained(work: Path) -> dict[str, torch.Tensor]:
    ok(ddpjob(["train", *SHORT, "--max-steps", "5", "--run-dir", "src"], work))
    return single_file.read(work / "src/checkpoints/step-5.pt")["model"]


@pytest.mark.slow
def test_sharded_set_initialises_two_ranks_with_the_source_weights_by_mmap_and_by_rank0(work):
    source = trained(work)
    convert = ["ckpt", "convert", "src/checkpoints/step-5.pt", "hf", "--to", "safetensors", "--max-shard-size", "40KB"]
    assert "6 tensors in 3 shards and model.safetensors.index.json" in ok(ddpjob(convert, work))
    index = json.loads((work / "hf/model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(index["weight_map"]) == sorted(source)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in source.values())
    inspected = ok(ddpjob(["ckpt", "inspect", "hf"], work))
    assert "format:     sharded safetensors (3 shards, model.safetensors.index.json)" in inspected
    assert "weights:    6 tensors, 26,122 values" in inspected
    for mode, path in (("mmap", "hf"), ("rank0", "hf/model.safetensors.index.json")):
        out = ok(launched([*UNMOVED, "--init-from", path, "--load-mode", mode, "--run-dir", mode], work))
        assert "DDP start-up broadcast skipped" in out
        assert_bitwise_equal(final_params(work / mode), source)


@pytest.mark.slow
def test_a_rank_whose_storage_lacks_a_shard_waits_for_it_instead_of_failing(work):
    """Ranks in folders of their own stand in for nodes with their own view of storage: rank 1's
    copy of the set gets its last shard only after it has started waiting (a lagging NFS client)."""
    source = trained(work)
    ok(
        ddpjob(
            ["ckpt", "convert", "src/checkpoints/step-5.pt", "hf", "--to", "safetensors", "--max-shard-size", "40KB"],
            work,
        )
    )
    for rank in (0, 1):
        shutil.copytree(work / "hf", work / f"node{rank}/hf")
    late = work / "node1/hf/model-00003-of-00003.safetensors"
    late.unlink()
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = ["train", *UNMOVED, "--init-from", "hf", "--fs-timeout", "60"]
    logs = [work / f"node{rank}/log" for rank in (0, 1)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(spawn(args, log.parent, stdout=out, **env, RANK=str(rank)))
    wait_until(lambda: "waiting up to 60 s to see hf (incomplete" in logs[1].read_text(), 120, "rank 1 to wait")
    shutil.copyfile(work / "hf" / late.name, late)
    assert [p.wait(timeout=180) for p in procs] == [0, 0], logs[1].read_text()[-2000:]
    assert "every rank holds the weights of hf" in logs[0].read_text()
    assert_bitwise_equal(final_params(work / "node0/runs/ddpjob"), source)


@pytest.mark.slow
def test_single_safetensors_file_with_module_prefixes_initialises_the_model(work):
    source = trained(work)
    convert = ["ckpt", "convert", "src/checkpoints/step-5.pt", "w.safetensors", "--to", "safetensors"]
    ok(ddpjob([*convert, "--add-prefix", "module."], work))
    with safe_open(str(work / "w.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(f"module.{k}" for k in source)
    ok(ddpjob(["train", *UNMOVED, "--init-from", "w.safetensors", "--run-dir", "dst"], work))
    assert_bitwise_equal(final_params(work / "dst"), source)


def test_bf16_safetensors_initialise_an_fp32_model_in_fp32(work):
    """On the meta path the model takes the file's tensors as they are: bf16 ones would make a bf16
    model that the fp32 optimizer and loss then meet. They are cast, rank 0 says so, and it trains."""
    source = setup.build("ddpjob.plugins:digits_mlp", 0, None, "").state_dict()
    halved = {k: v.to(torch.bfloat16) for k, v in source.items()}
    hf_safetensors.write(halved, work / "bf16.safetensors")
    model = setup.build("ddpjob.plugins:digits_mlp", 1, hf_safetensors.read(work / "bf16.safetensors"), "bf16")
    for name, param in model.state_dict().items():
        assert param.dtype == torch.float32, name
        assert torch.equal(param, halved[name].float())
    out = ok(ddpjob(["train", *UNMOVED, "--init-from", "bf16.safetensors", "--run-dir", "dst"], work))
    assert "bf16.safetensors: 6 of 6 tensors cast to the model's dtype (bfloat16 -> float32)" in out
    assert_bitwise_equal(final_params(work / "dst"), {k: v.float() for k, v in halved.items()})
