"""ddpjob.checkpoint.checksum: known vectors, streaming equals one-shot, files through a memory map, the
legacy CRC-32 of older manifests, and reading both manifest forms."""

import json
import zlib

import pytest

from ddpjob.checkpoint import checksum
from ddpjob.checkpoint.checksum import ALGORITHM, LEGACY, Checksum, ManifestError, Stream

# XXH3_64bits with seed 0: the empty input's value from xxHash's own sanity tests, and the
# standard check input; zlib's CRC-32 of b"123456789" is the catalogue check value 0xCBF43926.
VECTORS = {
    ALGORITHM: [(b"", "2d06800538d394c2"), (b"123456789", "72dcb18b67a17dff")],
    LEGACY: [(b"", 0), (b"123456789", 0xCBF43926)],
}


def blob(n: int) -> bytes:
    return bytes((i * 7919 + (i >> 8)) & 0xFF for i in range(n))


def test_new_manifests_use_xxh3_64():
    assert ALGORITHM == "xxh3_64"
    assert set(checksum.ALGORITHMS) == {ALGORITHM, LEGACY}


@pytest.mark.parametrize("algorithm", [ALGORITHM, LEGACY])
def test_known_vectors(algorithm):
    for data, expected in VECTORS[algorithm]:
        assert checksum.digest(data, algorithm) == expected


@pytest.mark.parametrize("algorithm", [ALGORITHM, LEGACY])
def test_streaming_equals_one_shot_whatever_the_split(algorithm):
    data = blob(100_003)
    whole = checksum.digest(data, algorithm)
    for split in (1, 7, 4096, 65_536, 100_003):
        stream = Stream(algorithm)
        for start in range(0, len(data), split):
            stream.update(memoryview(data)[start : start + split])
        assert stream.value == whole, split
        assert stream.size == len(data)
        assert stream.checksum == Checksum(algorithm, whole)


def test_update_takes_bytes_bytearray_and_memoryview():
    data = blob(1000)
    values = set()
    for form in (bytes, bytearray, memoryview):
        stream = Stream()
        stream.update(form(data))
        values.add(stream.value)
    assert values == {checksum.digest(data)}


def test_legacy_crc32_equals_zlib(tmp_path):
    data = blob(300_001)
    assert checksum.digest(data, LEGACY) == zlib.crc32(data)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert checksum.file_digest(path, LEGACY) == zlib.crc32(data)


