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


@pytest.mark.distributed
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
            assert rows.shape[0] == pick.numel() and all(c.shape[0] == int(n) for c, n in zip(cols, rows.sum(0)))
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
    import json
    import os
    import sys

    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
    import toy_kinds
    import torch.distributed as dist

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
    with open(os.path.join(tmp, f"{batching}-{rank}.json"), "w") as f:
        json.dump({"losses": [h["loss"] for h in result.history], "samples": seen}, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
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
