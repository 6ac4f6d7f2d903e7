"""Checkpoint checksums: one algorithm for new manifests, and the old one still read.

New manifests record ``{"algorithm": "xxh3_64", "digest": "<16 hex digits>"}``: XXH3's 64-bit
hash (the ``xxhash`` package), which runs near memory bandwidth on one core (bench/checksum.py:
11.8 GB/s over a memory-mapped 1 GiB file, 0.87x of a plain memory read, against 4.1 GB/s for
zlib's CRC-32). Manifests written before it hold ``{"crc32": <int>}`` (zlib's CRC-32) and keep
verifying: every function here takes the algorithm the manifest names.

    stream = Stream()                       # while torch.save writes through a wrapper
    stream.update(chunk); stream.value      # -> "9c3e..." (str); Stream("crc32").value -> int
    manifest.update(stream.fields())        # {"algorithm": "xxh3_64", "digest": "9c3e..."}
    of_file(path)                           # the same fields, over a memory map of the file
    matches(path, manifest)                 # True if the file has the checksum the manifest records
    from_manifest(manifest)                 # Checksum(algorithm, value), None if it records none
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from os import PathLike
from typing import Any, NamedTuple

import xxhash

ALGORITHM = "xxh3_64"  # what new manifests record
LEGACY = "crc32"  # zlib's CRC-32, in manifests written before (key "crc32": int)
ALGORITHMS = (ALGORITHM, LEGACY)
CHUNK = 16 << 20  # bytes per update when reading a file: small enough to stay in cache, large enough to be free
BLOCK = 64 << 20  # single-file manifests also record a checksum per block, so ranks can verify a share each

_HEX16 = re.compile(r"[0-9a-fA-F]{16}")
Value = str | int  # xxh3_64: 16 lower-case hex digits; crc32: an unsigned 32-bit int (as old manifests store it)


class ManifestError(ValueError):
    """A manifest names a checksum but it is unreadable: unknown algorithm, or a malformed value."""


class Checksum(NamedTuple):
    algorithm: str
    value: Value


class Stream:
    """Streaming checksum: ``update`` with bytes-like objects (bytes, memoryview, mmap slices;
    nothing is copied), then ``value`` or ``fields()``. ``size`` counts the bytes seen."""

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        _check_algorithm(algorithm)
        self.algorithm, self.size = algorithm, 0
        self._xxh = xxhash.xxh3_64() if algorithm == ALGORITHM else None
        self._crc = 0

    def update(self, data: Any) -> None:
        view = memoryview(data)
        self.size += view.nbytes
        if self._xxh is not None:
            self._xxh.update(view)
        else:
            self._crc = zlib.crc32(view, self._crc)

    @property
    def value(self) -> Value:
        return self._xxh.hexdigest() if self._xxh is not None else self._crc

    @property
    def checksum(self) -> Checksum:
        return Checksum(self.algorithm, self.value)

    def fields(self) -> dict[str, Any]:
        """What a manifest records: ``{"algorithm": ..., "digest": ...}``."""
        return manifest_fields(self.value, self.algorithm)


def digest(data: Any, algorithm: str = ALGORITHM) -> Value:
    """Checksum of one bytes-like object."""
    stream = Stream(algorithm)
    stream.update(data)
    return stream.value


def file_digest(path: str | PathLike[str], algorithm: str = ALGORITHM) -> Value:
    """Checksum of a file, read through a memory map in CHUNK slices: no copy into Python objects,
    and the pages stay in the page cache for the load that follows. Files that cannot be mapped
    (some FUSE filesystems) are read into one reused buffer instead."""
    stream = Stream(algorithm)
    with open(path, "rb", buffering=0) as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            return stream.value
        except OSError:
            _read_into(f, stream)
            return stream.value
        with mapped:
            with contextlib.suppress(AttributeError, OSError):  # larger read-ahead when the cache is cold
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mapped)
            try:
                for start in range(0, len(view), CHUNK):
                    stream.update(view[start : start + CHUNK])
            finally:
                view.release()  # else closing the map raises BufferError
    return stream.value


def block_digests(path: str | PathLike[str], indices: Iterable[int], block: int = BLOCK) -> dict[int, Value]:
    """ALGORITHM's checksum of each given block of the file (block i: bytes [i*block, (i+1)*block)),
    read through a memory map without copies."""
    wanted = list(indices)
    with open(path, "rb", buffering=0) as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file has no blocks
            return {i: digest(b"") for i in wanted}
        except OSError:  # a file system that cannot map files (some FUSE mounts): read each block
            return {i: digest(os.pread(f.fileno(), block, i * block)) for i in wanted}
        with mapped:
            view = memoryview(mapped)
            try:
                return {i: digest(view[i * block : (i + 1) * block]) for i in wanted}
            finally:
                view.release()


class Blocks:
    """Block checksums of a stream written in pieces of any size (see BLOCK)."""

    def __init__(self, block: int | None = None) -> None:
        self.block, self._stream, self._filled = block or BLOCK, Stream(), 0
        self.digests: list[Value] = []

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.block - self._filled)
            self._stream.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.block:
                self._close()

    def _close(self) -> None:
        self.digests.append(self._stream.value)
        self._stream, self._filled = Stream(), 0

    def fields(self) -> dict[str, Any]:
        """What a manifest records: ``{"block_size": ..., "blocks": [...]}`` (a last partial block included)."""
        if self._filled:
            self._close()
        return {"block_size": self.block, "blocks": list(self.digests)}


def _read_into(f: Any, stream: Stream) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        stream.update(view[:n])


def from_manifest(manifest: Mapping[str, Any]) -> Checksum | None:
    """The checksum a manifest (or one file's entry in it) records: the new form
    ``{"algorithm": ..., "digest": ...}`` or the old ``{"crc32": int}``. None when it records no
    checksum at all (sizes only, as in DCP markers written before checksums); ManifestError when
    it names one that cannot be read (unknown algorithm, malformed value)."""
    if not isinstance(manifest, Mapping):
        raise ManifestError(f"expected a JSON object, got {type(manifest).__name__}")
    if "algorithm" in manifest or "digest" in manifest:
        algorithm, value = manifest.get("algorithm"), manifest.get("digest")
        if algorithm not in ALGORITHMS:
            raise ManifestError(f"unknown checksum algorithm {algorithm!r} (this ddpjob reads {', '.join(ALGORITHMS)})")
        return Checksum(algorithm, _parse(algorithm, value))
    if LEGACY in manifest:
        return Checksum(LEGACY, _parse(LEGACY, manifest[LEGACY]))
    return None


def manifest_fields(value: Value, algorithm: str = ALGORITHM) -> dict[str, Any]:
    """What a manifest records for a checksum: ``{"algorithm", "digest"}`` (the old
    ``{"crc32": int}`` form is only read, never written)."""
    _check_algorithm(algorithm)
    return {"algorithm": algorithm, "digest": _parse(algorithm, value)}


def of_file(path: str | PathLike[str], algorithm: str = ALGORITHM) -> dict[str, Any]:
    """The manifest fields for a file: ``{"algorithm": ..., "digest": ...}``."""
    return manifest_fields(file_digest(path, algorithm), algorithm)


def value(manifest: Mapping[str, Any]) -> Value | None:
    """The checksum value a manifest records (either form), or None when it records no readable one."""
    try:
        found = from_manifest(manifest)
    except ManifestError:
        return None
    return None if found is None else found.value


def matches(path: str | PathLike[str], expected: Checksum | Mapping[str, Any]) -> bool:
    """Whether the file has the expected checksum, by the algorithm that names it: a Checksum, or
    a manifest (or a file's entry in one) in either form. False when the manifest records no
    checksum or an unreadable one (use from_manifest for the reason); OSError if the file is
    unreadable."""
    if not isinstance(expected, Checksum):
        try:
            found = from_manifest(expected)
        except ManifestError:
            return False
        if found is None:
            return False
        expected = found
    return file_digest(path, expected.algorithm) == expected.value


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; one of {', '.join(ALGORITHMS)}")


def _parse(algorithm: str, value: Any) -> Value:
    """A recorded value in the form file_digest returns, or ManifestError."""
    if algorithm == LEGACY:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
            raise ManifestError(f"crc32 must be an unsigned 32-bit integer, got {value!r}")
        return value
    if not isinstance(value, str) or not _HEX16.fullmatch(value):
        raise ManifestError(f"{algorithm} digest must be 16 hex digits, got {value!r}")
    return value.lower()
