"""Built-in batching policy ``none``: each rank trains the contiguous part of the global batch it loaded."""

from __future__ import annotations

import torch

from gemzoo.plugins import hookimpl


class NoBatching:
    """No rebalancing: rank r keeps samples ``shard_range(N, r, W)`` (``torch.tensor_split``'s split)."""

    def assign(self, costs: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        return list(torch.arange(costs.numel()).tensor_split(world_size))

    def rebalance(self, batch, costs, dp):
        """Its assignment is the part each rank loaded (gemzoo.data.exchange.shard_range): nothing moves."""
        return batch


@hookimpl
def gemzoo_register_batching(register):
    register("none", NoBatching())
