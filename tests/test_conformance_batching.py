"""Batching conformance over every registered batching policy (gemzoo.testing.batching)."""

import pytest
import torch

import gemzoo
from gemzoo.testing.batching import batching_cases, check_assignment, check_global_loss


@pytest.mark.parametrize("case", batching_cases(), ids=str)
def test_every_sample_once_and_deterministic(batching_name, case, registry_entry):
    check_assignment(registry_entry("batching", batching_name), case)


@pytest.fixture(scope="module")
def gem_model_and_batch():
    ds_spec, m_spec = gemzoo.registry.get("dataset", "synthetic-gem"), gemzoo.registry.get("model", "gem")
    ds = ds_spec.build(ds_spec.config_cls(batch_size=12, max_len=24, median_len=8, min_len=0, max_candidates=3,
                                          num_items=60, num_clusters=3, num_sparse_tables=2, sparse_table_size=20), 0)
    model = m_spec.build(m_spec.config_cls(d_model=16, num_layers=1, num_heads=2, embedding_dim=8, mlp_dims=[16, 8]),
                         ds.info).double()
    torch.manual_seed(0)
    model.init_weights()
    batch = ds.train_batch(0)
    return model, batch


@pytest.mark.parametrize("world_size", [2, 3])
def test_global_loss_does_not_depend_on_the_split(batching_name, world_size, registry_entry, gem_model_and_batch):
    model, batch = gem_model_and_batch
    check_global_loss(registry_entry("batching", batching_name), model, batch, world_size,
                      weight=lambda b: b.num_candidates)  # gem's loss is a mean over candidates


@pytest.mark.multiprocess
def test_every_policy_rebalances_per_rank_parts_on_gloo(tmp_path):
    """2 gloo ranks, each loading only its part: every registered policy, the toy third-party one and a policy
    that moves nearly every sample give each rank exactly the global batch's select of the partition; the
    loss is unchanged. One spawn for all: gloo start-up is the slow part."""
    from toy_kinds import LongestFirstBatching

    from gemzoo.testing.batching import check_rebalance_on_gloo

    names = gemzoo.registry.names("batching")
    policies = {**{n: None for n in names}, "toy-lpt": LongestFirstBatching()}
    out = check_rebalance_on_gloo(policies, tmp_path)
    assert set(policies) <= set(out[0]) and len(out[0]) == len(policies) + 1  # + reverse-stride


def test_cat_undoes_select():
    """GemBatch.cat and SeqBatch.cat of parts equal select of their union (the exchange merges with cat)."""
    from gemzoo.data.batch import GemBatch, SeqBatch
    from gemzoo.testing.batching import _SeqStream, batches_equal
    from gemzoo.testing.memory import tiny_model

    _, gem = tiny_model(0, d_model=16, batch_size=9)
    seq = _SeqStream(9).train_batch(1)
    for batch, cls in ((gem, GemBatch), (seq, SeqBatch)):
        parts = [torch.tensor([4, 0]), torch.tensor([], dtype=torch.long), torch.tensor([8, 2, 5])]
        merged = cls.cat([batch.select(p) for p in parts])
        assert not batches_equal(merged, batch.select(torch.cat(parts)))
        assert not batches_equal(cls.cat([batch]), batch)


