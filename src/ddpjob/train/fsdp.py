"""``--strategy fsdp2``: the user's model sharded over the ranks with ``fully_shard`` (FSDP2).

What it owns: which modules are the blocks sharded one by one (``--shard-modules``); building the
model on the meta device so that each rank allocates only its own shard of every parameter;
giving those shards their values (a fresh start, a single-file ``--init-from``); mixed precision
(``--precision bf16`` on CUDA: parameters in bf16, gradient reductions in fp32); activation
checkpointing per block.

A fresh start takes exactly the weights a DDP start takes: rank 0 builds the model the ordinary way
on the CPU under the seed (so whatever its factory does, a Hugging Face model's own init included,
counts) and each rank receives its shards of that full state. The cost: rank 0 holds the whole model
on the CPU once, while the run starts. Starting from weights (``--init-from``, a resume), nothing is
built whole, unless the model has buffers outside its state dict (``persistent=False``): rank 0
builds it then too, and every rank takes those buffers from that build.

Tied weights must land in one shard group: ``--shard-modules`` that splits the modules sharing a
parameter is refused in one line.

torch's sharded stack (FSDP2, DTensor, distributed checkpoint: they import sympy) is imported where a
function here uses it, never by importing this module, so that a DDP run does not pay seconds of
start-up for it (tests/process/test_start_imports.py); ``is_sharded`` and ``whole`` answer without it
while it is not loaded, since no sharded module or DTensor can exist before.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddpjob import log
from ddpjob.checkpoint.weights import check_compatible, to_model_dtypes, with_tied
from ddpjob.config import Config, is_spec
from ddpjob.errors import UsageError
from ddpjob.plugins import build_model, load_function
from ddpjob.train import rng

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


def loaded(module: str, name: str) -> Any:
    """``module.name`` if ``module`` is imported already, else None (without importing it)."""
    found = sys.modules.get(module)
    return getattr(found, name, None) if found is not None else None


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    dtensor = loaded("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The children with parameters of the model's ModuleList or Sequential that has the most of
    them (ties: the one with more parameters); [] when there is none with two or more."""
    containers = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.Sequential)]
    ranked = [([c for c in m.children() if has_params(c)], m) for m in containers]
    if not ranked:
        return []
    children, _ = max(ranked, key=lambda r: (len(r[0]), sum(p.numel() for p in r[1].parameters())))
    return children if len(children) >= 2 else []


def blocks(model: nn.Module, spec: str) -> list[nn.Module]:
    """The modules ``--shard-modules`` names (see Config), with parameters, the model itself left out,
    innermost first (``fully_shard`` goes bottom-up)."""
    if not spec:
        chosen = default_blocks(model)
    elif is_spec(spec):
        found = load_function(spec)(model)
        chosen = list(found) if isinstance(found, list | tuple) else []
        known = {id(m) for m in model.modules()}
        if not chosen or not all(isinstance(m, nn.Module) and id(m) in known for m in chosen):
            raise UsageError(
                f"--shard-modules {spec} returned {type(found).__name__}, not a list of the model's own modules; "
                "return e.g. list(model.blocks)"
            )
    else:
        names = {n.strip() for n in spec.split(",") if n.strip()}
        classes = {type(m).__name__ for m in model.modules()}
        if unknown := sorted(names - classes):
            raise UsageError(
                f"--shard-modules names {', '.join(unknown)}, which the model has no module of; "
                f"its classes are {', '.join(sorted(classes))}"
            )
        chosen = [m for m in model.modules() if type(m).__name__ in names]
    order = {id(m): i for i, m in enumerate(model.modules())}
    kept = [m for m in chosen if m is not model and has_params(m)]
    return sorted(kept, key=lambda m: -order[id(m)])


def check_tied(model: nn.Module, chosen: list[nn.Module]) -> None:
    """Refuse (one line) blocks that split a shared parameter: each module's shard group is the
    innermost chosen block around it, else the model; every module using a tied weight must be in one."""
    group: dict[int, nn.Module] = {}
    for block in reversed(chosen):  # outermost first: an inner block claims its modules after
        group.update((id(m), block) for m in block.modules())
    users: dict[int, dict[int, str]] = {}  # parameter -> shard group -> the first module using it there
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            where = users.setdefault(id(param), {})
            where.setdefault(id(group.get(id(module), model)), name or "the model")
    for where in users.values():
        if len(where) > 1:
            names = " and ".join(where.values())
            raise UsageError(
                f"--shard-modules puts {names}, which share a tied weight, in different shard groups; "
                "name a module holding all of them (their common parent) or leave them out of --shard-modules"
            )


