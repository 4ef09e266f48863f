"""Embedding sharding planners (wrapping torchrec's planner).

A planner owns everything about where the embedding tables live, so a new layout (2D sharding) touches no
core file. The trainer calls, in assembly step 7 and then each step:

    dims  = planner.mesh_dims(topology)                 # the mesh it shards over, e.g. {"replica": 2, "shard": 4}
    mesh  = gemzoo.distributed.build_mesh(...)          # one N-D DeviceMesh with those dims (+ the dense "dp")
    plan  = planner.plan(model.embedding_tables(), topology)
    planner.attach_optimizer(model, plan, SparseOptimizer(lr=...))   # before shard: fused into the tables
    model = planner.shard(model, plan, mesh)
    whole = planner.replicated_parameters(model)        # full copies on every rank: gradients averaged over dp
    ...   loss.backward(); optimizers step; planner.sync(model, step)   # e.g. replica groups average
    ckpt: planner.state_dict(model) / planner.load_state_dict(model, state)   # its own distributed state

:class:`WholeTables` implements the whole protocol for a planner that keeps every table whole on every
rank; subclass it and override what differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class Topology:
    """What a planner plans for: the number of ranks and their device type."""

    world_size: int
    device_type: str  # "cpu" or "cuda"


@dataclass(frozen=True)
class SparseOptimizer:
    """The optimizer the embedding tables train with (fbgemm's fused TBEs implement row-wise Adagrad)."""

    lr: float
    name: str = "adagrad"


@runtime_checkable
class Planner(Protocol):
    def mesh_dims(self, topology: Topology) -> dict[str, int]:
        """The mesh dimensions the tables are placed over, outermost first, as ``{name: size}`` whose sizes
        multiply to ``topology.world_size``: ``{"dp": world}`` to shard over every rank (torchrec's 1D sharding),
        ``{"replica": R, "shard": G}`` for 2D sharding (tables sharded within each group of G ranks, the R groups
        replicating each other). ``gemzoo.distributed.build_mesh`` builds one DeviceMesh with these dims; the
        dense data-parallel dim ``dp`` spans all of them. Bad sizes for the world: a ConfigError naming them."""

    def plan(self, tables: list[Any], topology: Topology) -> Any:
        """A sharding plan for embedding ``tables`` (``model.embedding_tables()``: gemzoo TableConfigs, which
        ``to_torchrec()`` turns into torchrec's EmbeddingBagConfig), or ``None`` to keep every table whole on
        every rank."""

    def attach_optimizer(self, model: nn.Module, plan: Any, optimizer: SparseOptimizer) -> None:
        """Before ``shard``: fuse ``optimizer`` into the tables ``plan`` places, so their update runs inside
        their own backward (torchrec: ``apply_optimizer_in_backward``, which DMP turns into fbgemm's fused
        TBE update). Tables left in :meth:`replicated_parameters` train with the trainer's own Adagrad."""

    def shard(self, model: nn.Module, plan: Any, mesh: Any) -> nn.Module:
        """Return ``model`` with its embedding tables placed according to ``plan`` over ``mesh`` (the
        DeviceMesh with the dims of :meth:`mesh_dims`; ``None`` on one process). The model's state-dict names
        stay the same; sharded tables appear in it as ShardedTensors or DTensors."""

    def replicated_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """After ``shard`` (and FSDP on the dense blocks): the trainable parameters every rank holds a whole
        copy of and the trainer optimizes. The trainer averages their gradients over the ``dp`` dim each step.
        Everything else is either an FSDP shard or the planner's own (sharded tables, fused optimizer)."""

    def sync(self, model: nn.Module, step: int) -> None:
        """After the optimizer step of ``step`` (0-based): synchronise what the planner keeps in several
        copies across replica groups, e.g. average table weights and their optimizer state over each replica
        group every ``sync_every`` steps (what torchrec's ``DMPCollection.sync()`` does). Nothing for 1D."""

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The planner's own distributed state beyond ``model.state_dict()`` (e.g. the fused optimizer's
        accumulators of its sharded tables), as whole tensors keyed by stable names, on rank 0; ``{}`` on the
        other ranks. Collective: every rank calls it. Whole tensors let a checkpoint resume under another layout."""

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
        """Load whole tensors written by :meth:`state_dict` (under any layout) into this rank's part of that
        state; return the names this model has and ``state`` lacks (their state restarts from zero)."""


def is_local_tensor(p: torch.Tensor) -> bool:
    """A plain tensor held whole by this rank (not a ShardedTensor/DTensor, nor one with a fused optimizer)."""
    return type(p.data) is torch.Tensor and not hasattr(p, "_in_backward_optimizers")


def whole_parameters(model) -> list:
    """The trainable parameters this rank holds whole and updates itself (what ``Planner.replicated_parameters``
    returns when a planner's tables are plain tensors or carry a fused optimizer)."""
    return [p for p in model.parameters() if p.requires_grad and is_local_tensor(p)]


class WholeTables:
    """A planner that keeps every table whole on every rank (plan ``None``): the tables train with the
    trainer's Adagrad and their gradients are averaged over ``dp`` like any replicated parameter. The base of
    planners that override only what they place differently."""

    def mesh_dims(self, topology: Topology) -> dict[str, int]:
        return {"dp": topology.world_size}

    def plan(self, tables: list[Any], topology: Topology) -> Any:
        return None

    def attach_optimizer(self, model: nn.Module, plan: Any, optimizer: SparseOptimizer) -> None:
        return None

    def shard(self, model: nn.Module, plan: Any, mesh: Any) -> nn.Module:
        return model

    def replicated_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return whole_parameters(model)

    def sync(self, model: nn.Module, step: int) -> None:
        return None

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
        return []
