"""Model loading on 2 local ranks: time from the start of loading to DDP-ready, and peak RSS per
rank, for (a) naive, (b) ddpjob's default, (c) --load-mode rank0, (d) DCP; 1 and 2 GiB fp32
models; warm and cold page cache (cold needs root: echo 3 > /proc/sys/vm/drop_caches). Also the
machine's floors measured in the same run: disk read, page-cache read and memory copy bandwidth.
Each way that checks the checkpoint (b, c, d) times that check on its own: "verify s" is the part
of "s to DDP-ready" spent verifying the file(s) against the manifest (ddpjob's verify, or a
stand-in of the same cost while the manifests predate ddpjob.checkpoint.checksum), "verify / load" that
part over the rest of the load (target <= 0.1 for both formats).
    python bench/load.py [--repeats 3] [--sizes 1,2] [--modes naive,ddpjob,rank0,dcp] [--dir DIR]
"""

import argparse
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from common import REPO, median, run, table, torchrun

from ddpjob.checkpoint.formats import dcp_folder, single_file
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
    single_file.save({"format": single_file.FORMAT, "model": model.state_dict()}, single)
    folder = directory / f"depth{depth}.dcp"  # with ddpjob's marker (sizes, checksums) as a save writes it
    dcp_folder.write_model(model.state_dict(), folder)
    return single, folder


def ratio(verifies: list[float], totals: list[float]) -> float:
    """Median over runs of verify time / the rest of the time to DDP-ready."""
    return median([v / max(t - v, 1e-9) for v, t in zip(verifies, totals, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1,2", help="GiB, comma separated")
    parser.add_argument("--modes", default=",".join(MODES), help="comma separated, of " + ", ".join(MODES))
    parser.add_argument("--dir", type=Path, default=REPO / "runs", help="where the checkpoints are written")
    a = parser.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    cold_ok = drop_caches()
    rows, floors, verifiers = [], [], Counter()
    work = Path(tempfile.mkdtemp(prefix="bench-load-", dir=a.dir))
    try:
        for gib in map(int, a.sizes.split(",")):
            depth = HIDDEN_PER_GIB * gib + 1  # depth counts the input layer too
            single, folder = make_checkpoints(work, depth)
            size = single.stat().st_size / 2**30
            if cold_ok:
                drop_caches()
                floors.append([f"{size:.2f} GiB file", "disk read (cold)", f"{read_gbps(single):.2f} GB/s"])
            floors.append([f"{size:.2f} GiB file", "page-cache read (warm)", f"{read_gbps(single):.2f} GB/s"])
            for cache in ["warm", "cold"] if cold_ok else ["warm"]:
                for mode in a.modes.split(","):
                    label = MODES[mode]
                    times, peaks, deltas, anons, verifies = [], [], [], [], []
                    for _ in range(a.repeats):
                        source = folder if mode == "dcp" else single
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
                            r"seconds ([\d.]+) verify_s [\d.]+ peak_gib ([\d.]+) base_gib ([\d.]+) anon_gib ([\d.]+)",
                            out,
                        )
                        verifies.append(max(float(v) for v in re.findall(r"verify_s ([\d.]+)", out)))
                        if mode != "naive":
                            verifiers.update(re.findall(r"^verifier (.+)$", out, re.MULTILINE)[:1])
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
                            median(verifies) if mode != "naive" else "-",
                            ratio(verifies, times) if mode != "naive" else "-",
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
            "verify s",
            "verify / load",
        ],
        rows,
    )
    table("floors, measured in the same run", ["on", "what", "bandwidth"], floors)
    table("what 'verify s' timed", ["verifier", "runs"], sorted(verifiers.items()))
    by = {(r[0], r[1], r[2]): r for r in rows}
    for gib in sorted({r[0] for r in rows}):
        naive, ours = by.get((gib, "warm", MODES["naive"])), by.get((gib, "warm", MODES["ddpjob"]))
        if naive and ours:
            print(
                f"{gib} GiB warm: ddpjob {naive[3] / ours[3]:.1f}x faster than naive (target >= 4), "
                f"peak delta {ours[6]:.2f}x the checkpoint, private {ours[8]:.2f}x (target <= 1.2)"
            )
    for row in rows:
        if row[2] in (MODES["ddpjob"], MODES["dcp"]) and isinstance(row[10], float):
            kind = "DCP folder" if row[2] == MODES["dcp"] else "single file"
            cold = (
                "; cold: this pass is the file's first read from disk, which a memory-mapped load "
                "otherwise defers to the first touch of the weights"
                if row[1] == "cold"
                else ""
            )
            print(
                f"{row[0]} GiB {row[1]} {kind}: verify {row[9]:.3f} s = {row[10]:.1%} of the rest of the load "
                f"({row[3] - row[9]:.3f} s; target <= 10%: {'met' if row[10] <= 0.1 else 'NOT met'}), "
                f"{float(row[0]) * 2**30 / 1e9 / row[9]:.2f} GB/s per rank{cold}"
            )
    if not cold_ok:
        print("cold cache not measured: writing /proc/sys/vm/drop_caches needs root")


if __name__ == "__main__":
    main()
