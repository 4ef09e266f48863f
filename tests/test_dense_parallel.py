"""3D dense parallelism (run.mesh): HSDP and tensor parallelism on 4 gloo ranks against one
process, bit-exact resume, checkpoints that move between layouts, and the errors for meshes that do not fit.

One spawn of 4 ranks runs every multi-rank phase in turn (each its own run folder) to keep CI time low; the
one-process runs happen in the test process."""

import json
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp

from gemzoo.errors import ConfigError
from gemzoo.testing.comms import rank_env
from gemzoo.testing.timeouts import hang_guard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "gem-tiny.toml")
STEPS = 5
# gem-tiny's model on a smaller batch, without its torchrec tables (dense parallelism alone: the planner owns
# them), evaluated never, a checkpoint after step 3 and at the end (step 5); on the CPU on a GPU machine too (4
# gloo ranks on one GPU would ask for more GPUs than there are, and the one-process reference must match them)
BASE = [f"run.steps={STEPS}", "run.device='cpu'", "eval.every=0", "checkpoint.every=3", "checkpoint.keep=0", "run.log_every=1",
        "data.num_sparse_tables=0", "data.batch_size=16", "data.max_len=32", "data.median_len=8",
        "data.max_candidates=4"]
# with the embedding tables, sharded by the 2D planner when it is installed (plugins/gemzoo-sharding-2d)
TABLES = ["data.num_sparse_tables=2", "data.sparse_table_size=200", "plugins.planner='sharding-2d'",
          "plugins.options.sharding-2d.group_size=2"]
HSDP = "run.mesh={replicate=2,shard=2}"
TP = "run.mesh={replicate=1,shard=2,tp=2}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(out: str, overrides: list[str], resume=False) -> dict:
    from torch.distributed.tensor import DTensor

    import gemzoo
    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    built = {}

    class Capture:
        @gemzoo.hookimpl
        def gemzoo_model_built(self, model, config):
            built["model"] = model

    name = f"capture-{len(registry.host().pm.get_plugins())}"
    plugin = Capture()
    registry.host().register(plugin, name=name)
    try:
        cfg = load_config(CONFIG, overrides=[*BASE, f"run.out_dir='{out}'", *overrides])
        result = train(cfg, resume=resume, progress=False)
    finally:
        registry.host().pm.unregister(plugin)
    blocks = built["model"].tower.blocks
    qkv = blocks[0].attn.qkv.weight
    local = qkv.to_local() if isinstance(qkv, DTensor) else qkv
    kv = built["model"].cross.kv.weight
    kv = kv.to_local() if isinstance(kv, DTensor) else kv
    return {"losses": [h["loss"] for h in result.history], "first": result.history[0]["step"],
            "samples": [round(h["samples_per_s"] * h["step_s"], 6) for h in result.history],
            "qkv_local": list(local.shape), "cross_kv_local": list(kv.shape),
            "placements": [str(p) for p in getattr(qkv, "placements", ())]}


def _has_2d_planner() -> bool:
    from gemzoo import registry

    return "sharding-2d" in registry.names("planner")