def checkpoint_activations(block: nn.Module) -> None:
    """Recompute the block's forward in backward instead of keeping its activations. The forward
    is replaced on the instance, so parameter names (and checkpoints) stay as they are."""
    forward = block.forward

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed


def mesh_for(device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh over every rank, on the device type in use (never a gloo mesh for
    CUDA modules)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard(model: nn.Module, cfg: Config, device: torch.device, warn: bool) -> nn.Module:
    """fully_shard each block, then the model (whatever is left: embeddings, head, norms)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = cfg.precision == "bf16" and device.type == "cuda"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mesh": mesh_for(device), **({"mp_policy": policy} if policy else {})}
    chosen = blocks(model, cfg.shard_modules)
    check_tied(model, chosen)
    if not chosen and warn:
        log.warning(
            f"{type(model).__name__} has no blocks to shard one by one (no ModuleList or Sequential "
            "of 2+ modules with parameters; see --shard-modules): the whole model is one shard unit, "
            "gathered whole for its forward and backward"
        )
    for block in chosen:
        if cfg.activation_checkpointing:
            checkpoint_activations(block)
        fully_shard(block, **kwargs)
    if cfg.activation_checkpointing and not chosen:
        checkpoint_activations(model)
    fully_shard(model, **kwargs)
    return model


@torch.no_grad()
def fill(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the whole tensor) into ``target`` (a shard or a plain tensor)."""
    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        part = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(full)


def unsaved_buffers(model: nn.Module) -> list[str]:
    """The names of the model's buffers outside its state dict (``persistent=False``)."""
    saved = set(model.state_dict(keep_vars=True))
    return [name for name, _ in model.named_buffers() if name not in saved]


def built_on_rank0(spec: str, seed: int, needed: bool) -> nn.Module | None:
    """On rank 0, when ``needed``: the model built as a DDP fresh start builds it, on the CPU."""
    if not needed or dist.get_rank() != 0:
        return None
    rng.seed_all(seed)
    with torch.device("cpu"):
        return build_model(spec)


@torch.no_grad()
def copy_from_rank0(model: nn.Module, built: nn.Module | None, fresh: bool) -> None:
    """Every rank takes its shards of ``built`` (rank 0's model: see above), when ``fresh``, and
    its buffers outside the state dict (whole on every rank) always."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if fresh:
        state = built.state_dict() if built is not None else {}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    mine = dict(model.named_buffers())
    theirs = dict(built.named_buffers()) if built is not None else {}
    for name in unsaved_buffers(model):
        if built is not None:
            mine[name].copy_(theirs[name])
        dist.broadcast(mine[name], src=0)


def load_full(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Each rank copies its shard of every tensor of ``state`` (whole tensors, e.g. memory-mapped
    from one file) into the sharded model."""
    state = with_tied(model, state)
    check_compatible(model, state, source)  # a DTensor's shape is the whole tensor's
    state = to_model_dtypes(model, state, source)
    for name, target in model.state_dict(keep_vars=True).items():
        fill(target, state[name])


def build(
    cfg: Config, device: torch.device, state: Mapping[str, torch.Tensor] | None, source: str, warn: bool, fresh: bool
) -> nn.Module:
    """The user's model, sharded over the ranks: built on the meta device, each rank allocating and
    filling only its shards, from rank 0's build (``fresh``), from ``state`` (whole weights), or
    left for the caller to load (a sharded checkpoint)."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    built = built_on_rank0(cfg.model, cfg.seed, needed=fresh or bool(unsaved_buffers(model)))
    shard(model, cfg, device, warn)
    model.to_empty(device=device)
    copy_from_rank0(model, built, fresh)
    if state is not None:
        load_full(model, state, source)
    return model


def is_sharded(model: nn.Module) -> bool:
    sharded = loaded("torch.distributed.fsdp", "FSDPModule")
    return sharded is not None and isinstance(model, sharded)


def sync_gradients(model: nn.Module, sync: bool) -> None:
    """Whether the sharded ``model``'s next backward reduce-scatters its gradients."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank calls it), or the tensor itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor
