"""Built-in planner ``torchrec``: torchrec's EmbeddingShardingPlanner + DistributedModelParallel.

Single-process runs keep tables unsharded. Without torchrec (the GPU image has none) the model uses
gemzoo's plain-torch embedding engine and this planner leaves it as it is.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gemzoo.interfaces.planner import Topology
from gemzoo.plugins import hookimpl


class TorchrecPlanner:
    def plan(self, tables: list[Any], topology: Topology) -> Any:
        if topology.world_size == 1 or not tables:
            return None
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner.types import Topology as TRTopology

        planner = EmbeddingShardingPlanner(
            topology=TRTopology(world_size=topology.world_size, compute_device=topology.device_type,
                                local_world_size=topology.local_world_size),
        )
        return planner, tables

    def shard(self, model: nn.Module, plan: Any, mesh: Any) -> nn.Module:
        if plan is None:
            return model
        import torch.distributed as dist
        from torchrec.distributed.model_parallel import DistributedModelParallel

        planner, _ = plan
        sparse = model.sparse_arch  # the EmbeddingBagCollection owner, by convention
        pg = dist.group.WORLD
        sharding_plan = planner.collective_plan(sparse, None, pg)
        model.sparse_arch = DistributedModelParallel(sparse, plan=sharding_plan, device=mesh.device_type
                                                     if hasattr(mesh, "device_type") else None)
        return model


@hookimpl
def gemzoo_register_planners(register):
    register("torchrec", TorchrecPlanner())
