"""Embedding sharding planners (wrapping torchrec's planner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import nn


@dataclass(frozen=True)
class Topology:
    world_size: int
    device_type: str  # "cpu" or "cuda"
    local_world_size: int | None = None
    hbm_bytes: int | None = None


@runtime_checkable
class Planner(Protocol):
    def plan(self, tables: list[Any], topology: Topology) -> Any:
        """Return a sharding plan for embedding ``tables`` (torchrec EmbeddingBagConfig list)."""

    def shard(self, model: nn.Module, plan: Any, mesh: Any) -> nn.Module:
        """Return ``model`` with its embedding tables sharded according to ``plan``."""
