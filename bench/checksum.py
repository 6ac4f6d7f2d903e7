"""Checksum speed over a memory-mapped file, read in 16 MiB chunks as ddpjob.checkpoint.checksum reads it:
zlib's CRC-32 (the old manifests) against the candidates for the new one, warm page cache, plus
the machine's memory-read floor measured in the same run, and ddpjob.checkpoint.checksum.file_digest itself.
Candidates whose package is not installed are skipped (pip install google-crc32c crc32c to
compare them all).
    python bench/checksum.py [--gib 1] [--repeats 5] [--dir DIR]
"""

import argparse
import mmap
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO, median, table

from ddpjob.checkpoint import checksum

CHUNK = 16 << 20


def candidates() -> dict[str, Callable[[memoryview], object]]:
    """name -> a function that checksums a buffer in 16 MiB chunks, without copies."""

    def chunked(start: object, step: Callable[[object, memoryview], object]) -> Callable[[memoryview], object]:
        def run(view: memoryview) -> object:
            state = start
            for at in range(0, len(view), CHUNK):
                state = step(state, view[at : at + CHUNK])
            return state

        return run

    found: dict[str, Callable[[memoryview], object]] = {
        "zlib crc32 (legacy)": chunked(0, lambda crc, data: zlib.crc32(data, crc))
    }
    try:
        import google_crc32c

        # its C extension takes bytes only (no memoryview, mmap or bytearray): each chunk is copied
        found[f"google-crc32c ({google_crc32c.implementation}; bytes only: a copy per chunk)"] = chunked(
            0, lambda crc, data: google_crc32c.extend(crc, bytes(data))
        )
    except ImportError:
        pass
    try:
        import crc32c

        kind = "hardware" if crc32c.hardware_based else "software"
        found[f"crc32c, ICRAR ({kind})"] = chunked(0, lambda crc, data: crc32c.crc32c(data, crc))
    except ImportError:
        pass
    try:
        import xxhash

        def streamed(make: Callable[[], Any]) -> Callable[[memoryview], object]:
            def run(view: memoryview) -> object:
                h = make()
                for at in range(0, len(view), CHUNK):
                    h.update(view[at : at + CHUNK])
                return h.intdigest()

            return run

        found["xxhash xxh3_64"] = streamed(xxhash.xxh3_64)
        found["xxhash xxh3_128"] = streamed(xxhash.xxh3_128)
    except ImportError:
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=REPO / "runs")
    a = parser.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-checksum-", dir=a.dir))
    try:
        path, size = work / "data.bin", int(a.gib * 2**30)
        with open(path, "wb") as f:
            rng = np.random.default_rng(0)
            for _ in range(0, size, CHUNK):
                f.write(rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes())
        size = path.stat().st_size
        rows = []
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            pages = np.frombuffer(mapped, dtype=np.uint64)
            pages.sum()  # fault every page in: warm cache, mapped
            times = []
            for _ in range(a.repeats):
                start = time.perf_counter()
                pages.sum()
                times.append(time.perf_counter() - start)
            floor = size / median(times) / 1e9
            rows.append(["numpy sum of the mapped file (memory-read floor)", floor, 1.0])
            for name, fn in candidates().items():
                fn(view)
                times = []
                for _ in range(a.repeats):
                    start = time.perf_counter()
                    fn(view)
                    times.append(time.perf_counter() - start)
                rate = size / median(times) / 1e9
                rows.append([name, rate, rate / floor])
            del pages
            view.release()
        for algorithm in checksum.ALGORITHMS:  # the module itself: its own map of the file, per call
            checksum.file_digest(path, algorithm)
            times = []
            for _ in range(a.repeats):
                start = time.perf_counter()
                checksum.file_digest(path, algorithm)
                times.append(time.perf_counter() - start)
            rate = size / median(times) / 1e9
            rows.append([f"ddpjob.checkpoint.checksum.file_digest({algorithm!r})", rate, rate / floor])
        table(
            f"checksum over a {size / 2**30:.2f} GiB memory-mapped file, 16 MiB chunks, warm, "
            f"1 thread, median of {a.repeats} ({os.cpu_count()} CPUs)",
            ["what", "GB/s", "x floor"],
            rows,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
