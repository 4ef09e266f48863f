"""Built-in batching policy ``none``: contiguous split, no rebalancing."""

from __future__ import annotations

import torch

from gemzoo.plugins import hookimpl


class NoBatching:
    def assign(self, costs: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        return list(torch.arange(costs.numel()).tensor_split(world_size))


@hookimpl
def gemzoo_register_batching(register):
    register("none", NoBatching())