@pytest.mark.parametrize("algorithm", [ALGORITHM, LEGACY])
def test_file_digest_equals_digest_of_the_bytes_across_chunks(tmp_path, monkeypatch, algorithm):
    monkeypatch.setattr(checksum, "CHUNK", 4096)  # many chunks and a partial last one
    data = blob(4096 * 5 + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert checksum.file_digest(path, algorithm) == checksum.digest(data, algorithm)


def test_file_digest_default_is_the_new_algorithm(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"123456789")
    assert checksum.file_digest(path) == "72dcb18b67a17dff"
    assert checksum.file_digest(str(path)) == "72dcb18b67a17dff"


@pytest.mark.parametrize("algorithm", [ALGORITHM, LEGACY])
def test_a_flipped_byte_changes_the_digest(tmp_path, algorithm):
    data = bytearray(blob(1 << 20))
    path = tmp_path / "f"
    path.write_bytes(data)
    before = checksum.file_digest(path, algorithm)
    for offset in (0, 12_345, len(data) - 1):
        flipped = bytearray(data)
        flipped[offset] ^= 0x01
        path.write_bytes(flipped)
        assert checksum.file_digest(path, algorithm) != before, offset


@pytest.mark.parametrize("algorithm", [ALGORITHM, LEGACY])
def test_empty_file(tmp_path, algorithm):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert checksum.file_digest(path, algorithm) == checksum.digest(b"", algorithm) == VECTORS[algorithm][0][1]


def test_unmappable_files_are_read_instead(tmp_path, monkeypatch):
    data = blob(50_000)
    path = tmp_path / "f"
    path.write_bytes(data)

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what mmap says on filesystems that cannot map

    monkeypatch.setattr(checksum.mmap, "mmap", refuse)
    monkeypatch.setattr(checksum, "CHUNK", 4096)
    assert checksum.file_digest(path) == checksum.digest(data)
    assert checksum.file_digest(path, LEGACY) == zlib.crc32(data)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        checksum.file_digest(tmp_path / "absent")


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        Stream("md5")
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        checksum.manifest_fields("0" * 16, "sha1")


def test_from_manifest_reads_the_new_form_written_by_manifest_fields(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(blob(10_000))
    manifest = {"format": "ddpjob-checkpoint/1", "size": 10_000, **checksum.manifest_fields(checksum.file_digest(path))}
    manifest = json.loads(json.dumps(manifest))  # as read back from disk
    assert manifest["algorithm"] == ALGORITHM
    expected = checksum.from_manifest(manifest)
    assert expected == Checksum(ALGORITHM, checksum.file_digest(path))
    assert checksum.matches(path, expected)
    path.write_bytes(blob(9_999) + b"\x00")
    assert not checksum.matches(path, expected)


def test_manifest_helpers_take_either_form(tmp_path):
    data = blob(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    stream = Stream()
    stream.update(data)
    new = {"size": len(data), **stream.fields()}
    assert stream.fields() == checksum.of_file(path) == {"algorithm": ALGORITHM, "digest": checksum.digest(data)}
    old = {"size": len(data), "crc32": zlib.crc32(data)}
    assert checksum.of_file(path, LEGACY) == {"algorithm": LEGACY, "digest": zlib.crc32(data)}
    for manifest in (new, old, checksum.of_file(path, LEGACY)):
        assert checksum.matches(path, manifest), manifest
    assert checksum.value(new) == checksum.digest(data) and checksum.value(old) == zlib.crc32(data)
    path.write_bytes(data[:-1] + b"\x00")
    assert not checksum.matches(path, new) and not checksum.matches(path, old)


def test_manifests_without_a_readable_checksum_never_match(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    for manifest in ({"size": 3}, {"algorithm": "md5", "digest": "0" * 16}, {"crc32": "x"}):
        assert not checksum.matches(path, manifest)
        assert checksum.value(manifest) is None


def test_from_manifest_reads_old_crc32_manifests(tmp_path):
    data = blob(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    old = json.loads(json.dumps({"format": "ddpjob-checkpoint/1", "size": len(data), "crc32": zlib.crc32(data)}))
    expected = checksum.from_manifest(old)
    assert expected == Checksum(LEGACY, zlib.crc32(data))
    assert checksum.matches(path, expected)


def test_from_manifest_upper_case_hex_is_the_same_digest():
    value = checksum.digest(b"x")
    assert checksum.from_manifest({"algorithm": ALGORITHM, "digest": value.upper()}) == Checksum(ALGORITHM, value)


def test_from_manifest_without_a_checksum_is_none():
    assert checksum.from_manifest({"size": 3}) is None  # e.g. a DCP marker written before checksums


@pytest.mark.parametrize(
    "manifest",
    [
        {"algorithm": "md5", "digest": "0" * 16},
        {"algorithm": ALGORITHM},
        {"digest": "0" * 16},
        {"algorithm": ALGORITHM, "digest": "0" * 15},
        {"algorithm": ALGORITHM, "digest": "0x" + "0" * 14},
        {"algorithm": ALGORITHM, "digest": "g" * 16},
        {"algorithm": ALGORITHM, "digest": 12345},
        {"crc32": "123"},
        {"crc32": -1},
        {"crc32": 2**32},
        {"crc32": True},
        [1, 2],
    ],
)
def test_from_manifest_refuses_malformed_checksums(manifest):
    with pytest.raises(ManifestError):
        checksum.from_manifest(manifest)
    assert issubclass(ManifestError, ValueError)  # callers that catch ValueError keep working


def test_block_checksums_of_a_stream_written_in_odd_pieces_equal_those_read_back(tmp_path):
    data = bytes(range(256)) * 41  # 10496 bytes: 5 blocks of 2 KiB and a partial one
    blocks = checksum.Blocks(block=2048)
    for start in range(0, len(data), 777):
        blocks.update(data[start : start + 777])
    fields = blocks.fields()
    path = tmp_path / "f"
    path.write_bytes(data)
    assert fields["block_size"] == 2048 and len(fields["blocks"]) == 6
    assert checksum.block_digests(path, range(6), 2048) == dict(enumerate(fields["blocks"]))
