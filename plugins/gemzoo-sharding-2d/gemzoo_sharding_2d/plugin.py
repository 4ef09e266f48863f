"""Registers the planner ``sharding-2d`` (GEM's 2D embedding sharding) and the ``gemzoo plan`` command.

The world of W ranks is a mesh ``{"replica": R, "shard": G}`` (W = G x R; a group is G consecutive ranks, so
G <= 8 keeps the embedding all-to-all on one node's NVLink). Within a group the tables are placed by torchrec's
planner for ``world_size = G`` (``layout.py``) and looked up with an all-to-all inside the group
(``engine.py``); across the R groups:

- ``strategy = "replicated"``: every group holds all tables (tables / G per rank). ``replica_sync =
  "gradients"`` all-reduces the group shard's gradient over the replica group each step (the update is the
  global batch's, as on one process); ``"weights"`` lets each group update on its own data and averages
  weights and Adagrad state over the replica group every ``sync_every`` steps (torchrec's DMPCollection.sync).
- ``strategy = "fully_sharded"``: each replica stores 1/R of its group shard (tables / (G x R) per rank),
  all-gathers it before the forward and reduce-scatters its gradient after the backward.

Options (``[plugins.options.sharding-2d]``, validated by ``Sharding2DOptions``)::

    group_size = 0            # G, ranks a group; 0: gcd(world, 8) (one node of 8 GPUs, or the whole world)
    strategy = "replicated"   # or "fully_sharded"
    replica_sync = "gradients"  # replicated only: "gradients" (exact, every step) or "weights" (every sync_every)
    sync_every = 1            # steps between weight syncs of replica_sync = "weights"
    sharding_types = []       # allowed within a group: table_wise, row_wise, column_wise, data_parallel; [] = all

The tables train with torch's element-wise Adagrad at ``optim.sparse_lr`` (warm-up does not apply to them, as
with torchrec's fused optimizer), applied in ``sync``. Checkpoints hold whole tables and whole accumulators, so
a run resumes under any G x R (or on one process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from gemzoo.api import (
    CheckpointError,
    ConfigError,
    PluginError,
    SparseOptimizer,
    TakesOptions,
    Topology,
    bounded,
    hookimpl,
)
from gemzoo_sharding_2d.engine import Groups, ShardedTables
from gemzoo_sharding_2d.layout import Layout, check_sharding_types, plan_layout

GEMZOO_API = ">=1,<2"

WHERE = "plugins.options.sharding-2d"
STRATEGIES = ("replicated", "fully_sharded")
REPLICA_SYNCS = ("gradients", "weights")
STATE_SUFFIX = "/sum"  # planner state keys: "<table weight name>/sum", torch Adagrad's state name


@dataclass
class Sharding2DOptions:
    group_size: int = bounded(0, min=0)  # G, ranks a sharding group (world = G x replicas); 0: gcd(world, 8)
    strategy: str = bounded("replicated", choices=STRATEGIES)  # replicated: tables / G a rank; fully_sharded: / (G x R)
    replica_sync: str = bounded("gradients", choices=REPLICA_SYNCS)  # replicated: exact gradient all-reduce, or weights
    sync_every: int = bounded(1, min=1)  # steps between weight + Adagrad averages (replica_sync = "weights")
    sharding_types: list[str] = field(default_factory=list)  # allowed within a group; [] = all four
    # a checkpoint holds whole tables and accumulators, so a resume may change any of these (resharding)
    layout_fields: ClassVar[tuple[str, ...]] = ("group_size", "strategy", "replica_sync", "sync_every",
                                                "sharding_types")

    def __post_init__(self):
        if type(self.group_size) is not int or self.group_size < 0:
            raise ConfigError(f"{WHERE}.group_size must be an integer >= 0 (0: gcd(world, 8)), got {self.group_size!r}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"{WHERE}.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.replica_sync not in REPLICA_SYNCS:
            raise ConfigError(f"{WHERE}.replica_sync must be one of {', '.join(REPLICA_SYNCS)}, "
                              f"got {self.replica_sync!r}")
        if type(self.sync_every) is not int or self.sync_every < 1:
            raise ConfigError(f"{WHERE}.sync_every must be an integer >= 1, got {self.sync_every!r}")
        if self.sync_every > 1 and (self.strategy != "replicated" or self.replica_sync != "weights"):
            raise ConfigError(f"{WHERE}.sync_every = {self.sync_every} needs strategy = \"replicated\" and "
                              f"replica_sync = \"weights\" (got {self.strategy!r}, {self.replica_sync!r}): only "
                              "weight averaging can skip steps")
        self.sharding_types = check_sharding_types(self.sharding_types, f"{WHERE}.sharding_types")


def group_size_for(options: Sharding2DOptions, world: int) -> int:
    """G for a world of ``world`` ranks; ConfigError naming both when G does not divide it."""
    g = options.group_size or math.gcd(world, 8)
    if world % g:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(f"{WHERE}.group_size = {g} does not divide the world of {world} ranks; choose one of "
                          f"{divisors[:12]}{' ...' if len(divisors) > 12 else ''} (world = group_size x replicas)")
    return g


def sharded_tables(model: nn.Module) -> list[ShardedTables]:
    return [m for m in model.modules() if isinstance(m, ShardedTables)]


def _weight_prefix(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules() if isinstance(m, ShardedTables)}


class Sharding2D(TakesOptions):
    """2D embedding sharding: tables sharded within groups of G ranks, replicated or fully sharded across."""

    options_cls = Sharding2DOptions
    description = "2D embedding sharding: tables sharded within groups of G ranks, replicated/fully sharded across"

    def mesh_dims(self, topology: Topology) -> dict[str, int]:
        g = group_size_for(self.options, topology.world_size)
        return {"replica": topology.world_size // g, "shard": g}

    def plan(self, tables: list[Any], topology: Topology) -> Layout | None:
        g = group_size_for(self.options, topology.world_size)
        if not tables:
            return None
        return plan_layout(tables, g, topology.world_size // g, self.options.strategy, self.options.sharding_types,
                           topology.device_type)

    def attach_optimizer(self, model: nn.Module, plan: Layout | None, optimizer: SparseOptimizer) -> None:
        if plan is None:
            return
        if optimizer.name != "adagrad":
            raise PluginError(f"planner 'sharding-2d' trains its tables with adagrad, not {optimizer.name!r}")
        plan.lr = optimizer.lr

    def shard(self, model: nn.Module, plan: Layout | None, mesh: Any) -> nn.Module:
        if plan is None:
            return model
        arch = getattr(model, "sparse_arch", None)
        ebc = getattr(arch, "ebc", None)
        bags = getattr(ebc, "embedding_bags", None)
        if bags is None:
            raise PluginError("planner 'sharding-2d' needs model.sparse_arch.ebc.embedding_bags (gemzoo's SparseArch, "
                              "either engine)")
        lost = [t for t in plan.tables if t not in bags]
        if lost:
            raise PluginError(f"planner 'sharding-2d': the plan has tables {lost} the model lacks "
                              f"(it has {list(bags)})")
        for t, spec in plan.tables.items():
            shape = tuple(bags[t].weight.shape)
            if shape != (spec.num_embeddings, spec.embedding_dim):
                raise PluginError(f"planner 'sharding-2d': table {t!r} is {list(shape)} in the model but "
                                  f"{[spec.num_embeddings, spec.embedding_dim]} in the plan")
        if plan.lr is None:
            raise PluginError("planner 'sharding-2d': call attach_optimizer(model, plan, SparseOptimizer(lr=...)) "
                              "before shard")
        if mesh is not None:
            dims = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=False))
            if dims.get("shard") != plan.group_size or dims.get("replica") != plan.replicas:
                raise ConfigError(f"planner 'sharding-2d' planned groups of {plan.group_size} x {plan.replicas} "
                                  f"replicas but the mesh is {dims}; build it from mesh_dims()")
        groups = Groups(mesh, plan.group_size, plan.replicas) if mesh is not None else Groups()
        if mesh is None and plan.group_size * plan.replicas > 1:
            raise ConfigError(f"planner 'sharding-2d' planned {plan.group_size} x {plan.replicas} ranks but got no "
                              "mesh (one process)")
        weights = {t: bags[t].weight.detach() for t in plan.tables}
        arch.ebc = ShardedTables(plan, weights, groups, arch.feature_names)
        arch.engine = "torch"  # SparseArch then calls ebc(keys, values, lengths)
        arch.sharding_2d = plan.summary()
        self._lr = plan.lr
        return model

    def replicated_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        from gemzoo.api import whole_parameters

        own = {id(m.flat) for m in sharded_tables(model)}
        return [p for p in whole_parameters(model) if id(p) not in own]

    def sync(self, model: nn.Module, step: int) -> None:
        o = self.options
        for m in sharded_tables(model):
            m.step(step, m.layout.lr, o.replica_sync, o.sync_every)

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Whole Adagrad accumulators ``<prefix>.embedding_bags.<table>.weight/sum`` on rank 0."""
        out = {}
        prefix = _weight_prefix(model)
        for m in sharded_tables(model):
            whole = m.gather_whole(m.views(m.state_sum))
            out.update({f"{prefix[id(m)]}.embedding_bags.{t}.weight{STATE_SUFFIX}": v for t, v in whole.items()})
        return out

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
        missing, known = [], set()
        prefix = _weight_prefix(model)
        for m in sharded_tables(model):
            head = f"{prefix[id(m)]}.embedding_bags."
            names = {f"{head}{t}.weight{STATE_SUFFIX}": t for t in m.views(m.state_sum)}
            known |= set(names)
            whole = {names[k]: v for k, v in state.items() if k in names}
            lacking = m.load_pieces(m.state_sum, whole, "the Adagrad state")
            missing += [f"{head}{t}.weight{STATE_SUFFIX}" for t in lacking]
        extra = sorted(k for k in state if k.endswith(STATE_SUFFIX) and k not in known)
        if extra:
            raise CheckpointError(f"the checkpoint has Adagrad state for tables this model lacks: {extra[:5]}; "
                                  f"this model's are {sorted(known)[:5]}")
        return missing

    # ---- what the tests and `gemzoo plan` read ----------------------------------------------------------------
    @staticmethod
    def memory(model: nn.Module) -> dict:
        """Bytes of table storage on this rank (summed over the model's sharded collections)."""
        out: dict[str, int] = {}
        for m in sharded_tables(model):
            for k, v in m.memory().items():
                out[k] = out.get(k, 0) + v
        return out

    @staticmethod
    def comm_bytes(model: nn.Module) -> dict:
        """Cumulative bytes this rank handed to each kind of collective (see engine.CommCounter)."""
        out = {"bytes": {}, "offrank": {}, "calls": {}}
        for m in sharded_tables(model):
            for part, values in m.counter.snapshot().items():
                for k, v in values.items():
                    out[part][k] = out[part].get(k, 0) + v
        return out

    def __repr__(self) -> str:
        return f"Sharding2D({self.options})"


@hookimpl
def gemzoo_register_planners(register):
    register("sharding-2d", Sharding2D())


@hookimpl
def gemzoo_register_commands(cli):
    from gemzoo_sharding_2d.scale import add_command

    add_command(cli)
