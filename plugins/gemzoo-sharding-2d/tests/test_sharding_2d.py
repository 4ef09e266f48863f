"""sharding-2d: the planner conformance suite (one process, every option set; 2 gloo ranks on the no-torchrec
path); on 4 gloo ranks the trainer with G=2 x R=2 in both strategies matches a one-process run, resumes bit-exact,
reshards 2x2 -> 4x1 -> one process -> 2x2, stores tables / G or tables / (G x R) a rank and hands its
collectives exactly the bytes ``gemzoo plan`` computes; bad input is named; ``gemzoo plan`` itself."""

from __future__ import annotations

import json

import pytest
import sharding_2d_cases as cases
import torch
from gemzoo_sharding_2d import Sharding2D, Sharding2DOptions
from gemzoo_sharding_2d.scale import Links, embedding_traffic, parse_bytes, plan_report
from sharding_2d_measure import per_step, sample_ids

from gemzoo.api import CheckpointError, ConfigError, SparseOptimizer, Topology, registry
from gemzoo.testing.planner import check_planner_local

OPTION_SETS = {
    "replicated": Sharding2DOptions(),
    "fully_sharded": Sharding2DOptions(strategy="fully_sharded"),
    "weights": Sharding2DOptions(replica_sync="weights", sync_every=3),
    "data_parallel": Sharding2DOptions(sharding_types=["data_parallel"]),
}


def planner(**options) -> Sharding2D:
    return registry.get("planner", "sharding-2d").configure(Sharding2DOptions(**options))


def test_entry_point_registers_the_planner_and_the_plan_command():
    assert "sharding-2d" in registry.names("planner")
    entry = next(e for e in registry.entries("planner") if e.name == "sharding-2d")
    assert entry.distribution == "gemzoo-sharding-2d"
    from gemzoo.testing import cli_main as main

    with pytest.raises(SystemExit) as stop:
        main(["plan", "--help"])
    assert stop.value.code == 0


@pytest.mark.parametrize("name", OPTION_SETS)
def test_conformance_one_process_every_option_set(name):
    check_planner_local(registry.get("planner", "sharding-2d").configure(OPTION_SETS[name]))


def test_mesh_dims_and_the_default_group():
    assert planner().mesh_dims(Topology(16, "cpu")) == {"replica": 2, "shard": 8}
    assert planner().mesh_dims(Topology(4, "cpu")) == {"replica": 1, "shard": 4}
    assert planner(group_size=2).mesh_dims(Topology(8, "cpu")) == {"replica": 4, "shard": 2}


@pytest.mark.multiprocess
def test_conformance_protocol_on_gloo_without_torchrec(tmp_path):
    """The GPU image's path (no torchrec: the gemzoo fallback layout, the plain-torch engine) on one group of 2
    ranks: the protocol call by call, a checkpoint round trip bit for bit (the 4-rank case runs the trainer)."""
    from gemzoo.testing.planner import check_planner_protocol_on_gloo

    reports = check_planner_protocol_on_gloo(planner(group_size=2), tmp_path, world=2,
                                             env={"GEMZOO_NO_TORCHREC": "1"})
    assert all(r["sharded"] and r["planner_keys"] == 2 for r in reports)


