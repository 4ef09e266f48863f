"""Distributed init through the chosen comms backend, the N-D DeviceMesh, and dense data parallelism.

The mesh: the planner names the dims it places tables over (``Planner.mesh_dims``: ``{"dp": W}`` for 1D
sharding, ``{"replica": R, "shard": G}`` for 2D); :func:`build_mesh` makes one DeviceMesh with exactly those
dims and the dense data-parallel dim ``dp`` spanning all of them (flattened when there are several).
With ``run.mesh`` (``dense``: ``{"replicate": R, "shard": S, "tp": T}``) it also builds the dense mesh
``(replicate, shard, tp)`` for HSDP and tensor parallelism (``distributed/dense.py``), and ``dp`` is its
``replicate x shard``. ``distributed/state.py`` turns sharded state into whole tensors for checkpoints and back.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gemzoo.distributed.comms_groups import init_mesh
from gemzoo.distributed.dense import shard_dense
from gemzoo.errors import ConfigError
from gemzoo.interfaces.batching import DataParallelGroup
from gemzoo.interfaces.comms import dim_backends
from gemzoo.interfaces.models import transformer_blocks

DENSE_DIMS = ("dp",)  # the flattened dense data-parallel dim, spanning the planner's dims
LAYOUT_DIMS = ("replicate", "shard", "tp")  # run.mesh: the dense mesh (distributed/dense.py)


@dataclass
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mesh: object | None = None  # the N-D DeviceMesh with the planner's dims when world_size > 1
    dp_mesh: object | None = None  # the 1-D "dp" mesh of the ranks that load different samples (FSDP2, batching)
    dense_mesh: object | None = None  # run.mesh: the (replicate, shard, tp) mesh of HSDP + tensor parallelism
    # the process group for numbers the host holds (loss terms, a stop request): gloo, so reducing them never
    # waits for the GPU's queue; None: the default group, which runs CPU tensors itself
    host_group: object | None = None
    # this rank's dp ranks (dp_mesh's order) over a group that runs CPU tensors, for moving samples between them
    # on the host (gemzoo.data.exchange.Lookahead); built by build_mesh with a comms backend; None: not built
    dp_host: object | None = None  # gemzoo.interfaces.batching.DataParallelGroup

    @property
    def copies(self) -> int:
        """How many ranks train each sample: the tp degree (1 without tensor parallelism)."""
        return self.world_size // self.dp_mesh.size() if self.dp_mesh is not None else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


NO_GPU = "run.device asks for cuda but no GPU is visible; set run.device = \"cpu\" or \"auto\""


def init_distributed(comms, device_type: str) -> World:
    """Start the process group if launched with several ranks (torchrun sets WORLD_SIZE); no mesh yet. A cuda
    run on a machine without a visible GPU is refused before the group starts (NCCL would fail on every rank)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(NO_GPU)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return World()
    comms.install()
    if not dist.is_initialized():
        dist.init_process_group(backend=comms.backend_for(device_type))
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                 host_group=host_group_for(comms))


def host_group_for(comms, *, force: bool = False):
    """A process group over every rank for numbers the host holds: None when the default group already runs CPU
    tensors on the comms backend's CPU transport (``comms.backend_for("cpu")``), else a new group on that
    transport (``force``: one anyway), so reducing them never waits behind the GPU's queue. Every rank must
    call it, in the same order of group creation."""
    cpu = comms.backend_for("cpu")
    if not force and cpu_backend(str(dist.get_backend())) == cpu:
        return None
    return dist.new_group(backend=cpu)


def cpu_backend(backend: str) -> str:
    """The backend that runs CPU tensors in a group of ``backend``: a plain name is itself; a device map such as
    ``"cpu:B1,cuda:B2"`` gives its ``cpu`` entry (the whole string when it has none)."""
    if ":" not in backend:
        return backend
    devices = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return devices.get("cpu", backend)


def check_mesh_dims(dims: dict[str, int], world_size: int, who: str = "the planner") -> dict[str, int]:
    """``dims`` as a clean ``{name: size}``; ConfigError naming the values when they do not fit the world."""
    if not isinstance(dims, dict) or not dims:
        raise ConfigError(f"{who} asks for mesh dims {dims!r}: give a non-empty {{name: size}}, e.g. "
                          f"{{'dp': {world_size}}}")
    for name, size in dims.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{who} asks for a mesh dim named {name!r}: names are identifiers such as 'shard'")
        if type(size) is not int or size < 1:
            raise ConfigError(f"{who} asks for mesh dim {name}={size!r}: sizes are positive integers")
    if math.prod(dims.values()) != world_size:
        shape = " x ".join(f"{n}={s}" for n, s in dims.items())
        raise ConfigError(f"{who} asks for the mesh {shape} = {math.prod(dims.values())} ranks, but the world has "
                          f"{world_size}; launch {math.prod(dims.values())} ranks or change its options")
    if any(n in DENSE_DIMS for n in dims) and len(dims) > 1:
        raise ConfigError(f"{who} asks for mesh dims {list(dims)}: {', '.join(DENSE_DIMS)} is the dense dim that "
                          "spans the planner's dims; rename the planner's own")
    return dict(dims)


