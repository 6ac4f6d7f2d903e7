"""A hand-written DDP loop for the language model, the baseline for bench/lm.py.

What a user writes without ddpjob: examples/lm.py's tiny_lm on its stdlib_text data, dict batches
passed as keyword arguments, the model's own loss, fused AdamW with a cosine schedule (ddpjob's defaults:
lr 3e-3, no weight decay, the schedule over all epochs' steps), DistributedSampler, optionally
torch.compile of the DDP module. Run under torchrun; writes per-step times as bench/steptimes.py does.
    bare_lm.py --batch 16 --block 128 --steps 601 --epochs 1 --times OUT --window 100,600 [--compile]
"""

import argparse
import os

import torch
import torch.distributed as dist
from steptimes import timed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddpjob.plugins import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="examples.lm:tiny_lm(block=128)")
    parser.add_argument("--data", default="examples.lm:stdlib_text(block=128)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=601)
    parser.add_argument("--epochs", type=int, default=1, help="the cosine schedule runs over this many epochs")
    parser.add_argument("--times", required=True)
    parser.add_argument("--window", default="100,600")
    parser.add_argument("--compile", action="store_true")
    a = parser.parse_args()
    first, last = map(int, a.window.split(","))
    dist.init_process_group("gloo")
    world, device = dist.get_world_size(), torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(build_model(a.model))
    net = torch.compile(model) if a.compile else model
    data = timed(a.data, a.times, first, last, val=False)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=a.batch, sampler=sampler, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)  # as ddpjob
    schedule_steps = len(data) // (a.batch * world) * a.epochs
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=schedule_steps)
    done, epoch = 0, 0
    while done < a.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = net(**batch)["loss"]
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == a.steps:
                break
        epoch += 1
    if int(os.environ["RANK"]) == 0:
        print(f"done {done} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
