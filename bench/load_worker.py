"""One rank of bench/load.py: load a checkpoint one way, wrap in DDP, report time and memory.
    torchrun --nproc-per-node 2 bench/load_worker.py MODE CKPT WIDTH DEPTH
MODE: naive | ddpjob | rank0 | dcp. Prints `rank R seconds S peak_gib P base_gib B anon_gib A`:
VmHWM (which counts the file's page-cache pages this process mapped and touched, shared and
reclaimable) and the peak of RssAnon (private memory) over the load, sampled every 2 ms.
"""

import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpjob import checkpoint
from ddpjob.plugins import synthetic_mlp
from ddpjob.train import build


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


def main() -> None:
    mode, path, width, depth = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    spec = f"ddpjob.plugins:synthetic_mlp(width={width}, depth={depth})"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base, anon_base = status_gib("VmRSS"), status_gib("RssAnon")
    dist.barrier()
    anon = AnonPeak()
    start = time.perf_counter()
    if mode == "naive":  # the tutorial way: build, full torch.load, copy in, DDP broadcasts
        model = synthetic_mlp(width=width, depth=depth)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["model"])
        model = DDP(model)
    elif mode == "ddpjob":  # ddpjob's default: verified mmap, meta + assign, agree, no broadcast
        state = checkpoint.read(path)
        model = build(spec, 0, checkpoint.model_state(state, str(path)), str(path))
        seen: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, checkpoint.identity(path))
        assert len(set(seen)) == 1
        model = DDP(model, init_sync=False)
    elif mode == "rank0":  # --load-mode rank0: rank 0 reads, tensors are broadcast into place
        state = checkpoint.broadcast(checkpoint.read(path) if rank == 0 else None, torch.device("cpu"))
        model = build(spec, 0, checkpoint.model_state(state, str(path)), str(path))
        model = DDP(model, init_sync=False)
    elif mode == "dcp":  # torch.distributed.checkpoint: allocate, then read into place
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
        f"rank {rank} seconds {seconds:.3f} peak_gib {status_gib('VmHWM'):.3f} base_gib {base:.3f} "
        f"anon_gib {anon_gib:.3f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
