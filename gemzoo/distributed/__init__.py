"""Distributed init through the chosen comms backend, the DeviceMesh, and dense data parallelism."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mesh: object | None = None  # torch DeviceMesh when world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(comms, device_type: str) -> World:
    """Start the process group if launched with several ranks (torchrun sets WORLD_SIZE)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return World()
    comms.install()
    if not dist.is_initialized():
        dist.init_process_group(backend=comms.backend_for(device_type))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), mesh)


def pick_device(name: str, world: World) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            from gemzoo.errors import ConfigError

            raise ConfigError("run.device asks for cuda but no GPU is visible; set run.device = \"cpu\" or \"auto\"")
        if device.index is None:
            device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    return device


def all_reduce_gradients(params, world: World) -> None:
    """Average dense gradients across data-parallel ranks (one flat bucket)."""
    if world.world_size <= 1:
        return
    for p in params:
        if p.grad is not None and p.grad.is_sparse:  # replicated fallback tables: all-reduce densely
            p.grad = p.grad.to_dense()
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= world.world_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def shard_dense_blocks(model, world: World, mode: str):
    """FSDP2 (``fully_shard``) on every transformer block; other dense parameters stay replicated."""
    from gemzoo.errors import ConfigError

    if mode not in ("fsdp", "ddp"):
        raise ConfigError(f"run.dense_parallel must be \"fsdp\" or \"ddp\", got {mode!r}")
    if world.world_size <= 1 or mode == "ddp":
        return model
    from torch.distributed.fsdp import fully_shard

    from gemzoo.interfaces.models import transformer_blocks

    for block in transformer_blocks(model):
        fully_shard(block, mesh=world.mesh)
    return model


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global grad-norm clipping over a mix of plain tensors and FSDP2 DTensors."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in grads:
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = sq + n.to(sq.device) ** 2
    total = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return total
