"""Built-in planner ``torchrec``: torchrec's EmbeddingShardingPlanner + DistributedModelParallel.

Single-process runs keep the tables unsharded. Without torchrec (the GPU image has none) the model
uses gemzoo's plain-torch embedding engine and this planner leaves it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gemzoo.errors import PluginError
from gemzoo.interfaces.planner import Topology
from gemzoo.plugins import hookimpl

CPU_SHARDING_TYPES = ("table_wise", "column_wise", "data_parallel")  # row-wise is CUDA-only in torchrec


def _sharders(device_type: str):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    if device_type == "cuda":
        return [EmbeddingBagCollectionSharder()]

    class CPUEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [t for t in super().sharding_types(compute_device_type) if t in CPU_SHARDING_TYPES]

    return [CPUEmbeddingBagCollectionSharder()]


@dataclass
class TorchrecPlannerOptions:
    sharding_types: list[str] = field(default_factory=list)  # restrict every table, e.g. ["table_wise"]


class TorchrecPlanner:
    """``plan`` runs torchrec's planner on a meta copy of the tables; ``shard`` wraps the EBC in DMP."""

    options_cls = TorchrecPlannerOptions

    def __init__(self, options: TorchrecPlannerOptions | None = None):
        self.options = options or TorchrecPlannerOptions()

    def configure(self, options: TorchrecPlannerOptions) -> "TorchrecPlanner":
        return TorchrecPlanner(options)

    def plan(self, tables: list[Any], topology: Topology) -> Any:
        if topology.world_size == 1 or not tables:
            return None
        from torchrec import EmbeddingBagCollection
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner.types import Topology as TRTopology

        configs = [t.to_torchrec() if hasattr(t, "to_torchrec") else t for t in tables]
        meta_ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        kwargs = {"world_size": topology.world_size, "compute_device": topology.device_type}
        if topology.local_world_size:
            kwargs["local_world_size"] = topology.local_world_size
        constraints = None
        if self.options.sharding_types:
            from torchrec.distributed.planner.types import ParameterConstraints

            constraints = {c.name: ParameterConstraints(sharding_types=list(self.options.sharding_types))
                           for c in configs}
        planner = EmbeddingShardingPlanner(topology=TRTopology(**kwargs), constraints=constraints)
        return {"plan": planner.plan(meta_ebc, _sharders(topology.device_type)), "device_type": topology.device_type}

    def shard(self, model: nn.Module, plan: Any, mesh: Any) -> nn.Module:
        if plan is None:
            return model
        import torch.distributed as dist
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv

        owner = getattr(model, "sparse_arch", None)
        ebc = getattr(owner, "ebc", None)
        if ebc is None or type(ebc).__name__ != "EmbeddingBagCollection":
            raise PluginError(
                "planner 'torchrec' needs model.sparse_arch.ebc to be a torchrec EmbeddingBagCollection; "
                "install torchrec (pip install --no-deps torchrec fbgemm-gpu-cpu) or run on one process"
            )
        device = torch.device(plan["device_type"], torch.cuda.current_device()) if plan["device_type"] == "cuda" \
            else torch.device("cpu")
        dmp = DistributedModelParallel(
            ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device, plan=plan["plan"],
            sharders=_sharders(plan["device_type"]), init_data_parallel=False,
        )
        # Keep the sharded collection itself, not the DMP wrapper: DMP expects to be the root module, and
        # nested it re-prefixes every key of the parent's state_dict, so dense weights would not load back.
        owner.ebc = dmp.module
        return model


@hookimpl
def gemzoo_register_planners(register):
    register("torchrec", TorchrecPlanner())
