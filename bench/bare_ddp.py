"""A minimal hand-written DDP loop, the baseline for bench/loop.py, bench/startup.py and bench/gpu.sh.

Same work as `ddpjob train` on the synthetic plug-ins: DistributedSampler, AdamW with a cosine
schedule, cross-entropy, per-batch device moves; no checkpoints, no metrics file. Run under torchrun.
    bare_ddp.py WIDTH DEPTH SAMPLES BATCH STEPS [cuda] [bf16]
Prints `startup S` (seconds from process start to DDP-ready, by the wall clock) and
`steps_per_s X` over the steps after the first 10.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddpjob.plugins import synthetic, synthetic_mlp


def main() -> None:
    width, depth, samples, batch, steps = map(int, sys.argv[1:6])
    cuda, bf16 = "cuda" in sys.argv[6:], "bf16" in sys.argv[6:]
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = DDP(synthetic_mlp(width=width, depth=depth).to(device), device_ids=[local] if cuda else None)
    if rank == 0:
        print(f"startup {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
    data = synthetic(samples=samples)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True, pin_memory=cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)  # ddpjob's defaults
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    loss_fn = nn.CrossEntropyLoss()
    done, epoch, start = 0, 0, 0.0
    while done < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == int(os.environ.get("BENCH_WARM", "10")):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
            if done == steps:
                break
        epoch += 1
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:
        warm = int(os.environ.get("BENCH_WARM", "10"))
        print(f"steps_per_s {(steps - warm) / (time.perf_counter() - start):.3f}", flush=True)
        if cuda:
            print(f"gpu_mem_gib {torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
