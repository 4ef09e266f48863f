"""Where every table lives inside one group of G ranks: torchrec's planner for ``world_size = G``, else a small
fallback.

The trap to avoid: a 2D layout must be planned for the *group*, not the world. A plan made for
the world places shards on ranks G..W-1 that no group has. So ``plan_layout`` always asks torchrec's
``EmbeddingShardingPlanner`` for a topology of G ranks and reads its shard metadata (offsets, sizes, the group
rank of each shard) into :class:`Block` s, one per shard: a table-wise table is one block, a row-wise one G
blocks of rows, a column-wise one blocks of columns. A data-parallel table has no blocks: every rank keeps it
whole. The executor (``engine.py``) needs only the blocks, so it runs the same with torchrec or without it.

Without torchrec (the GPU image) the fallback planner gives row-wise tables (``torch.chunk`` rows over the G
ranks) when ``row_wise`` is allowed, else table-wise ones (largest first onto the least loaded rank), else
data-parallel ones.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field

import torch

from gemzoo.api import ConfigError

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")


@dataclass(frozen=True)
class Block:
    """One shard of a table inside a group: rows [row_off, row_off + rows) x cols [col_off, col_off + cols),
    stored by group rank ``rank``."""

    table: str
    rank: int
    row_off: int
    rows: int
    col_off: int
    cols: int


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str = "sum"

    @property
    def numel(self) -> int:
        return self.num_embeddings * self.embedding_dim


@dataclass
class Layout:
    """The plan of ``sharding-2d``: G ranks a group, R groups, each table's blocks within a group."""

    group_size: int
    replicas: int
    strategy: str
    tables: dict[str, TableSpec]
    blocks: dict[str, list[Block]]  # [] for a data-parallel table
    sharding_types: dict[str, str]
    planned_by: str  # "torchrec" or "gemzoo"
    lr: float | None = None  # the tables' Adagrad, set by attach_optimizer
    extra: dict = field(default_factory=dict)

    def local_blocks(self, group_rank: int) -> list[Block]:
        return [b for t in self.tables for b in self.blocks[t] if b.rank == group_rank]

    def data_parallel(self) -> list[str]:
        return [t for t in self.tables if not self.blocks[t]]

    def summary(self) -> dict:
        return {"group_size": self.group_size, "replicas": self.replicas, "strategy": self.strategy,
                "planned_by": self.planned_by, "sharding_types": dict(self.sharding_types)}


def table_specs(tables) -> dict[str, TableSpec]:
    """gemzoo TableConfigs or torchrec EmbeddingBagConfigs -> {name: TableSpec}."""
    out = {}
    for t in tables:
        pooling = getattr(t, "pooling", "sum")
        pooling = getattr(pooling, "name", pooling)
        out[t.name] = TableSpec(t.name, int(t.num_embeddings), int(t.embedding_dim), tuple(t.feature_names),
                                str(pooling).lower())
    return out


