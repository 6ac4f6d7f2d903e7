"""Run under torchrun: train the same model a few steps with plain DDP and with ddpjob's timing
hooks, and print whether the parameters are bitwise equal (at world size 3, where DDP's 1/3
scaling is inexact, so any change to how gradients are reduced shows)."""

import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpjob.distenv import resolve
from ddpjob.train.stragglers import Stragglers


def trained(hooked: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), bucket_cap_mb=0.01)
    if hooked:
        Stragglers(resolve(os.environ), torch.device("cpu"), 1.5, 3).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(5):
        x, y = torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    same = all(torch.equal(a, b) for a, b in zip(trained(False), trained(True), strict=True))
    if dist.get_rank() == 0:
        print(f"bitwise equal: {same}", flush=True)
    # DDP's reducers sit in reference cycles: freed at interpreter exit, their gloo work aborts the
    # process ("terminate called without an active exception"); free them first, as ddpjob train does
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
