"""Batching policies: reorder or redistribute samples across data-parallel ranks before a step."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class BatchingPolicy(Protocol):
    def assign(self, costs: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        """Split sample indices into ``world_size`` groups; ``costs[i]`` is sample i's work (e.g. L^2)."""
