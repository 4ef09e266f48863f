"""A toy planner and a toy batching policy, registered like a third-party plugin (tests/test_conformance_toys.py
installs them from a fake distribution) to show that a new entry of a kind touches only its plugin and that
the conformance suites pick it up."""

from __future__ import annotations

import torch

import gemzoo
from gemzoo.errors import PluginError
from gemzoo.interfaces.planner import Topology


class LongestFirstBatching:
    """Greedy longest-processing-time: samples by decreasing cost (ties by index), each to the least-loaded rank
    (ties to the lowest rank); each rank's samples in index order."""

    def assign(self, costs: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        costs = costs.detach().double().cpu()
        order = sorted(range(costs.numel()), key=lambda i: (-float(costs[i]), i))
        loads, groups = [0.0] * world_size, [[] for _ in range(world_size)]
        for i in order:
            r = min(range(world_size), key=lambda r: (loads[r], r))
            loads[r] += float(costs[i])
            groups[r].append(i)
        return [torch.tensor(sorted(g), dtype=torch.long) for g in groups]


class ReplicatePlanner:
    """Every rank keeps every table whole (data-parallel tables: the trainer averages their gradients).

    ``plan`` names the tables; ``shard`` checks the model holds them and leaves it as it is. The plan is ``None``
    when there is nothing to place, as the trainer still treats any other plan as torchrec's (issue #9 item 2)."""

    def plan(self, tables: list, topology: Topology):
        names = [getattr(t, "name", None) for t in tables]
        if any(not n for n in names):
            raise PluginError("planner 'toy-replicate' needs tables with names")
        return None if topology.world_size == 1 or not names else {"replicate": names}

    def shard(self, model, plan, mesh):
        if plan is not None:
            have = {getattr(t, "name", None) for t in model.embedding_tables()}
            lost = [n for n in plan["replicate"] if n not in have]
            if lost:
                raise PluginError(f"planner 'toy-replicate': the model has no tables {lost}")
        return model


@gemzoo.hookimpl
def gemzoo_register_batching(register):
    register("toy-lpt", LongestFirstBatching())


@gemzoo.hookimpl
def gemzoo_register_planners(register):
    register("toy-replicate", ReplicatePlanner())
