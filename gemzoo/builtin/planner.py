"""Built-in planner ``torchrec``: torchrec's EmbeddingShardingPlanner + DistributedModelParallel (1D sharding).

Tables are sharded over every rank (mesh ``{"dp": world}``), with row-wise Adagrad fused into their backward
(fbgemm TBE). Single-process runs keep the tables unsharded. Without torchrec (the GPU image has none) the model
uses gemzoo's plain-torch embedding engine and this planner keeps every table whole on every rank, like
``gemzoo.interfaces.planner.WholeTables``: their gradients are averaged over ``dp`` and the trainer's Adagrad
applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gemzoo.distributed.state import gather_pieces, load_full_state, scatter_pieces
from gemzoo.embedding import torchrec_available
from gemzoo.errors import PluginError
from gemzoo.interfaces.options import TakesOptions
from gemzoo.interfaces.planner import SparseOptimizer, Topology, whole_parameters
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


def fused_optimizer_state(model: nn.Module) -> dict[str, Any]:
    """This rank's state of the optimizers fused into torchrec-sharded modules (the tables' Adagrad
    accumulators), keyed ``module/param/state``: ShardedTensors for the tables this rank stores."""
    out = {}
    for name, module in model.named_modules():
        fused = getattr(module, "fused_optimizer", None)  # torchrec's sharded collections
        if fused is None:
            continue
        for param, pstate in fused.state_dict()["state"].items():
            for key, value in pstate.items():
                if isinstance(value, torch.Tensor) or hasattr(value, "local_shards"):
                    out[f"{name}/{param}/{key}"] = value
    return out


@dataclass
class TorchrecPlannerOptions:
    sharding_types: list[str] = field(default_factory=list)  # restrict every table, e.g. ["table_wise"]


class TorchrecPlanner(TakesOptions):
    """``plan`` runs torchrec's planner on a meta copy of the tables; ``shard`` wraps the EBC in DMP."""

    options_cls = TorchrecPlannerOptions

    def mesh_dims(self, topology: Topology) -> dict[str, int]:
        return {"dp": topology.world_size}  # 1D: every table's shards spread over every rank

    def plan(self, tables: list[Any], topology: Topology) -> Any:
        if topology.world_size == 1 or not tables or not torchrec_available():
            return None  # whole tables on every rank (the plain-torch engine when torchrec is missing)
        from torchrec import EmbeddingBagCollection
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner.types import Topology as TRTopology

        configs = [t.to_torchrec() if hasattr(t, "to_torchrec") else t for t in tables]
        meta_ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        constraints = None
        if self.options.sharding_types:
            from torchrec.distributed.planner.types import ParameterConstraints

            constraints = {c.name: ParameterConstraints(sharding_types=list(self.options.sharding_types))
                           for c in configs}
        planner = EmbeddingShardingPlanner(
            topology=TRTopology(world_size=topology.world_size, compute_device=topology.device_type),
            constraints=constraints)
        return {"plan": planner.plan(meta_ebc, _sharders(topology.device_type)), "device_type": topology.device_type}

    def attach_optimizer(self, model: nn.Module, plan: Any, optimizer: SparseOptimizer) -> None:
        """Ask torchrec to fuse row-wise Adagrad into the sharded tables' backward (DMP builds fbgemm's TBE)."""
        if plan is None:
            return
        if optimizer.name != "adagrad":
            raise PluginError(f"planner 'torchrec' fuses Adagrad into its tables, not {optimizer.name!r}")
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": optimizer.lr})

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
        group = mesh.get_group("dp") if mesh is not None else dist.group.WORLD
        # DMP builds the sharded tables afresh (torchrec's own init, the same for every table); the model's
        # init_weights gave them their weights, which every rank holds: copy this rank's shards of those back
        initialised = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
        device = torch.device(plan["device_type"], torch.cuda.current_device()) if plan["device_type"] == "cuda" \
            else torch.device("cpu")
        dmp = DistributedModelParallel(
            ebc, env=ShardingEnv.from_process_group(group), device=device, plan=plan["plan"],
            sharders=_sharders(plan["device_type"]), init_data_parallel=False,
        )
        # Keep the sharded collection itself, not the DMP wrapper: DMP expects to be the root module, and
        # nested it re-prefixes every key of the parent's state_dict, so dense weights would not load back.
        owner.ebc = dmp.module
        load_full_state(owner.ebc, initialised)
        return model

    def replicated_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        # Sharded tables are ShardedTensors with a fused optimizer: not whole, not the trainer's to update.
        return whole_parameters(model)

    def sync(self, model: nn.Module, step: int) -> None:
        return None  # 1D: one copy of every shard, nothing to keep in step

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Whole fused-Adagrad accumulators of the sharded tables on rank 0 (collective over the world = dp)."""
        import torch.distributed as dist

        return gather_pieces(fused_optimizer_state(model), not dist.is_initialized() or dist.get_rank() == 0)

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
        return scatter_pieces(fused_optimizer_state(model), state)


@hookimpl
def gemzoo_register_planners(register):
    register("torchrec", TorchrecPlanner())
