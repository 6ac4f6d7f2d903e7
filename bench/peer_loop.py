"""One training loop written for each peer of bench/peers.py: Lightning Fabric, HF Accelerate, or
plain torch with ``fully_shard`` (the hand-written FSDP2 loop; the hand-written DDP loops are
bench/bare_ddp.py and bench/bare_lm.py).

The same work on every side, and as ddpjob does it: the model of ``--model`` built under seed 0, the
training set of ``--data`` (its validation set dropped), timed per step as bench/steptimes.py does,
``--batch`` per process, shuffled, drop_last, no workers; fused AdamW (lr 3e-3, no weight decay) and
``CosineAnnealingLR`` over ``--epochs`` epochs of steps; the model's own loss for dict batches, else
cross-entropy of ``model(x)`` against ``y``. With ``--strategy fsdp2`` every module of class
``--blocks`` is a shard unit, then the model (ddpjob's default blocks for tiny_lm and the MLP).
Each framework's own way: Fabric's ``setup``/``backward`` (DDPStrategy, or ModelParallelStrategy
with ``fully_shard`` as its parallelize function), Accelerate's ``prepare``/``backward`` (its FSDP
plugin with ``fsdp_version=2`` for fsdp2). The LR schedule steps the optimizer itself on every side
(Accelerate's prepared scheduler would step once per process). Run under torchrun, gloo, CPU:
    peer_loop.py --framework fabric --strategy ddp --model SPEC --data SPEC --batch 16 --steps 101
        --epochs 10 --times OUT --window 20,100 [--blocks Block]
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from steptimes import timed
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ddpjob.plugins import build_model

Backward = Callable[[torch.Tensor], None]


def shard(model: nn.Module, mesh: DeviceMesh, blocks: str) -> nn.Module:
    """fully_shard each module of class ``blocks``, innermost first, then the model."""
    for module in reversed(list(model.modules())):
        if type(module).__name__ == blocks and module is not model:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)  # ddpjob's defaults


def with_torch(a: argparse.Namespace, model: nn.Module, loader: DataLoader[Any]) -> tuple[Any, ...]:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import DistributedSampler

    model = shard(model, init_device_mesh("cpu", (dist.get_world_size(),)), a.blocks)
    sampler = DistributedSampler(loader.dataset, seed=0)
    loader = DataLoader(loader.dataset, batch_size=a.batch, sampler=sampler, drop_last=True)
    optimizer = adamw(model)

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    return model, optimizer, optimizer, loader, backward, sampler.set_epoch


def with_fabric(a: argparse.Namespace, model: nn.Module, loader: DataLoader[Any]) -> tuple[Any, ...]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

    if a.strategy == "fsdp2":
        strategy: Any = ModelParallelStrategy(
            parallelize_fn=lambda m, mesh: shard(m, mesh["data_parallel"], a.blocks),
            data_parallel_size=int(os.environ["WORLD_SIZE"]),
            tensor_parallel_size=1,
        )
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy)
    fabric.launch()
    if a.strategy == "fsdp2":  # sharded parameters first, then the optimizer over them
        model = fabric.setup_module(model)
        raw = adamw(model)
        optimizer = fabric.setup_optimizers(raw)
    else:
        raw = adamw(model)
        model, optimizer = fabric.setup(model, raw)
    return model, optimizer, raw, fabric.setup_dataloaders(loader), fabric.backward, lambda epoch: None


def with_accelerate(a: argparse.Namespace, model: nn.Module, loader: DataLoader[Any]) -> tuple[Any, ...]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = None
    if a.strategy == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[a.blocks],
            reshard_after_forward=True,
            cpu_ram_efficient_loading=False,
        )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    raw = adamw(model)
    model, optimizer, loader = accelerator.prepare(model, raw, loader)
    return model, optimizer, raw, loader, accelerator.backward, lambda epoch: None


FRAMEWORKS = {"torch": with_torch, "fabric": with_fabric, "accelerate": with_accelerate}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--blocks", default="Block", help="the class whose modules are FSDP2's shard units")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=1, help="the cosine schedule runs over this many epochs")
    parser.add_argument("--times", required=True)
    parser.add_argument("--window", required=True, help="FIRST,LAST: the steps timed")
    a = parser.parse_args()
    if a.framework == "torch" and a.strategy == "ddp":
        parser.error("the hand-written DDP loops are bench/bare_ddp.py and bench/bare_lm.py")
    first, last = map(int, a.window.split(","))
    torch.manual_seed(0)
    model = build_model(a.model)
    data = timed(a.data, a.times, first, last, val=False)
    loader = DataLoader(data, batch_size=a.batch, shuffle=True, drop_last=True)
    model, optimizer, raw, loader, backward, set_epoch = FRAMEWORKS[a.framework](a, model, loader)
    wrapper = FSDPModule if a.strategy == "fsdp2" else DistributedDataParallel
    if not any(isinstance(m, wrapper) for m in model.modules()):  # the framework took the strategy asked for
        raise SystemExit(f"{a.framework} did not wrap the model in {wrapper.__name__}")
    world = int(os.environ["WORLD_SIZE"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(raw, T_max=len(data) // (a.batch * world) * a.epochs)
    done, epoch = 0, 0
    while done < a.steps:
        set_epoch(epoch)
        for batch in loader:
            if isinstance(batch, dict):
                loss = model(**batch)["loss"]
            else:
                x, y = batch
                loss = F.cross_entropy(model(x), y)
            backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == a.steps:
                break
        epoch += 1
    if int(os.environ["RANK"]) == 0:
        print(f"done {done} steps", flush=True)
    # As ddpjob does: DDP's reducer sits in reference cycles, and its pending gloo work, freed only at
    # interpreter exit, once left a Fabric rank 0 waiting for ever after rank 1 had exited.
    del model, optimizer, raw, loader, backward
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