@pytest.mark.multiprocess
def test_four_gloo_ranks_match_one_process_resume_reshard_memory_and_bytes(tmp_path):
    from gemzoo.testing.comms import spawn

    ref = cases.run(str(tmp_path / "ref"), 5, planner="torchrec", every=0)["losses"]  # one process, whole tables
    spawn(cases.train_rank, 4, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    r0 = ranks[0]

    def close(got, want, what):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")

    # 1. G=2 x R=2, both strategies: the one-process run's 5 losses within 1e-5 relative; every rank logs them
    for label in ("rep", "fs"):
        assert all(r[label]["losses"] == r0[label]["losses"] for r in ranks)
        close(r0[label]["losses"], ref, label)
    # 2. resume with the layout unchanged: bit for bit
    assert r0["rep@resumed"]["steps"] == [3, 4, 5] and r0["rep@resumed"]["losses"] == r0["rep"]["losses"][2:]
    assert r0["fs@resumed"]["steps"] == [4, 5] and r0["fs@resumed"]["losses"] == r0["fs"]["losses"][3:]
    # 3. reshard: 2x2 (step 2) -> 4x1 table-wise (step 3) -> one process (step 4) -> 2x2 fully sharded (step 5)
    for label, step in (("4x1", 3), ("1x1", 4), ("2x2", 5)):
        assert r0[label]["steps"] == [step], (label, r0[label]["steps"])
        close(r0[label]["losses"], ref[step - 1:step], f"reshard leg {label}")
    # weight averaging every 2 steps (DMPCollection.sync): the same first step, then close but not equal
    got = r0["weights"]["losses"]
    assert got[0] == pytest.approx(ref[0], rel=1e-6) and got != r0["rep"]["losses"][:4]
    assert max(abs(a - b) / b for a, b in zip(got, ref, strict=False)) < 1e-2
    # 4. embedding memory a rank: tables / G replicated, tables / (G x R) fully sharded
    whole = 4 * cases.TABLE_ROWS * 8 * 4  # 4 tables of 64 x 8 fp32
    for r in ranks:
        assert r["rep"]["memory"]["whole"] == whole
        assert r["rep"]["memory"]["weights"] == r["rep"]["memory"]["state"] == whole / 2
        assert r["fs"]["memory"]["weights"] == r["fs"]["memory"]["state"] == whole / 4
    # 5. the bytes each rank handed its collectives, step by step, equal gemzoo plan's formula
    from gemzoo_sharding_2d.layout import plan_layout

    from gemzoo.api import TableConfig, load_config

    cfg = load_config(cases.CONFIG, overrides=cases.overrides(str(tmp_path / "unused"), 5))
    ds = registry.get("dataset", cfg.data.source).build(cfg.data, cfg.run.seed)
    features = [f"sparse_{t}" for t in range(cfg.data.num_sparse_tables)]
    tables = [TableConfig(f"table_{t}", cases.TABLE_ROWS, 8, [f]) for t, f in enumerate(features)]
    runs = {"rep": (dict(strategy="replicated"), {}), "fs": (dict(strategy="fully_sharded"), {}),
            "weights": (dict(strategy="replicated"), dict(replica_sync="weights", sync_every=2))}
    for label, (lay, sync) in runs.items():
        layout = plan_layout(tables, 2, 2, lay["strategy"], ["row_wise"])
        for r, rank in enumerate(ranks):
            for step, got in enumerate(per_step(rank[label]["bytes"])):
                ids, batch = sample_ids(ds, step, r, 4)
                want = embedding_traffic(layout, features, batch, ids, **sync, rank=r % 2)
                if "replica_sync" in want and sync:  # weights: 2 tensors every 2nd step = the per-step mean x 2
                    want["replica_sync"] = want["replica_sync"] * 2 if step % 2 == 1 else 0
                assert got == {k: v for k, v in want.items() if v}, (label, r, step)
    # 6. a checkpoint of other tables: the resume names the key and both values before loading anything
    from gemzoo.api import train

    with pytest.raises(ConfigError, match="data.sparse_table_size is 64 in the checkpoint, 32 now"):
        train(load_config(cases.CONFIG, overrides=cases.overrides(str(tmp_path / "bad"), 5) + [
            "data.sparse_table_size=32", "plugins.options.sharding-2d.group_size=1"]),
            resume=str(tmp_path / "rep" / "checkpoints" / "step-00000002"), progress=False)


def test_bad_group_size_and_options_are_named():
    with pytest.raises(ConfigError, match=r"group_size = 3 does not divide the world of 4 ranks.*\[1, 2, 4\]"):
        planner(group_size=3).mesh_dims(Topology(4, "cpu"))
    with pytest.raises(ConfigError, match=r"group_size = 3 does not divide the world of 4"):
        planner(group_size=3).plan([], Topology(4, "cpu"))
    with pytest.raises(ConfigError, match="strategy must be one of replicated, fully_sharded, got 'both'"):
        Sharding2DOptions(strategy="both")
    with pytest.raises(ConfigError, match='sync_every = 2 needs strategy = "replicated" and replica_sync = "weights"'):
        Sharding2DOptions(sync_every=2)
    with pytest.raises(ConfigError, match=r"sharding_types has \['diagonal'\]"):
        Sharding2DOptions(sharding_types=["diagonal"])
    with pytest.raises(ConfigError, match="group_size must be an integer >= 0"):
        Sharding2DOptions(group_size=-2)


def test_planner_state_that_does_not_fit_is_named():
    from gemzoo.testing.memory import tiny_model

    p = planner()
    model, _ = tiny_model(0, d_model=16, batch_size=8)
    plan = p.plan(model.embedding_tables(), Topology(1, "cpu"))
    p.attach_optimizer(model, plan, SparseOptimizer(lr=0.05))
    model = p.shard(model, plan, None)
    state = p.state_dict(model)
    name = next(iter(state))
    assert name.endswith(".weight/sum") and "embedding_bags.table_0" in name
    with pytest.raises(CheckpointError, match=r"table 'table_0' is \[3, 16\] in the checkpoint but \[30, 16\]"):
        p.load_state_dict(model, {**state, name: torch.zeros(3, 16)})
    with pytest.raises(CheckpointError, match="Adagrad state for tables this model lacks.*table_9"):
        p.load_state_dict(model, {**state, "sparse_arch.ebc.embedding_bags.table_9.weight/sum": torch.zeros(1)})
    assert p.load_state_dict(model, {k: v for k, v in state.items() if k != name}) == [name]


def _report(world, group, **kw):
    from gemzoo.api import load_config

    cfg = load_config(cases.CONFIG, overrides=cases.overrides("/tmp/unused", 5))
    return plan_report(cfg, world, group, parse_bytes("141GB"), Links(), **kw)


def test_plan_memory_and_traffic_follow_the_layout():
    rep = _report(64, 8)
    one, two, full = (rep["layouts"][k] for k in ("1d", "2d-replicated", "2d-fully_sharded"))
    whole = rep["model"]["table_bytes"]
    assert whole == 4 * cases.TABLE_ROWS * 8 * 4
    assert one["memory"]["tables"] == whole / 64 and two["memory"]["tables"] == whole / 8
    assert full["memory"]["tables"] == whole / 64 and full["memory"]["gathered_group_shard"] == whole / 8
    # row-wise: each rank's pooled pieces scale with the group it spans, so 2D cuts them by W / G
    assert one["traffic"]["a2a_pooled_fwd"] == 8 * two["traffic"]["a2a_pooled_fwd"]
    assert two["traffic"]["replica_sync"] == whole / 8 and "replica_sync" not in one["traffic"]
    assert full["traffic"]["replica_reduce_scatter"] == 8 * full["traffic"]["replica_all_gather"]
    assert two["seconds"]["a2a"] < one["seconds"]["a2a"]  # inside a node rather than across 8


def test_plan_cli_json_and_bad_input(capsys):
    from gemzoo.testing import cli_main as main

    assert main(["plan", "--config", cases.CONFIG, "--world", "16", "--group", "4", "--hbm", "80GiB", "--json",
                 "--set", "data.sparse_table_size=64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hbm"] == 80 * 2**30 and set(out["layouts"]) == {"1d", "2d-replicated", "2d-fully_sharded"}
    assert out["layouts"]["2d-replicated"]["replicas"] == 4 and all(r["fits_hbm"] for r in out["layouts"].values())
    assert main(["plan", "--config", cases.CONFIG, "--world", "16", "--group", "3"]) == 2
    assert "--group 3 does not divide --world 16" in capsys.readouterr().err
    assert main(["plan", "--config", cases.CONFIG, "--world", "16", "--hbm", "lots"]) == 2
    assert "--hbm 'lots'" in capsys.readouterr().err
    assert main(["plan", "--config", cases.CONFIG, "--world", "8", "--group", "2"]) == 0  # the rich tables
    text = capsys.readouterr().out
    assert "memory per rank" in text and "2d-fully_sharded" in text and "communication per rank" in text


def test_a_resume_may_change_the_layout_options_only():
    """gemzoo.train.resume: sharding-2d's layout_fields are changeable keys; its other keys and other plugins'
    options stay fixed."""
    from gemzoo.testing import config_changes

    saved = {"plugins": {"planner": "sharding-2d", "options": {"sharding-2d": {"group_size": 2, "strategy":
                                                                                "replicated"}}}}
    now = {"plugins": {"planner": "sharding-2d", "options": {"sharding-2d": {"group_size": 4, "strategy":
                                                                              "fully_sharded"}}}}
    changeable, fixed = config_changes(saved, now)
    assert [k for k, _, _ in changeable] == ["plugins.options.sharding-2d.group_size",
                                             "plugins.options.sharding-2d.strategy"] and not fixed
    _, fixed = config_changes(saved, {"plugins": {"planner": "torchrec", **{"options": saved["plugins"]["options"]}}})
    assert [k for k, _, _ in fixed] == ["plugins.planner"]
    other = {"plugins": {"options": {"other-plugin": {"group_size": 2}}}}
    _, fixed = config_changes(other, {"plugins": {"options": {"other-plugin": {"group_size": 4}}}})
    assert [k for k, _, _ in fixed] == ["plugins.options.other-plugin.group_size"]


def test_row_and_column_blocks_pool_like_whole_tables():
    """One process, hand-made blocks: a table in 2 row blocks x 2 column blocks (partial sums added, columns
    concatenated), a mean-pooled table-wise one and a data-parallel one give F.embedding_bag's output and, after
    sync, torch Adagrad's update of the whole tables (empty bags included)."""
    import torch.nn.functional as F
    from gemzoo_sharding_2d.engine import Groups, ShardedTables
    from gemzoo_sharding_2d.layout import Block, Layout, TableSpec

    specs = {"a": TableSpec("a", 10, 6, ("fa",)), "b": TableSpec("b", 7, 4, ("fb",), "mean"),
             "c": TableSpec("c", 5, 3, ("fc",))}
    blocks = {"a": [Block("a", 0, 0, 4, 0, 3), Block("a", 0, 4, 6, 0, 3), Block("a", 0, 0, 4, 3, 3),
                    Block("a", 0, 4, 6, 3, 3)], "b": [Block("b", 0, 0, 7, 0, 4)], "c": []}
    layout = Layout(1, 1, "replicated", specs, blocks, {}, "test", lr=0.1)
    g = torch.Generator().manual_seed(0)
    whole = {n: torch.randn(s.num_embeddings, s.embedding_dim, generator=g) for n, s in specs.items()}
    tables = ShardedTables(layout, {n: w.clone() for n, w in whole.items()}, Groups(), ["fa", "fb", "fc"])
    lengths = torch.tensor([2, 0, 3, 1, 1, 2, 0, 2, 1])  # 3 features x 3 samples, key-major
    values = torch.cat([torch.randint(s.num_embeddings, (int(n),), generator=g)
                        for s, n in zip(specs.values(), lengths.view(3, 3).sum(1), strict=False)])
    out = tables(["fa", "fb", "fc"], values, lengths)
    ref_w = {n: w.clone().requires_grad_(True) for n, w in whole.items()}
    starts = [0] + torch.cumsum(lengths.view(3, 3).sum(1), 0).tolist()
    ref = torch.cat([F.embedding_bag(values[starts[i]:starts[i + 1]], ref_w[n],
                                     torch.cat([torch.zeros(1, dtype=torch.long), lengths[3 * i:3 * i + 3].cumsum(0)]),
                                     mode=specs[n].pooling, include_last_offset=True) for i, n in enumerate(specs)], 1)
    torch.testing.assert_close(out, ref)
    weight = torch.randn(out.shape, generator=g)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    tables.step(0, 0.1, "gradients", 1)
    opt = torch.optim.Adagrad([ref_w["a"], ref_w["b"]], lr=0.1)
    opt.step()
    views = tables.views(tables.flat.data)
    got = {n: tables.gather_whole({n: views[n]})[n] for n in ("a", "b")}
    for n in ("a", "b"):
        torch.testing.assert_close(got[n], ref_w[n].detach(), rtol=0, atol=1e-6)
    assert tables.embedding_bags["c"].weight.grad is not None  # data-parallel: the trainer's to update