def _torchrec_blocks(specs: dict[str, TableSpec], group_size: int, allowed: list[str], device_type: str):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.planner.types import Topology as TRTopology

    class AnyTypeSharder(EmbeddingBagCollectionSharder):
        """torchrec offers row-wise only on CUDA; the executor here runs every type on any device."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            return list(allowed)

    configs = [EmbeddingBagConfig(name=s.name, num_embeddings=s.num_embeddings, embedding_dim=s.embedding_dim,
                                  feature_names=list(s.feature_names), pooling=PoolingType[s.pooling.upper()])
               for s in specs.values()]
    with torch.device("cpu"):
        meta = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    constraints = {c.name: ParameterConstraints(sharding_types=list(allowed)) for c in configs}
    quiet = [logging.getLogger(n) for n in ("torchrec.distributed.planner.types",
                                             "torchrec.distributed.planner.storage_reservations")]
    levels = [q.level for q in quiet]
    for q in quiet:  # its notices about dry runs and TopologyFactory, on every plan
        q.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            planner = EmbeddingShardingPlanner(topology=TRTopology(world_size=group_size, compute_device=device_type),
                                               constraints=constraints)
            plan = planner.plan(meta, [AnyTypeSharder()])
    finally:
        for q, level in zip(quiet, levels, strict=False):
            q.setLevel(level)
    blocks, types = {}, {}
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():
            types[name] = ps.sharding_type
            if ps.sharding_type == "data_parallel" or ps.sharding_spec is None:
                blocks[name] = []
                continue
            blocks[name] = [Block(name, int(str(m.placement).split(":")[1].split("/")[0]), int(m.shard_offsets[0]),
                                  int(m.shard_sizes[0]), int(m.shard_offsets[1]), int(m.shard_sizes[1]))
                            for m in ps.sharding_spec.shards]
    return blocks, types


def _fallback_blocks(specs: dict[str, TableSpec], group_size: int, allowed: list[str]):
    blocks, types, load = {}, {}, [0] * group_size
    kind = next(t for t in ("row_wise", "table_wise", "column_wise", "data_parallel") if t in allowed)
    for spec in sorted(specs.values(), key=lambda s: -s.numel):
        types[spec.name] = kind
        if kind == "data_parallel":
            blocks[spec.name] = []
        elif kind == "table_wise":
            rank = load.index(min(load))
            load[rank] += spec.numel
            blocks[spec.name] = [Block(spec.name, rank, 0, spec.num_embeddings, 0, spec.embedding_dim)]
        elif kind == "row_wise":
            step = math.ceil(spec.num_embeddings / group_size)
            blocks[spec.name] = [Block(spec.name, g, g * step, max(0, min(spec.num_embeddings - g * step, step)),
                                       0, spec.embedding_dim) for g in range(group_size)]
        else:  # column_wise: equal column blocks when the width divides, else one block per table
            parts = group_size if spec.embedding_dim % group_size == 0 else 1
            width = spec.embedding_dim // parts
            blocks[spec.name] = [Block(spec.name, (g + load.index(min(load))) % group_size, 0, spec.num_embeddings,
                                       g * width, width) for g in range(parts)]
            load[blocks[spec.name][0].rank] += spec.numel
    return {n: blocks[n] for n in specs}, {n: types[n] for n in specs}


def check_sharding_types(types, where: str) -> list[str]:
    types = list(types)
    bad = [t for t in types if t not in SHARDING_TYPES]
    if bad:
        raise ConfigError(f"{where} has {bad}; the sharding types within a group are {', '.join(SHARDING_TYPES)}")
    return types or list(SHARDING_TYPES)


def plan_layout(tables, group_size: int, replicas: int, strategy: str = "replicated", sharding_types=(),
                device_type: str = "cpu", use_torchrec: bool | None = None) -> Layout:
    """The blocks of every table within a group of ``group_size`` ranks (torchrec's planner for world_size =
    group_size when ``use_torchrec``, default: when it imports)."""
    specs = table_specs(tables)
    allowed = check_sharding_types(sharding_types, "plugins.options.sharding-2d.sharding_types")
    if use_torchrec is None:
        from gemzoo.api import torchrec_available

        use_torchrec = torchrec_available()
    if group_size == 1:
        blocks = {n: [Block(n, 0, 0, s.num_embeddings, 0, s.embedding_dim)] for n, s in specs.items()}
        types = {n: ("data_parallel" if allowed == ["data_parallel"] else "table_wise") for n in specs}
        if allowed == ["data_parallel"]:
            blocks = {n: [] for n in specs}
        return Layout(1, replicas, strategy, specs, blocks, types, "gemzoo")
    if use_torchrec:
        blocks, types = _torchrec_blocks(specs, group_size, allowed, device_type)
        by = "torchrec"
    else:
        blocks, types = _fallback_blocks(specs, group_size, allowed)
        by = "gemzoo"
    for name, bs in blocks.items():
        bad = [b for b in bs if not 0 <= b.rank < group_size]
        if bad:  # a plan for more ranks than the group has (module docstring)
            raise ConfigError(f"table {name!r} was planned onto group rank {bad[0].rank}, but a group has "
                              f"{group_size} ranks")
    return Layout(group_size, replicas, strategy, specs, blocks, types, by)