def _blocks_under_tp() -> dict:
    """sasrec's reference block (separate q, fused kv) and an hstu block (uvqk of four unequal parts, attn_norm
    over every head, relative bias) under their tp_plan on 2 ranks, against the whole blocks: output, input
    gradient and every parameter's gradient (made whole, in the model's row order)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from gemzoo import registry
    from gemzoo.distributed.dense import from_rank_rows, mark_rank_rows, parallelize_blocks, rank_rows
    from gemzoo.interfaces.attention import AttentionRequest
    from gemzoo.models.hstu import HSTUBlock
    from gemzoo.models.sasrec import SASRecReferenceBlock

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    offsets = torch.tensor([0, 3, 7])
    times = torch.tensor([0, 5, 5, 90, 1000, 1000, 4000])
    makers = {
        "sasrec": (lambda: SASRecReferenceBlock(16, 4, 4, 32, request=AttentionRequest(activation="softmax",
                   causal=True), dropout=0.0, attn_dropout=0.0, affine=True), "reference", {}),
        "hstu": (lambda: HSTUBlock(16, 4, 4, 6, 8, 0.0, relative_bias="position_time", time_buckets=8), "cpu",
                 {"times": times, "next_times": times + 30}),
    }
    out = {}
    for name, (make, kernel, extra) in makers.items():
        torch.manual_seed(0)
        blocks = [make() for _ in range(2)]
        if getattr(blocks[0], "rel_bias", None) is not None:
            blocks[0].rel_bias.reset_parameters()  # torch.empty until the model's init_weights
        for p in blocks[0].parameters():  # biases and norms away from their init, so their gradients count
            p.data.add_(torch.randn_like(p) * 0.1)
        blocks[1].load_state_dict(blocks[0].state_dict())
        for b in blocks:
            b.attn.set_kernel(kernel, registry.get("attention", kernel))
        holder = torch.nn.Module()
        holder.transformer_blocks = lambda blocks=blocks: [blocks[1]]
        mark_rank_rows(parallelize_blocks(holder, mesh["tp"], 2), 2)
        xs = [torch.randn(7, 16) for _ in range(1)] * 2
        xs = [x.clone().requires_grad_() for x in xs]
        ref, got = blocks[0](xs[0], offsets, 4, **extra), blocks[1](xs[1], offsets, 4, **extra)
        ref.square().sum().backward()
        got.square().sum().backward()
        g_ref, g_got = xs[0].grad, xs[1].grad
        worst = 0.0
        for (_pname, p), pr in zip(blocks[1].named_parameters(), blocks[0].parameters(), strict=True):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            g = from_rank_rows(g, *rank_rows(p)) if rank_rows(p) is not None else g
            worst = max(worst, float((g - pr.grad).abs().max() / pr.grad.abs().max()))
        out[name] = {"out": float((got - ref).abs().max()), "grad": float((g_got - g_ref).abs().max()),
                     "param_grads": worst, "dtensors": sum(isinstance(p, DTensor) for p in blocks[1].parameters())}
    return out


def _phases(rank: int, world: int, port: int, tmp: str) -> None:
    rank_env(rank, world, port, quiet=False)
    import torch.distributed as dist

    out = {}
    ck = lambda run: os.path.join(tmp, run, "checkpoints", "step-00000003")  # noqa: E731
    out["hsdp"] = _train(f"{tmp}/hsdp", [HSDP])
    out["hsdp_resumed"] = _train(f"{tmp}/hsdp_resumed", [HSDP], resume=ck("hsdp"))  # same layout: bit-exact
    out["tp"] = _train(f"{tmp}/tp", [TP])
    out["tp_from_hsdp"] = _train(f"{tmp}/tp_from_hsdp", [TP], resume=ck("hsdp"))
    out["hsdp_from_one"] = _train(f"{tmp}/hsdp_from_one", [HSDP], resume=ck("one"))
    out["hsdp_from_tp"] = _train(f"{tmp}/hsdp_from_tp", [HSDP], resume=ck("tp"))
    out["blocks_tp"] = _blocks_under_tp()
    out["tp_torchrec_tables"] = _train(f"{tmp}/tp_torchrec_tables", [*TABLES[:2], TP])  # torchrec's 1D sharding
    if _has_2d_planner():  # 5D: tables sharded 2D (G=2 x R=2) beside TP=2 x FSDP over shard=2
        out["tp_2d_tables"] = _train(f"{tmp}/tp_2d_tables", [*TABLES, TP])
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs()).max())


def _spawn_phases(tmp: str) -> list:
    """Every multi-rank phase on 4 spawned gloo ranks; their exit codes."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_phases, args=(r, 4, port, tmp)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=hang_guard(1200))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


