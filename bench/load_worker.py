"""One rank of bench/load.py: load a checkpoint one way, wrap in DDP, report time and memory.
    torchrun --nproc-per-node 2 bench/load_worker.py MODE CKPT WIDTH DEPTH
MODE: naive | ddpjob | rank0 | dcp. Prints `rank R seconds S verify_s V peak_gib P base_gib B
anon_gib A`: S from the start of loading to DDP-ready, V the part of S spent verifying the
checkpoint against its manifest (timed on its own, before the load, which then skips its own
check), VmHWM (which counts the file's page-cache pages this process mapped and touched, shared
and reclaimable) and the peak of RssAnon (private memory) over the load, sampled every 2 ms.
Rank 0 also prints `verifier NAME`: what V timed (see verifier()).
"""

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpjob.checkpoint import checksum, weights
from ddpjob.checkpoint.formats import dcp_folder, single_file
from ddpjob.plugins import synthetic_mlp
from ddpjob.train.setup import build


def status_gib(key: str) -> float:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key))
    return int(line.split()[1]) / 2**20


class AnonPeak:
    """Highest RssAnon seen while loading, from a sampling thread."""

    def __init__(self) -> None:
        self.peak, self.done = status_gib("RssAnon"), threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, status_gib("RssAnon"))

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return max(self.peak, status_gib("RssAnon"))


def _records_new_checksums(entry: object) -> bool:
    try:
        found = checksum.from_manifest(entry) if isinstance(entry, dict) else None
    except checksum.ManifestError:
        return False
    return found is not None and found.algorithm == checksum.ALGORITHM


def verifier(path: Path, share: tuple[int, int]) -> tuple[str, Callable[[], str | None]]:
    """What a load checks before it reads: ddpjob's own verify (checkpoint.verify for a file,
    sharded.verify for a DCP folder) once its manifests record ddpjob.checkpoint.checksum's algorithm, on this
    rank's ``share`` (part, parts) of the checksums as ddpjob's loader splits them between a node's
    ranks ((0, 1): all of them, as rank 0 does in --load-mode rank0);
    before that, a stand-in that costs the same: size and checksum.file_digest of every file."""
    if path.is_dir():
        try:
            entries = json.loads((path / dcp_folder.MARKER).read_text())["files"].values()
        except (OSError, ValueError, KeyError, AttributeError):
            entries = []
        if entries and all(_records_new_checksums(e) for e in entries):
            return f"sharded.verify ({checksum.ALGORITHM}, this rank's share)", lambda: dcp_folder.verify(path, share)
        files = sorted(p for p in path.iterdir() if p.name != dcp_folder.MARKER)
    else:
        try:
            manifest = json.loads(single_file.manifest_path(path).read_text())
        except (OSError, ValueError):
            manifest = None
        if _records_new_checksums(manifest):
            return f"checkpoint.verify ({checksum.ALGORITHM}, this rank's share)", lambda: single_file.verify(
                path, share
            )
        files = [path]

    def stand_in() -> str | None:
        for file in files:
            file.stat()
            checksum.file_digest(file)
        return None

    return f"stand-in: size + checksum.file_digest ({checksum.ALGORITHM}) per file", stand_in


def main() -> None:
    mode, path, width, depth = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    share = (0, 1) if mode == "rank0" else (int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    spec = f"ddpjob.plugins:synthetic_mlp(width={width}, depth={depth})"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base, anon_base = status_gib("VmRSS"), status_gib("RssAnon")
    name, verify = verifier(path, share)
    if rank == 0:
        print(f"verifier {name}", flush=True)

    def verified() -> None:
        nonlocal verify_s
        begin = time.perf_counter()
        reason = verify()
        verify_s = time.perf_counter() - begin
        assert reason is None, f"{path} failed verification: {reason}"

    verify_s = 0.0
    dist.barrier()
    anon = AnonPeak()
    start = time.perf_counter()
    if mode == "naive":  # the tutorial way: build, full torch.load, copy in, DDP broadcasts
        model = synthetic_mlp(width=width, depth=depth)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["model"])
        model = DDP(model)
    elif mode == "ddpjob":  # ddpjob's default: verified mmap, meta + assign, agree, no broadcast
        verified()
        state = single_file.read(path, verified=True)
        model = build(spec, 0, weights.model_state(state, str(path)), str(path))
        seen: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, single_file.identity(path))
        assert len(set(seen)) == 1
        model = DDP(model, init_sync=False)
    elif mode == "rank0":  # --load-mode rank0: rank 0 reads, tensors are broadcast into place
        if rank == 0:
            verified()
        state = weights.broadcast(single_file.read(path, verified=True) if rank == 0 else None, None)
        model = build(spec, 0, weights.model_state(state, str(path)), str(path))
        model = DDP(model, init_sync=False)
    elif mode == "dcp":  # torch.distributed.checkpoint: verify, allocate, then read into place
        verified()
        with torch.device("meta"):
            model = synthetic_mlp(width=width, depth=depth)
        model = model.to_empty(device="cpu")
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(path))
        model = DDP(model, init_sync=False)
    dist.barrier()
    seconds = time.perf_counter() - start
    anon_gib = anon.stop() - anon_base
    print(
        f"rank {rank} seconds {seconds:.3f} verify_s {verify_s:.3f} peak_gib {status_gib('VmHWM'):.3f} base_gib {base:.3f} "
        f"anon_gib {anon_gib:.3f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
