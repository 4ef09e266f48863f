"""A toy planner and a toy batching policy, registered like a third-party plugin (tests/test_conformance_toys.py
installs them from a fake distribution) to show that a new entry of a kind touches only its plugin and that
the conformance suites pick it up."""

from __future__ import annotations

import torch

import gemzoo
from gemzoo.errors import PluginError
from gemzoo.interfaces.comms import CommsCapabilities
from gemzoo.interfaces.planner import Topology


class LongestFirstBatching:
    """Greedy longest-processing-time: samples by decreasing cost (ties by index), each to the least-loaded rank
    (ties to the lowest rank); each rank's samples in index order.

    A partition-only policy: it sees the all-gathered costs of the global batch, and gemzoo moves the samples
    (gemzoo.data.exchange.rebalance), so it works when each rank loads only its own part."""

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
    """Every rank keeps every table whole, synchronised like torchrec's DMPCollection in its ``replicated``
    strategy, so every method of the Planner protocol does something a test can see:

    - ``mesh_dims``: ``{"replica": world, "shard": 1}``, a 2-D mesh (``dp`` flattened from both dims);
    - ``attach_optimizer``: the tables get the planner's own Adagrad (not the trainer's), applied in ``sync``;
    - ``replicated_parameters``: every whole parameter except the tables, so the trainer leaves them alone;
    - ``sync``: each rank's Adagrad step on its own gradient, then weights and accumulators averaged over the
      ``replica`` dim;
    - ``state_dict`` / ``load_state_dict``: the accumulators, ``<table parameter>/sum``."""

    def mesh_dims(self, topology: Topology) -> dict[str, int]:
        return {"replica": topology.world_size, "shard": 1}

    def plan(self, tables: list, topology: Topology):
        names = [getattr(t, "name", None) for t in tables]
        if any(not n for n in names):
            raise PluginError("planner 'toy-replicate' needs tables with names")
        return {"replicate": names}

    def attach_optimizer(self, model, plan, optimizer):
        if optimizer.name != "adagrad":
            raise PluginError(f"planner 'toy-replicate' trains its tables with adagrad, not {optimizer.name!r}")
        tables = dict(model.sparse_arch.named_parameters(prefix="sparse_arch"))
        model.toy_tables = {"lr": optimizer.lr, "params": tables, "group": None,
                            "sum": {n: torch.zeros_like(p, memory_format=torch.contiguous_format)
                                    for n, p in tables.items()}}

    def shard(self, model, plan, mesh):
        have = {getattr(t, "name", None) for t in model.embedding_tables()}
        lost = [n for n in plan["replicate"] if n not in have]
        if lost:
            raise PluginError(f"planner 'toy-replicate': the model has no tables {lost}")
        model.toy_tables["group"] = None if mesh is None else mesh.get_group("replica")
        return model

    def replicated_parameters(self, model):
        from gemzoo.interfaces.planner import whole_parameters

        tables = {id(p) for p in model.toy_tables["params"].values()}
        return [p for p in whole_parameters(model) if id(p) not in tables]

    @torch.no_grad()
    def sync(self, model, step):
        import torch.distributed as dist

        toy = model.toy_tables
        for name, p in toy["params"].items():
            if p.grad is not None:
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                toy["sum"][name] += g * g
                p -= toy["lr"] * g / (toy["sum"][name].sqrt() + 1e-10)
                p.grad = None
            if toy["group"] is not None:
                for t in (p, toy["sum"][name]):
                    dist.all_reduce(t, group=toy["group"])
                    t /= dist.get_world_size(toy["group"])

    def state_dict(self, model):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return {f"{name}/sum": s.clone() for name, s in model.toy_tables["sum"].items()}

    @torch.no_grad()
    def load_state_dict(self, model, state):
        missing = []
        for name, s in model.toy_tables["sum"].items():
            if f"{name}/sum" in state:
                s.copy_(state[f"{name}/sum"])
            else:
                missing.append(f"{name}/sum")
        return missing


def _toy_gloo(store, rank, size, timeout):
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, size, timeout)


class ToyGlooComms:
    """A comms backend under its own c10d name, ``toygloo`` (gloo underneath), whose ``shard`` mesh dimension gets
    plain ``gloo`` groups (``backend_for_dim``): the conformance suite and a 2-rank training run check that every
    group is the one declared and that the trainer reaches collectives only through process groups. It claims
    all_reduce and all_to_all_single, so the suite checks those as claimed collectives too."""

    capabilities = CommsCapabilities(sm_free=False, implements=frozenset({"all_reduce", "all_to_all_single"}))

    def backend_for(self, device_type: str) -> str:
        return "toygloo"

    def backend_for_dim(self, dim: str, device_type: str) -> str | None:
        return "gloo" if dim == "shard" else None

    def install(self) -> None:
        import torch.distributed as dist

        if "toygloo" not in dist.Backend.backend_list:
            dist.Backend.register_backend("toygloo", _toy_gloo, devices=["cpu"])


@gemzoo.hookimpl
def gemzoo_register_comms(register):
    register("toy-gloo", ToyGlooComms())


@gemzoo.hookimpl
def gemzoo_register_batching(register):
    register("toy-lpt", LongestFirstBatching())


@gemzoo.hookimpl
def gemzoo_register_planners(register):
    register("toy-replicate", ReplicatePlanner())