@pytest.mark.multiprocess
def test_hsdp_and_tensor_parallel_match_one_process_and_checkpoints_move_between_layouts(tmp_path):
    """gem-tiny, 5 steps, the same global batch: HSDP (replicate=2 x shard=2) and TP=2 x DP=2 on 4 gloo ranks
    each match one process within 1e-5 relative; resuming HSDP is bit-exact; checkpoints written under HSDP, TP
    and one process resume under each other's layouts and continue the one-process run."""
    tmp = str(tmp_path)
    one = _train(f"{tmp}/one", [])
    codes = _spawn_phases(tmp)
    if any(c is not None and c < 0 for c in codes):
        # A rank killed by a signal is a native crash, not a failed check (those exit with 1). Once, in CI on the
        # 2-core machine (2026-12-02), a rank aborted with glibc's "malloc_consolidate(): invalid chunk size"
        # inside torch's gloo all-gather (DTensor.full_tensor while gathering a checkpoint's optimizer state);
        # the same test passed alone 3 times and in the other full runs. Run the phases once more; a second
        # crash, or any failed check, fails the test.
        print(f"ranks exited with {codes} (a native crash): running the phases once more", flush=True)
        for name in os.listdir(tmp):
            if name != "one":
                path = os.path.join(tmp, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        codes = _spawn_phases(tmp)
    assert codes == [0] * 4, f"ranks exited with {codes}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    got = ranks[0]
    assert all(r["hsdp"]["losses"] == got["hsdp"]["losses"] for r in ranks)  # one global loss on every rank
    ref = one["losses"]
    assert len(ref) == STEPS and one["qkv_local"] == [192, 64]
    assert _rel(got["hsdp"]["losses"], ref) < 1e-5, (got["hsdp"]["losses"], ref)
    assert _rel(got["tp"]["losses"], ref) < 1e-5, (got["tp"]["losses"], ref)
    # HSDP: qkv rows sharded over shard=2; TP=2 x FSDP over shard=2: each rank holds 1/4 of the rows
    assert got["hsdp"]["qkv_local"] == [96, 64] and got["tp"]["qkv_local"] == [48, 64]
    # the cross attention's fused kv (2 x 64 rows): whole under HSDP, split by TP=2 and then FSDP over shard=2
    assert one["cross_kv_local"] == got["hsdp"]["cross_kv_local"] == [128, 64]
    assert got["tp"]["cross_kv_local"] == [32, 64]
    assert len(got["tp"]["placements"]) == 3 and got["tp"]["placements"][-1] == "S(0)"  # (replicate, shard, tp)
    assert got["tp"]["samples"] == one["samples"]  # every sample counted once, not once per tp rank
    # resume under the same layout: bit-exact
    assert got["hsdp_resumed"]["first"] == 4
    assert got["hsdp_resumed"]["losses"] == got["hsdp"]["losses"][3:]
    # checkpoints move between layouts: HSDP -> TP, one process -> HSDP, TP -> HSDP, HSDP -> one process
    for name in ("tp_from_hsdp", "hsdp_from_one", "hsdp_from_tp"):
        assert got[name]["first"] == 4 and _rel(got[name]["losses"], ref[3:]) < 1e-5, (name, got[name], ref)
    # sasrec's and hstu's blocks under TP=2: the whole block's output and gradients
    for name, block in got["blocks_tp"].items():
        assert block["dtensors"] >= 6 and block["out"] < 1e-5 and block["grad"] < 1e-5, (name, block)
        assert block["param_grads"] < 1e-5, (name, block)
    tables = _train(f"{tmp}/one_tables", TABLES[:2])  # one process: whole tables
    # the tables sharded by torchrec over 4 ranks (fused Adagrad) beside TP=2 x FSDP over shard=2
    assert _rel(got["tp_torchrec_tables"]["losses"], tables["losses"]) < 1e-5, (got["tp_torchrec_tables"], tables)
    if _has_2d_planner():  # the whole 5D layout: 2D-sharded tables, TP and FSDP on the blocks
        assert _rel(got["tp_2d_tables"]["losses"], tables["losses"]) < 1e-5, (got["tp_2d_tables"], tables)
    for run in ("hsdp", "tp"):
        back = _train(f"{tmp}/one_from_{run}", [], resume=str(tmp_path / run / "checkpoints" / "step-00000003"))
        assert back["first"] == 4 and _rel(back["losses"], ref[3:]) < 1e-5, (run, back, ref)


# ---- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh,world,problem", [
    ({"replicate": 2, "shard": 3}, 4, r"replicate=2 x shard=3 x tp=1 = 6 ranks, but the world has 4"),
    ({"replicate": 3}, 4, r"replicate=3 does not divide the world of 4 ranks"),
    ({"replicate": 2, "shard": 2, "tp": 2}, 4, r"= 8 ranks, but the world has 4"),
    ({"tp": 2}, 1, r"tp=2 does not divide the world of 1 ranks"),
    ({"shard": 1, "tp": 2}, 1, r"replicate=1 x shard=1 x tp=2 = 2 ranks, but the world has 1"),
    ({"pp": 2}, 4, r"unknown dim 'pp'"),
    ({"tp": 0}, 4, r"tp = 0: sizes are integers >= 1"),
])
def test_a_mesh_that_does_not_fit_the_world_is_a_config_error(mesh, world, problem):
    from gemzoo.distributed.dense import dense_dims

    with pytest.raises(ConfigError, match=problem):
        dense_dims(mesh, world)


def test_mesh_defaults_fill_the_world():
    from gemzoo.distributed.dense import dense_dims

    assert dense_dims({}, 4) is None  # the default layout: run.dense_parallel over every rank
    assert dense_dims({"tp": 2}, 8) == {"replicate": 1, "shard": 4, "tp": 2}
    assert dense_dims({"replicate": 2, "tp": 2}, 4) == {"replicate": 2, "shard": 1, "tp": 2}


def _meta_model(overrides: list[str]):
    from gemzoo.config import load_config
    from gemzoo.train.trainer import build_on_meta

    return build_on_meta(load_config(CONFIG, overrides=overrides))


