"""One rank of bench/load.py: load a checkpoint one way, wrap in DDP, report time and memory.
    torchrun --nproc-per-node 2 bench/load_worker.py MODE CKPT WIDTH DEPTH
MODE: naive | ddpjob | rank0 | dcp. Prints `rank R seconds S peak_gib P base_gib B`.
"""

import sys
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


def main() -> None:
    mode, path, width, depth = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    spec = f"ddpjob.plugins:synthetic_mlp(width={width}, depth={depth})"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = status_gib("VmRSS")
    dist.barrier()
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
    elif mode == "rank0":  # only rank 0 reads; DDP broadcasts its weights to the others
        if rank == 0:
            model = build(spec, 0, checkpoint.model_state(checkpoint.read(path), str(path)), str(path))
        else:
            with torch.device("meta"):
                model = synthetic_mlp(width=width, depth=depth)
            model = model.to_empty(device="cpu")
        model = DDP(model)
    elif mode == "dcp":  # torch.distributed.checkpoint: allocate, then read into place
        with torch.device("meta"):
            model = synthetic_mlp(width=width, depth=depth)
        model = model.to_empty(device="cpu")
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(path))
        model = DDP(model, init_sync=False)
    dist.barrier()
    seconds = time.perf_counter() - start
    print(f"rank {rank} seconds {seconds:.3f} peak_gib {status_gib('VmHWM'):.3f} base_gib {base:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
