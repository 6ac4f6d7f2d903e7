"""Weights as Hugging Face ships them: one .safetensors file (module.-prefixed too) and sharded sets,
read memory-mapped by --init-from (every rank, or rank 0 and broadcast), written by ckpt convert."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddpjob import checkpoint, checkpointer, ckpt_tools, hfweights, train
from ddpjob.errors import Retriable, UsageError
from helpers import PY, assert_bitwise_equal, clean_env, ddpjob, final_params, free_port, ok, torchrun, wait_until

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
    inspected = ok(ddpjob(["ckpt", "inspect", "hf"], work))
    assert "format:     sharded safetensors (3 shards, model.safetensors.index.json)" in inspected
    assert "weights:    6 tensors, 26,122 values" in inspected
    for mode, path in (("mmap", "hf"), ("rank0", "hf/model.safetensors.index.json")):
        out = ok(torchrun([*UNMOVED, "--init-from", path, "--load-mode", mode, "--run-dir", mode], work))
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
    env = clean_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [PY, "-m", "ddpjob", "train", *UNMOVED, "--init-from", "hf", "--fs-timeout", "60"]
    logs = [work / f"node{rank}/log" for rank in (0, 1)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=log.parent, env={**env, "RANK": str(rank)}, stdout=out, stderr=out))
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


def test_transformers_reads_our_sharded_set_and_we_read_its_own(tmp_path):
    """Both ways with Hugging Face's own code: save_pretrained's shards (lm_head tied to the
    embedding, so not stored) initialise the model; ours load with from_pretrained."""
    transformers = pytest.importorskip("transformers")
    from tests.plugins.hf_gpt2 import config

    theirs = train.build("tests.plugins.hf_gpt2:model", 0, None, "")
    theirs.save_pretrained(tmp_path / "theirs", max_shard_size="8KB")
    assert len(list((tmp_path / "theirs").glob("model-*-of-*.safetensors"))) >= 3
    ours = train.build("tests.plugins.hf_gpt2:model", 1, hfweights.read(tmp_path / "theirs"), "theirs")
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert_bitwise_equal(ours.state_dict(), theirs.state_dict())

    torch.save(theirs.state_dict(), tmp_path / "gpt2.pt")
    ckpt_tools.convert(tmp_path / "gpt2.pt", tmp_path / "ours", "safetensors", "", "8KB")
    config().save_pretrained(tmp_path / "ours")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours")
    assert_bitwise_equal(loaded.state_dict(), theirs.state_dict())


def test_dcp_folder_converts_to_a_sharded_set_with_the_same_weights(tmp_path):
    weights = train.build("ddpjob.plugins:digits_mlp", 0, None, "").state_dict()
    torch.save(weights, tmp_path / "w.pt")
    ckpt_tools.convert(tmp_path / "w.pt", tmp_path / "dcp", "dcp", "")
    out = ckpt_tools.convert(tmp_path / "dcp", tmp_path / "hf", "safetensors", "", "40KB")
    assert "in 3 shards" in out
    assert_bitwise_equal(hfweights.read(tmp_path / "hf"), weights)


def test_bf16_safetensors_initialise_an_fp32_model_in_fp32(work):
    """On the meta path the model takes the file's tensors as they are: bf16 ones would make a bf16
    model that the fp32 optimizer and loss then meet. They are cast, rank 0 says so, and it trains."""
    source = train.build("ddpjob.plugins:digits_mlp", 0, None, "").state_dict()
    halved = {k: v.to(torch.bfloat16) for k, v in source.items()}
    hfweights.write(halved, work / "bf16.safetensors")
    model = train.build("ddpjob.plugins:digits_mlp", 1, hfweights.read(work / "bf16.safetensors"), "bf16")
    for name, param in model.state_dict().items():
        assert param.dtype == torch.float32, name
        assert torch.equal(param, halved[name].float())
    out = ok(ddpjob(["train", *UNMOVED, "--init-from", "bf16.safetensors", "--run-dir", "dst"], work))
    assert "bf16.safetensors: 6 of 6 tensors cast to the model's dtype (bfloat16 -> float32)" in out
    assert_bitwise_equal(final_params(work / "dst"), {k: v.float() for k, v in halved.items()})


def test_identity_of_a_set_reads_headers_and_ends_of_shards_not_all_of_them(tmp_path):
    """Every rank computes it (rank 0 to choose, the others to compare): on a set of hundreds of GB
    it must not hash the data. It changes with a file's size, header (names, dtypes, shapes) or the
    ends of its data; a byte in the middle of a tensor is not read."""
    big = torch.arange(256 << 10, dtype=torch.float32)  # 1 MiB of data, far more than the two samples
    hfweights.write({"big": big, "small": torch.zeros(4)}, tmp_path / "hf", "2MB")
    shard = tmp_path / "hf" / hfweights.SINGLE
    before = hfweights.identity(tmp_path / "hf")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    assert hfweights.identity(tmp_path / "hf") == before
    data[-1] ^= 0xFF  # the last bytes of the data (tensor "small")
    shard.write_bytes(data)
    assert hfweights.identity(tmp_path / "hf") != before
    hfweights.write({"big": big.view(torch.int32), "small": torch.zeros(4)}, tmp_path / "other.safetensors")
    hfweights.write({"big": big, "small": torch.zeros(4)}, tmp_path / "same.safetensors")
    assert hfweights.identity(tmp_path / "other.safetensors") != hfweights.identity(tmp_path / "same.safetensors")


def test_a_shard_still_being_copied_is_waited_for_and_other_files_are_refused(tmp_path):
    """A rank whose copy of a shard has another size than rank 0's is still receiving it (retriable,
    after --fs-timeout); one of the same size and other content sees other weights (exit 2). Both
    messages are about the --init-from path, not --checkpoint-dir."""
    hfweights.write(train.build("ddpjob.plugins:digits_mlp", 0, None, "").state_dict(), tmp_path / "hf", "40KB")
    choice = checkpointer.Choice(tmp_path / "hf", False, "run", hfweights.identity(tmp_path / "hf"))
    shard = tmp_path / "hf/model-00003-of-00003.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(Retriable) as waited:
        checkpointer.wait_visible(tmp_path / "hf", choice, 1.0, 1)
    assert "--init-from weights" in str(waited.value) and "still being copied" in str(waited.value)
    assert f"{tmp_path / 'hf'} is not on storage all nodes share" in str(waited.value)
    shard.write_bytes(whole[:-1] + bytes([whole[-1] ^ 0xFF]))
    with pytest.raises(UsageError, match="give every node the same files at that path"):
        checkpointer.wait_visible(tmp_path / "hf", choice, 1.0, 1)
    shard.write_bytes(whole)
    checkpointer.wait_visible(tmp_path / "hf", choice, 1.0, 1)


def test_storage_errors_reading_weights_are_retriable_not_bad_input(tmp_path):
    """An OSError (EIO, ESTALE, a file gone) is the storage's, and may clear: not exit 2."""
    with pytest.raises(Retriable, match=r"cannot read .*gone.safetensors: .*a restart retries"):
        hfweights.read(tmp_path / "gone.safetensors")


def test_a_stray_manifest_beside_safetensors_weights_is_not_theirs(tmp_path):
    """ddpjob never seals safetensors: a .sum beside one (another file's) neither checks nor refuses it."""
    weights = train.build("ddpjob.plugins:digits_mlp", 0, None, "").state_dict()
    hfweights.write(weights, tmp_path / "w.safetensors")
    checkpoint.save({"model": weights}, tmp_path / "w.pt")
    shutil.copyfile(tmp_path / "w.pt.sum", tmp_path / "w.safetensors.sum")
    assert checkpointer.given(str(tmp_path / "w.safetensors"), "--init-from") == tmp_path / "w.safetensors"
    assert "integrity:  no manifest" in ckpt_tools.inspect(tmp_path / "w.safetensors")