def test_tp_that_does_not_divide_the_heads_names_the_values():
    from gemzoo.distributed.dense import tensor_parallel_plans

    model = _meta_model(["model.num_heads=2"])
    with pytest.raises(ConfigError, match=r"tp=4 does not divide the attention heads: tower\.blocks\.0\.attn has "
                                          r"num_heads=2; choose tp among 1, 2"):
        tensor_parallel_plans(model, 4)
    with pytest.raises(ConfigError, match=r"tp=4 does not divide the attention heads"):  # gemzoo config validate
        _meta_model(["model.num_heads=2", "run.mesh={tp=4}"])
    plans = tensor_parallel_plans(model, 2)
    assert [n for n, _, _ in plans] == ["tower.blocks.0", "tower.blocks.1", "cross", "interaction"]
    assert plans[2][2] == {"q": ("colwise", 1), "kv": ("colwise", 2), "out": ("rowwise", 1)}
    assert plans[3][2] == {"layers.0": ("colwise", 1), "layers.1": ("rowwise", 1)}
    assert plans[0][2] == {"attn.qkv": ("colwise", 3), "attn.out": ("rowwise", 1), "mlp.fc1": ("colwise", 1),
                           "mlp.fc2": ("rowwise", 1)}


def test_tp_needs_plain_linears_and_a_block_plan():
    from gemzoo.distributed.dense import tensor_parallel_plans

    with pytest.raises(ConfigError, match=r"tower\.blocks\.0\.attn\.qkv is a FP8RowwiseLinear, not an nn.Linear "
                                          r"or BF16Linear.*\"fp32\" or \"bf16\""):
        tensor_parallel_plans(_meta_model(["plugins.precision='fp8-rowwise'"]), 2)
    assert len(tensor_parallel_plans(_meta_model(["plugins.precision='bf16'"]), 2)) == 4  # bf16 linears split
    hstu = os.path.join(ROOT, "configs", "hstu-ml1m.toml")
    from gemzoo import registry
    from gemzoo.config import load_config

    cfg = load_config(hstu, overrides=["model.num_heads=2"])  # (1 head in the ML-1M config)
    spec = registry.get("model", cfg.model.family)
    with torch.device("meta"):
        model = spec.build(cfg.model, {"num_items": 100, "max_len": 16, "task": "retrieval", "timestamps": True})
    plan = tensor_parallel_plans(model, 2)[0][2]  # hstu: uvqk's four parts split by heads, attn_norm's statistics
    h, v = model.blocks[0].num_heads, model.blocks[0].v_dim
    assert plan["uvqk"] == ("colwise", (h * v,) * 4) and plan["attn_norm"] == ("layernorm", 1)

    class Block(torch.nn.Module):
        is_transformer_block = True

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

    with pytest.raises(ConfigError, match=r"Block\) declares no tensor-parallel plan.*tp = 1"):
        tensor_parallel_plans(torch.nn.Sequential(Block()), 2)


def test_mesh_with_ddp_and_bad_tables_are_config_errors():
    from gemzoo.config import load_config

    with pytest.raises(ConfigError, match=r"run.mesh .* drop run.dense_parallel = \"ddp\""):
        load_config(CONFIG, overrides=[HSDP, "run.dense_parallel='ddp'"])
    with pytest.raises(ConfigError, match=r"run.mesh must be a table"):
        load_config(CONFIG, overrides=["run.mesh=4"])
    assert load_config(CONFIG).run.mesh == {}  # the default: run.dense_parallel over every rank, as before


def test_fused_rows_in_rank_order_round_trip():
    from gemzoo.distributed.dense import from_rank_rows, to_rank_rows

    w = torch.arange(3 * 4 * 2).reshape(3 * 4, 2)  # q | k | v, 4 rows each (2 heads of 2)
    ranked = to_rank_rows(w, 3, 2)
    # rank 0's half: q rows 0-1, k rows 4-5, v rows 8-9; rank 1's: q 2-3, k 6-7, v 10-11
    assert ranked[:, 0].tolist() == [0, 2, 8, 10, 16, 18, 4, 6, 12, 14, 20, 22]
    assert torch.equal(from_rank_rows(ranked, 3, 2), w)
    uneven = torch.arange(12).reshape(12, 1)  # parts of 4, 4, 2, 2 rows (hstu's u | v | q | k)
    ranked = to_rank_rows(uneven, (4, 4, 2, 2), 2)
    assert ranked[:, 0].tolist() == [0, 1, 4, 5, 8, 10, 2, 3, 6, 7, 9, 11]
    assert torch.equal(from_rank_rows(ranked, (4, 4, 2, 2), 2), uneven)