def build_mesh(world: World, device_type: str, dims: dict[str, int], dense: dict[str, int] | None = None, *,
               comms=None) -> World:
    """Give ``world`` its DeviceMesh: dims ``dims`` (the planner's, outermost first) plus the dense dims of
    ``dense``: ``{"dp": world_size}`` (the default: data parallelism over every rank, spanning the planner's
    dims), or ``run.mesh``'s ``{"replicate": R, "shard": S, "tp": T}`` (``dense.dense_dims``), which builds
    ``world.dense_mesh`` beside the planner's mesh, and ``dp`` is its ``replicate x shard``. ``comms``: the comms
    backend, whose ``backend_for_dim`` may give dims their own groups (``comms_groups.init_mesh``). One process:
    the dims are checked and no mesh is built (the planner's ``shard`` gets ``None``)."""
    dims = check_mesh_dims(dims, world.world_size)
    dense = {"dp": world.world_size} if dense is None else dict(dense)
    layout = tuple(dense) != ("dp",)
    if layout and sorted(dense) != sorted(LAYOUT_DIMS):
        raise ConfigError(f"dense mesh dims {dense} are not supported: give {{'dp': {world.world_size}}} (data "
                          "parallelism over every rank) or all of replicate, shard and tp (HSDP and tensor "
                          "parallelism, from run.mesh)")
    if not layout and dense["dp"] != world.world_size:
        raise ConfigError(f"dense mesh dims {dense}: dp spans the whole world (dp={world.world_size})")
    if layout:
        check_mesh_dims({n: dense[n] for n in LAYOUT_DIMS}, world.world_size, who="run.mesh")
    if world.world_size <= 1:
        return world

    world.mesh = init_mesh(comms, device_type, tuple(dims.values()), tuple(dims))
    backend = dim_backends(comms, ("dp",), device_type).get("dp")
    if layout:
        world.dense_mesh = init_mesh(comms, device_type, tuple(dense[n] for n in LAYOUT_DIMS), LAYOUT_DIMS)
        world.dp_mesh = world.dense_mesh["replicate", "shard"]._flatten("dp", backend_override=backend)
    elif tuple(dims) == ("dp",):
        world.dp_mesh = world.mesh
    else:  # kept here rather than sliced from the root again (deprecated since torch 2.11)
        world.dp_mesh = world.mesh[tuple(dims)]._flatten("dp", backend_override=backend)
    if comms is not None:
        world.dp_host = DataParallelGroup(world.dp_mesh.get_local_rank(), world.dp_mesh.size(),
                                          dp_host_group(world, comms))
    return world


def dp_host_group(world: World, comms, *, force: bool = False):
    """A group of ``world.dp_mesh``'s ranks, in its order, that runs CPU tensors on the comms backend's CPU
    transport (None: the default group): the dp group itself when it does; the host group when dp spans every
    rank in rank order; else (tensor parallelism: one dp group per tp index) new groups on that transport, one per
    tp index (``force``: those even when the dp group runs CPU tensors). Every rank calls it, in the same order."""
    cpu = comms.backend_for("cpu")
    group = world.dp_mesh.get_group()
    if not force and cpu_backend(str(dist.get_backend(group))) == cpu:
        return group
    if not force and world.dp_mesh.size() == world.world_size and world.dp_mesh.get_local_rank() == world.rank:
        return world.host_group
    if world.dense_mesh is None:  # dp spans every planner dim, flattened in rank order
        return dist.new_group(backend=cpu) if force else world.host_group
    ranks = world.dense_mesh.mesh  # (replicate, shard, tp): dp is replicate x shard, one group per tp index
    mine, _ = dist.new_subgroups_by_enumeration(ranks.permute(2, 0, 1).reshape(ranks.shape[2], -1).tolist(),
                                                backend=cpu)
    return mine


def pick_device(name: str, world: World) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(NO_GPU)
        if device.index is None:
            visible = torch.cuda.device_count()
            if world.local_rank >= visible:
                raise ConfigError(f"rank {world.rank} has LOCAL_RANK {world.local_rank} but this node shows {visible} "
                                  f"GPU(s); start at most {visible} processes per node (torchrun --nproc-per-node "
                                  f"{visible}) or train on CPU with run.device = \"cpu\"")
            device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    return device


def is_fsdp_shard(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def all_reduce_gradients(params, world: World) -> None:
    """Average the gradients of replicated parameters over the ``dp`` ranks (one flat bucket)."""
    if world.world_size <= 1:
        return
    for p in params:
        if p.grad is not None and p.grad.is_sparse:  # replicated fallback tables: all-reduce densely
            p.grad = p.grad.to_dense()
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    dp = world.dp_mesh.size() if world.dp_mesh is not None else world.world_size
    if dp <= 1:  # tensor parallelism only: every rank saw the same samples
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=world.dp_mesh.get_group() if world.dp_mesh is not None else None)
    flat /= dp
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def shard_dense_blocks(model, world: World, mode: str):
    """FSDP2 (``fully_shard``) on every transformer block; other dense parameters stay replicated. With
    ``run.mesh`` (``world.dense_mesh``): tensor parallelism and HSDP on the blocks (``dense.shard_dense``)."""
    if mode not in ("fsdp", "ddp"):
        raise ConfigError(f"run.dense_parallel must be \"fsdp\" or \"ddp\", got {mode!r}")
    if world.dense_mesh is not None:
        return shard_dense(model, world)
    if world.world_size <= 1 or mode == "ddp":
        return model
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(model):
        fully_shard(block, mesh=world.dp_mesh)
    return model


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global grad-norm clipping over a mix of plain tensors and FSDP2 DTensors. Plain CUDA gradients take
    torch's foreach kernels (a handful of launches instead of three per parameter); CPU keeps the per-tensor
    loop, so CPU runs stay bit-exact with earlier ones."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)

    def fusable(g):
        return g.is_cuda and not isinstance(g, DTensor)

    fused, rest = [g for g in grads if fusable(g)], [g for g in grads if not fusable(g)]
    if fused:
        sq = sq + torch.stack(torch._foreach_norm(fused, 2, dtype=torch.float32)).square().sum()
    for g in rest:
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = sq + n.to(sq.device) ** 2
    total = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=not rest)
    return total
