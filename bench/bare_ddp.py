"""A minimal hand-written DDP loop, the baseline for bench/loop.py, bench/startup.py and bench/gpu.sh.

Same work as `ddpjob train` on the synthetic plug-ins: DistributedSampler, fused AdamW with a cosine
schedule, cross-entropy, per-batch device moves; no checkpoints, no metrics file. Run under torchrun.
    bare_ddp.py WIDTH DEPTH SAMPLES BATCH STEPS [cuda] [bf16] [--times OUT --window FIRST,LAST]
        [--schedule-steps N]
Prints `startup S` (seconds from process start to DDP-ready, by the wall clock) and
`steps_per_s X` over the steps after the first BENCH_WARM (10). With --times, each step's wall
time over the window is written as bench/steptimes.py does for `ddpjob train`.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from steptimes import timed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddpjob.plugins import synthetic, synthetic_mlp


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("width", "depth", "samples", "batch", "steps"):
        parser.add_argument(name, type=int)
    parser.add_argument("mode", nargs="*", help="cuda, bf16")
    parser.add_argument("--times", default="", help="OUT: write per-step times to OUT.RANK.json")
    parser.add_argument("--window", default="100,600", help="FIRST,LAST steps timed with --times")
    parser.add_argument("--schedule-steps", type=int, default=0, help="the cosine schedule's length (0: STEPS)")
    a = parser.parse_args()
    if set(a.mode) - {"cuda", "bf16"}:
        parser.error(f"unknown mode(s) {a.mode}: cuda, bf16")
    cuda, bf16 = "cuda" in a.mode, "bf16" in a.mode
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = DDP(synthetic_mlp(width=a.width, depth=a.depth).to(device), device_ids=[local] if cuda else None)
    if rank == 0:
        print(f"startup {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
    if a.times:
        first, last = map(int, a.window.split(","))
        data = timed(f"ddpjob.plugins:synthetic(samples={a.samples})", a.times, first, last)
    else:
        data = synthetic(samples=a.samples)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=a.batch, sampler=sampler, drop_last=True, pin_memory=cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)  # ddpjob's defaults
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=a.schedule_steps or a.steps)
    loss_fn = nn.CrossEntropyLoss()
    warm = int(os.environ.get("BENCH_WARM", "10"))
    done, epoch, start = 0, 0, 0.0
    while done < a.steps:
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
            if done == warm:
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
            if done == a.steps:
                break
        epoch += 1
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:
        print(f"steps_per_s {(a.steps - warm) / (time.perf_counter() - start):.3f}", flush=True)
        if cuda:
            print(f"gpu_mem_gib {torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
