"""Weights as Hugging Face ships them: one .safetensors file (module.-prefixed too) and sharded sets,
read memory-mapped by --init-from (every rank, or rank 0 and broadcast), written by ckpt convert."""

import shutil
from pathlib import Path

import pytest
import torch

from ddpjob.checkpoint import choice
from ddpjob.checkpoint.formats import hf_safetensors, single_file
from ddpjob.errors import Retriable, UsageError
from ddpjob.tools import ckpt
from ddpjob.train import setup
from helpers import assert_bitwise_equal


def mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, file) of this process's memory mappings of .safetensors files."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, Path(fields[5]).name))
    return found


def test_sharded_weights_load_as_views_of_the_shard_files_not_copies(tmp_path):
    """A rank holds one copy: the model built on the meta device takes the tensors of the shards'
    memory maps as its parameters (assign), nothing is copied on the way."""
    source = setup.build("ddpjob.plugins:digits_mlp", 0, None, "")
    hf_safetensors.write(source.state_dict(), tmp_path / "hf", "40KB")
    model = setup.build("ddpjob.plugins:digits_mlp", 1, hf_safetensors.read(tmp_path / "hf"), "hf")
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
    tied = setup.build("tests.plugins.tied:model", 0, None, "")
    torch.save(tied.state_dict(), tmp_path / "tied.pt")
    dst = tmp_path / ("hf" if max_shard_size else "tied.safetensors")  # a folder: one shard, model.safetensors
    out = ckpt.convert(tmp_path / "tied.pt", dst, "safetensors", "", max_shard_size)
    assert "1 tensors" in out and "1 tied tensor(s) stored once" in out
    state = hf_safetensors.read(dst)
    assert list(state) == ["encode.weight"]
    model = setup.build("tests.plugins.tied:model", 1, state, "st")
    assert model.decode.weight is model.encode.weight
    assert torch.equal(model.encode.weight, tied.encode.weight)


def test_shards_hold_at_most_the_size_asked_and_a_larger_tensor_alone():
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(30), "d": torch.zeros(5)}  # 40, 40, 120, 20 B
    assert [list(s) for s in hf_safetensors.shard(state, 100)] == [["a", "b"], ["c"], ["d"]]
    assert [hf_safetensors.parse_size(s) for s in ("2GB", "500MB", "1GiB", "4096", "1.5KB")] == [
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

    theirs = setup.build("tests.plugins.hf_gpt2:model", 0, None, "")
    theirs.save_pretrained(tmp_path / "theirs", max_shard_size="8KB")
    assert len(list((tmp_path / "theirs").glob("model-*-of-*.safetensors"))) >= 3
    ours = setup.build("tests.plugins.hf_gpt2:model", 1, hf_safetensors.read(tmp_path / "theirs"), "theirs")
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert_bitwise_equal(ours.state_dict(), theirs.state_dict())

    torch.save(theirs.state_dict(), tmp_path / "gpt2.pt")
    ckpt.convert(tmp_path / "gpt2.pt", tmp_path / "ours", "safetensors", "", "8KB")
    config().save_pretrained(tmp_path / "ours")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours")
    assert_bitwise_equal(loaded.state_dict(), theirs.state_dict())


def test_dcp_folder_converts_to_a_sharded_set_with_the_same_weights(tmp_path):
    weights = setup.build("ddpjob.plugins:digits_mlp", 0, None, "").state_dict()
    torch.save(weights, tmp_path / "w.pt")
    ckpt.convert(tmp_path / "w.pt", tmp_path / "dcp", "dcp", "")
    out = ckpt.convert(tmp_path / "dcp", tmp_path / "hf", "safetensors", "", "40KB")
    assert "in 3 shards" in out
    assert_bitwise_equal(hf_safetensors.read(tmp_path / "hf"), weights)


def test_identity_of_a_set_reads_headers_and_ends_of_shards_not_all_of_them(tmp_path):
    """Every rank computes it (rank 0 to choose, the others to compare): on a set of hundreds of GB
    it must not hash the data. It changes with a file's size, header (names, dtypes, shapes) or the
    ends of its data; a byte in the middle of a tensor is not read."""
    big = torch.arange(256 << 10, dtype=torch.float32)  # 1 MiB of data, far more than the two samples
    hf_safetensors.write({"big": big, "small": torch.zeros(4)}, tmp_path / "hf", "2MB")
    shard = tmp_path / "hf" / hf_safetensors.SINGLE
    before = hf_safetensors.identity(tmp_path / "hf")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    assert hf_safetensors.identity(tmp_path / "hf") == before
    data[-1] ^= 0xFF  # the last bytes of the data (tensor "small")
    shard.write_bytes(data)
    assert hf_safetensors.identity(tmp_path / "hf") != before
    hf_safetensors.write({"big": big.view(torch.int32), "small": torch.zeros(4)}, tmp_path / "other.safetensors")
    hf_safetensors.write({"big": big, "small": torch.zeros(4)}, tmp_path / "same.safetensors")
    assert hf_safetensors.identity(tmp_path / "other.safetensors") != hf_safetensors.identity(
        tmp_path / "same.safetensors"
    )


def test_a_shard_still_being_copied_is_waited_for_and_other_files_are_refused(tmp_path):
    """A rank whose copy of a shard has another size than rank 0's is still receiving it (retriable,
    after --fs-timeout); one of the same size and other content sees other weights (exit 2). Both
    messages are about the --init-from path, not --checkpoint-dir."""
    hf_safetensors.write(setup.build("ddpjob.plugins:digits_mlp", 0, None, "").state_dict(), tmp_path / "hf", "40KB")
    chosen = choice.Choice(tmp_path / "hf", False, "run", hf_safetensors.identity(tmp_path / "hf"))
    shard = tmp_path / "hf/model-00003-of-00003.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(Retriable) as waited:
        choice.wait_visible(tmp_path / "hf", chosen, 1.0, 1)
    assert "--init-from weights" in str(waited.value) and "still being copied" in str(waited.value)
    assert f"{tmp_path / 'hf'} is not on storage all nodes share" in str(waited.value)
    shard.write_bytes(whole[:-1] + bytes([whole[-1] ^ 0xFF]))
    with pytest.raises(UsageError, match="give every node the same files at that path"):
        choice.wait_visible(tmp_path / "hf", chosen, 1.0, 1)
    shard.write_bytes(whole)
    choice.wait_visible(tmp_path / "hf", chosen, 1.0, 1)


def test_storage_errors_reading_weights_are_retriable_not_bad_input(tmp_path):
    """An OSError (EIO, ESTALE, a file gone) is the storage's, and may clear: not exit 2."""
    with pytest.raises(Retriable, match=r"cannot read .*gone.safetensors: .*a restart retries"):
        hf_safetensors.read(tmp_path / "gone.safetensors")


def test_a_stray_manifest_beside_safetensors_weights_is_not_theirs(tmp_path):
    """ddpjob never seals safetensors: a .sum beside one (another file's) neither checks nor refuses it."""
    weights = setup.build("ddpjob.plugins:digits_mlp", 0, None, "").state_dict()
    hf_safetensors.write(weights, tmp_path / "w.safetensors")
    single_file.save({"model": weights}, tmp_path / "w.pt")
    shutil.copyfile(tmp_path / "w.pt.sum", tmp_path / "w.safetensors.sum")
    assert choice.given(str(tmp_path / "w.safetensors"), "--init-from") == tmp_path / "w.safetensors"
    assert "integrity:  no manifest" in ckpt.inspect(tmp_path / "w.safetensors")
