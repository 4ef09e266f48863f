"""The torchrec planner shards pooled tables across 2 gloo ranks; lookups match the unsharded tables."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from gemzoo.testing import skip_unless_torchrec
from gemzoo.testing.comms import rank_env
from gemzoo.testing.timeouts import hang_guard

pytestmark = pytest.mark.multiprocess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, tmp: str, sharding: str) -> None:
    rank_env(rank, world, port, quiet=False)
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    from gemzoo import registry
    from gemzoo.embedding import SparseArch, TableConfig
    from gemzoo.interfaces.planner import Topology

    tables = [TableConfig(f"t{i}", 40 + 10 * i, 8, [f"f{i}"]) for i in range(3)]

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse_arch = SparseArch(tables, engine="torchrec")

    torch.manual_seed(0)
    model = Holder()
    model.sparse_arch.init_weights()
    full = {name: p.detach().clone() for name, p in model.sparse_arch.ebc.named_parameters()}
    from gemzoo.builtin.planner import TorchrecPlannerOptions

    planner = registry.get("planner", "torchrec").configure(TorchrecPlannerOptions([sharding]))
    plan = planner.plan(tables, Topology(world, "cpu"))
    model = planner.shard(model, plan, None)
    # copy the reference weights into the shards this rank owns
    state = model.sparse_arch.ebc.state_dict()
    for key, value in state.items():
        name = key.removeprefix("module.")
        if not hasattr(value, "local_shards"):  # data-parallel tables stay whole on every rank
            value.copy_(full[name])
            continue
        for shard in value.local_shards():
            r, c = shard.metadata.shard_offsets
            h, w = shard.metadata.shard_sizes
            shard.tensor.copy_(full[name][r:r + h, c:c + w])
    g = torch.Generator().manual_seed(100 + rank)  # each rank has its own local batch
    batch = 4
    lengths = torch.randint(0, 4, (3 * batch,), generator=g)
    values = torch.cat([torch.randint(0, 40, (int(n),), generator=g) for n in lengths])
    got = model.sparse_arch(["f0", "f1", "f2"], values, lengths)
    got = got.wait() if hasattr(got, "wait") else got
    ref = SparseArch(tables, engine="torch")
    with torch.no_grad():
        for name, w in full.items():
            dict(ref.ebc.named_parameters())[name].copy_(w)
    want = ref(["f0", "f1", "f2"], values, lengths)
    torch.testing.assert_close(got, want)
    kinds = sorted({o.sharding_type for o in plan["plan"].plan[""].values()})
    torch.save(kinds, os.path.join(tmp, f"kinds{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_torchrec_planner_shards_on_gloo(tmp_path, sharding):
    skip_unless_torchrec()
    world, port = 2, _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(tmp_path), sharding)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=hang_guard(900))
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    kinds = torch.load(tmp_path / "kinds0.pt")
    assert kinds == [sharding]