def test_columns_route_and_chunk_transpose_match_the_plain_rules():
    """The exchange's vectorised pieces against what they stand for: ``columns``/``from_columns`` round-trip
    (GemBatch, SeqBatch, no samples) and select by sample; ``route`` gives the per-destination lists and the
    arrival order a loop over ranks would; ``_transpose_chunks`` is a split and a cat in the other order."""
    from gemzoo.data.batch import GemBatch, SeqBatch
    from gemzoo.data.exchange import _transpose_chunks, route
    from gemzoo.testing.batching import _SeqStream, batches_equal
    from gemzoo.testing.memory import tiny_model

    _, gem = tiny_model(0, d_model=16, batch_size=9)
    seq = _SeqStream(9).train_batch(1)
    for batch, cls in ((gem, GemBatch), (seq, SeqBatch)):
        for pick in (torch.arange(9), torch.tensor([7, 2, 2, 0]), torch.zeros(0, dtype=torch.long)):
            part = batch.select(pick)
            rows, cols = part.columns()
            assert rows.shape[0] == pick.numel() and all(c.shape[0] == int(n) for c, n in zip(cols, rows.sum(0), strict=True))
            assert not batches_equal(cls.from_columns(batch, rows, cols), part)
            one = [batch.select(pick[i:i + 1]).columns()[0] for i in range(pick.numel())]
            assert torch.equal(rows, torch.cat(one) if one else rows)  # row i describes sample i alone

    gen = torch.Generator().manual_seed(3)
    for world, counts in ((3, [4, 0, 5]), (5, [2, 3, 0, 1, 4])):
        perm = torch.randperm(sum(counts), generator=gen)
        cut = torch.randint(0, perm.numel() + 1, (world - 1,), generator=gen).sort().values.tolist()
        groups = list(perm.tensor_split(cut))
        starts = [sum(counts[:r]) for r in range(world + 1)]
        for rank in range(world):
            rt = route(groups, counts, rank)
            sends = [g[(g >= starts[rank]) & (g < starts[rank + 1])] - starts[rank] for g in groups]
            assert torch.equal(rt.send_index, torch.cat(sends)) and rt.send_counts.tolist() == [len(s) for s in sends]
            arrived = torch.cat([groups[rank][(groups[rank] >= starts[s]) & (groups[rank] < starts[s + 1])]
                                 for s in range(world)])  # what arrives, one source rank after another
            assert rt.recv_counts.sum() == groups[rank].numel() and torch.equal(arrived[rt.order], groups[rank])

    sizes = torch.tensor([[2, 0, 3], [1, 4, 0]])
    buf = torch.arange(int(sizes.sum()), dtype=torch.uint8)
    chunks = buf.split(sizes.reshape(-1).tolist())
    expect = torch.cat([chunks[a * 3 + b] for b in range(3) for a in range(2)])
    assert torch.equal(_transpose_chunks(buf, sizes), expect)


@pytest.mark.parametrize("n,world", [(13, 2), (1, 2), (0, 3), (10, 4)])
def test_shards_are_tensor_split_parts(n, world):
    from gemzoo.data.exchange import shard_range

    parts = torch.arange(n).tensor_split(world)
    assert [shard_range(n, r, world) for r in range(world)] == [
        (int(p[0]) if p.numel() else sum(q.numel() for q in parts[:r]), sum(q.numel() for q in parts[:r + 1]))
        for r, p in enumerate(parts)]


def test_a_rank_part_is_the_global_batch_slice():
    from gemzoo.data.exchange import load_shard
    from gemzoo.testing.batching import _SeqStream, batches_equal

    ds = _SeqStream(7)
    whole = ds.train_batch(3)
    assert not batches_equal(load_shard(ds, 3, 1, 2), whole.select(torch.arange(4, 7)))  # own train_shard


def test_bad_partitions_and_costs_are_named():
    from gemzoo.data.exchange import check_costs, check_groups
    from gemzoo.errors import PluginError

    with pytest.raises(PluginError, match=r"'drop'.*samples \[3\] are unassigned"):
        check_groups([torch.tensor([0, 1]), torch.tensor([2])], 4, 2, "drop")
    with pytest.raises(PluginError, match=r"\[1\] assigned more than once"):
        check_groups([torch.tensor([0, 1]), torch.tensor([1, 2])], 3, 2, "dup")
    with pytest.raises(PluginError, match="want a list of 2"):
        check_groups([torch.arange(3)], 3, 2, "one")
    with pytest.raises(PluginError, match="dtype torch.float32"):
        check_groups([torch.tensor([0.0]), torch.tensor([1.0])], 2, 2, "float")
    with pytest.raises(PluginError, match=r"samples \[1\].*finite"):
        check_costs(torch.tensor([1.0, float("nan"), 2.0]))


def _train_rank(rank: int, world: int, port: int, tmp: str, batching: str) -> None:
    import os
    import sys

    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
    import toy_kinds

    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    seen = []

    class Record:
        @gemzoo.hookimpl
        def gemzoo_step_end(self, trainer, step, metrics):
            seen.append(metrics["samples_per_s"] * metrics["step_s"])

    registry.host().register(toy_kinds, name="toy-kinds")
    registry.host().register(Record(), name="record")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "gem-tiny.toml"), overrides=[
        "run.steps=2", "run.device='cpu'", "eval.every=0", "checkpoint.every=0", f"run.out_dir='{tmp}/{batching}'",
        "data.batch_size=9", "model.d_model=16", "model.embedding_dim=8", f"plugins.batching='{batching}'"])
    result = train(cfg, progress=False)
    _report_and_leave(os.path.join(tmp, f"{batching}-{rank}.json"),
                      {"losses": [h["loss"] for h in result.history], "samples": seen})


