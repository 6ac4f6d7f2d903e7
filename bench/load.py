"""Model loading on 2 local ranks: time from the start of loading to DDP-ready, and peak RSS per
rank, for (a) naive, (b) ddpjob's default, (c) --load-mode rank0, (d) DCP; 1 and 2 GiB fp32
models; warm and cold page cache (cold needs root: echo 3 > /proc/sys/vm/drop_caches). Also the
machine's floors measured in the same run: disk read, page-cache read and memory copy bandwidth.
    python bench/load.py [--repeats 3] [--sizes 1,2] [--modes naive,ddpjob,rank0,dcp] [--dir DIR]
"""

import argparse
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from common import REPO, median, run, table, torchrun

from ddpjob import checkpoint
from ddpjob.plugins import synthetic_mlp

HIDDEN_PER_GIB = 4  # synthetic_mlp(width=8192): four 8192x8192 hidden layers are 1 GiB of fp32
MODES = {"naive": "(a) naive", "ddpjob": "(b) ddpjob default", "rank0": "(c) --load-mode rank0", "dcp": "(d) DCP"}


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_gbps(path: Path) -> float:
    start, size = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(64 << 20):
            size += len(chunk)
    return size / (time.perf_counter() - start) / 1e9


def copy_gibps() -> float:
    src, dst = torch.ones(256 << 20), torch.empty(256 << 20)  # 1 GiB each
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return 1 / (time.perf_counter() - start)


def make_checkpoints(directory: Path, depth: int) -> tuple[Path, Path]:
    torch.manual_seed(0)
    model = synthetic_mlp(width=8192, depth=depth)
    single = directory / f"depth{depth}.pt"
    checkpoint.save({"format": checkpoint.FORMAT, "model": model.state_dict()}, single)
    sharded = directory / f"depth{depth}.dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(sharded), no_dist=True)
    return single, sharded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1,2", help="GiB, comma separated")
    parser.add_argument("--modes", default=",".join(MODES), help="comma separated, of " + ", ".join(MODES))
    parser.add_argument("--dir", type=Path, default=REPO / "runs", help="where the checkpoints are written")
    a = parser.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    cold_ok = drop_caches()
    rows, floors = [], []
    work = Path(tempfile.mkdtemp(prefix="bench-load-", dir=a.dir))
    try:
        for gib in map(int, a.sizes.split(",")):
            depth = HIDDEN_PER_GIB * gib + 1  # depth counts the input layer too
            single, sharded = make_checkpoints(work, depth)
            size = single.stat().st_size / 2**30
            if cold_ok:
                drop_caches()
                floors.append([f"{size:.2f} GiB file", "disk read (cold)", f"{read_gbps(single):.2f} GB/s"])
            floors.append([f"{size:.2f} GiB file", "page-cache read (warm)", f"{read_gbps(single):.2f} GB/s"])
            for cache in ["warm", "cold"] if cold_ok else ["warm"]:
                for mode in a.modes.split(","):
                    label = MODES[mode]
                    times, peaks, deltas, anons = [], [], [], []
                    for _ in range(a.repeats):
                        source = sharded if mode == "dcp" else single
                        if cache == "cold":
                            drop_caches()
                        else:
                            read_gbps(source) if source.is_file() else [read_gbps(p) for p in source.iterdir()]
                        out = run(
                            torchrun(2, str(REPO / "bench/load_worker.py"), mode, str(source), "8192", str(depth)),
                            cwd=work,
                            OMP_NUM_THREADS="1",
                        )
                        ranks = re.findall(
                            r"seconds ([\d.]+) peak_gib ([\d.]+) base_gib ([\d.]+) anon_gib ([\d.]+)", out
                        )
                        times.append(max(float(t) for t, _, _, _ in ranks))
                        peaks.append(max(float(p) for _, p, _, _ in ranks))
                        deltas.append(max(float(p) - float(b) for _, p, b, _ in ranks))
                        anons.append(max(float(a) for _, _, _, a in ranks))
                    rows.append(
                        [
                            f"{size:.2f}",
                            cache,
                            label,
                            median(times),
                            median(peaks),
                            median(deltas),
                            median(deltas) / size,
                            median(anons),
                            median(anons) / size,
                        ]
                    )
        floors.append(["1 GiB tensor", "memory copy (copy_, 1 thread)", f"{copy_gibps():.2f} GiB/s"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table(
        f"load: 2 local ranks, gloo, median of {a.repeats} (peak = VmHWM of the larger rank; delta = over its "
        "RSS before loading; private = peak RssAnon growth, without the file's shared page-cache pages)",
        [
            "GiB",
            "cache",
            "way",
            "s to DDP-ready",
            "peak RSS GiB",
            "delta GiB",
            "delta / size",
            "private GiB",
            "private / size",
        ],
        rows,
    )
    table("floors, measured in the same run", ["on", "what", "bandwidth"], floors)
    by = {(r[0], r[1], r[2]): r for r in rows}
    for gib in sorted({r[0] for r in rows}):
        naive, ours = by.get((gib, "warm", MODES["naive"])), by.get((gib, "warm", MODES["ddpjob"]))
        if naive and ours:
            print(
                f"{gib} GiB warm: ddpjob {naive[3] / ours[3]:.1f}x faster than naive (target >= 4), "
                f"peak delta {ours[6]:.2f}x the checkpoint, private {ours[8]:.2f}x (target <= 1.2)"
            )
    if not cold_ok:
        print("cold cache not measured: writing /proc/sys/vm/drop_caches needs root")


if __name__ == "__main__":
    main()