@pytest.mark.multiprocess
def test_the_trainer_trains_what_a_moving_policy_gives(tmp_path):
    """gem on 2 gloo ranks with toy-lpt: each rank loads its part, samples move to balance the cost model's
    work, every step trains all 9 samples once, both ranks log the same finite loss."""
    import json
    import math

    from gemzoo.testing.comms import spawn

    spawn(_train_rank, 2, str(tmp_path), "toy-lpt")
    ranks = [json.loads((tmp_path / f"toy-lpt-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["losses"] == ranks[1]["losses"] and all(math.isfinite(x) for x in ranks[0]["losses"])
    assert ranks[0]["samples"] == pytest.approx([9, 9])


def _report_and_leave(path: str, result) -> None:
    """A rank's result as JSON, then the process group torn down once every rank is done with it."""
    import json

    import torch.distributed as dist

    with open(path, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _host_path_rank(rank: int, world: int, port: int, tmp: str) -> None:
    import os

    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    import torch.distributed as dist

    from gemzoo.data.lookahead import Lookahead
    from gemzoo.interfaces.batching import DataParallelGroup
    from gemzoo.interfaces.models import host_view
    from gemzoo.testing.batching import ReverseStride, batches_equal, small_gem_stream

    class Ahead(ReverseStride):
        overlap = True
        overlap_worker = "thread"

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = small_gem_stream(11)
    cost = lambda b: b.lengths.double() ** 2 + 1  # noqa: E731
    dp = DataParallelGroup(rank, world, host=DataParallelGroup(rank, world))
    placed = []
    with Lookahead(Ahead()) as look:
        for step in range(3):
            got = look.batch(data, step, dp, torch.device("meta"), cost, next_step=step + 1 if step < 2 else None)
            full = data.train_batch(step)
            want = full.select(Ahead().assign(cost(full), world)[rank])
            bad = batches_equal(host_view(got), want)
            assert not bad, f"rank {rank} step {step}: the samples moved on the host differ in {bad}"
            placed.append({"device": got.history_items.device.type, "ahead": look.last["ahead"]})
    _report_and_leave(os.path.join(tmp, f"host{rank}.json"), placed)


@pytest.mark.multiprocess
def test_a_host_group_moves_samples_on_the_host_and_reads_no_device_value(tmp_path):
    """2 gloo ranks, the trainer's device on ``meta`` (any read of a device value raises there): with the data-
    parallel group's ``host`` group, Lookahead loads, prices, partitions (ahead, in a thread) and moves the samples
    on the host and only then puts them on the device; each step's samples (their host copy) are the global
    batch's select of the partition."""
    import json

    from gemzoo.testing.comms import spawn

    spawn(_host_path_rank, 2, str(tmp_path))
    for r in range(2):
        placed = json.loads((tmp_path / f"host{r}.json").read_text())
        assert placed == [{"device": "meta", "ahead": False}] + [{"device": "meta", "ahead": True}] * 2


def _dp_host_rank(rank: int, world: int, port: int, tmp: str) -> None:
    import os

    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    import torch.distributed as dist

    from gemzoo import registry
    from gemzoo.distributed import World, build_mesh, dp_host_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comms = registry.get("comms", "torch")
    out = {}
    for label, dense in {"dp": None, "tp2": {"replicate": 1, "shard": 2, "tp": 2}}.items():
        w = build_mesh(World(rank, world), "cpu", {"dp": world}, dense, comms=comms)
        for force in (False, True):
            group = dp_host_group(w, comms, force=force)
            ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(w.dp_mesh.size())]
            dist.all_gather(ranks, torch.tensor([rank]), group=group)
            out[f"{label}/{force}"] = {"gathered": [int(t) for t in ranks], "dp_rank": w.dp_host.rank,
                                       "mesh": w.dp_mesh.mesh.tolist()}
    _report_and_leave(os.path.join(tmp, f"dp{rank}.json"), out)


@pytest.mark.multiprocess
def test_the_dp_host_group_has_the_dp_ranks_in_the_dp_order(tmp_path):
    """4 gloo ranks: the dp ranks' CPU group (World.dp_host, and the groups dp_host_group builds when the dp group
    cannot run CPU tensors: forced here) gathers from exactly dp_mesh's ranks in its order, with tensor
    parallelism (one dp group per tp index) and without."""
    import json

    from gemzoo.testing.comms import spawn

    spawn(_dp_host_rank, 4, str(tmp_path))
    for r in range(4):
        out = json.loads((tmp_path / f"dp{r}.json").read_text())
        for key, got in out.items():
            assert got["gathered"] == got["mesh"], (r, key, got)
            assert got["mesh"][got["dp_rank"]] == r, (r, key, got)
        assert out["dp/False"]["mesh"] == [0, 1, 2, 3] and out["tp2/True"]["mesh"] == [r % 2, r % 2 + 2]
