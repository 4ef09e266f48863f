"""Planner conformance: plan, shard, train one step, state_dict round trip.

``check_planner_local``: one process. ``plan(tables, Topology(1, "cpu"))`` then ``shard`` keep every state-dict
name; a forward+backward+step trains; the state dict loads into a second sharded model, which then gives the
same loss bit for bit.

``check_planner_on_gloo``: ``world`` gloo ranks run the trainer on a small gem config with the planner
selected: 2 steps with a checkpoint after each, then a second trainer resumes from step 1 and must reproduce
step 2's loss bit for bit (the planner's sharded state and the tables' optimizer state came back).

    from gemzoo.testing.planner import check_planner_local, check_planner_on_gloo
    def test_conformance(tmp_path):
        check_planner_local(MY_PLANNER)
        check_planner_on_gloo("my-planner", tmp_path)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from gemzoo.interfaces.planner import Topology
from gemzoo.testing.comms import rank_env, spawn
from gemzoo.testing.memory import tiny_model


def _loss(model, batch) -> torch.Tensor:
    return model(batch).loss


def check_planner_local(planner, *, seed: int = 0) -> None:
    name = type(planner).__name__
    model, batch = tiny_model(seed, d_model=16, batch_size=8)
    names = set(model.state_dict())
    plan = planner.plan(model.embedding_tables(), Topology(1, "cpu"))
    model = planner.shard(model, plan, None)
    assert set(model.state_dict()) == names, f"{name}.shard renamed state-dict entries on one process"
    loss = _loss(model, batch)
    assert torch.isfinite(loss)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    assert params, f"{name}: no parameter got a gradient after shard"
    before = [p.detach().clone() for p in params]
    torch.optim.SGD(params, lr=0.1).step()
    assert any(not torch.equal(b, p) for b, p in zip(before, params)), f"{name}: the step changed nothing"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    other, _ = tiny_model(seed + 1, d_model=16, batch_size=8)
    other = planner.shard(other, planner.plan(other.embedding_tables(), Topology(1, "cpu")), None)
    missing, unexpected = other.load_state_dict(state)
    assert not missing and not unexpected, f"{name}: state_dict round trip: missing {missing}, unexpected {unexpected}"
    with torch.no_grad():
        a, b = _loss(model, batch), _loss(other, batch)
    assert torch.equal(a, b), f"{name}: the reloaded model gives loss {b.item()}, the saved one {a.item()}"


def _overrides(planner_name: str, out: str, steps: int) -> list[str]:
    return [f"run.steps={steps}", "eval.every=0", "checkpoint.every=1", "checkpoint.keep=3", f"run.out_dir='{out}'",
            f"plugins.planner='{planner_name}'", "data.batch_size=8", "data.max_len=24", "data.median_len=8",
            "data.max_candidates=4", "data.sparse_table_size=64", "model.d_model=16", "model.num_layers=1",
            "model.embedding_dim=8", "model.mlp_dims=[16, 8]", "run.dense_parallel='ddp'", "run.log_every=1"]


def planner_rank(rank: int, world: int, port: int, planner_name: str, tmp: str, config: str) -> None:
    rank_env(rank, world, port)
    import torch.distributed as dist

    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    torch.set_num_threads(1)
    first = train(load_config(config, overrides=_overrides(planner_name, f"{tmp}/run", 2)), progress=False)
    resumed = train(load_config(config, overrides=_overrides(planner_name, f"{tmp}/resumed", 2)),
                    resume=f"{tmp}/run/checkpoints/step-00000001", progress=False)
    Path(tmp, f"planner{rank}.json").write_text(json.dumps(
        {"losses": [h["loss"] for h in first.history], "resumed": [h["loss"] for h in resumed.history]}))
    dist.barrier()
    dist.destroy_process_group()


def check_planner_on_gloo(planner_name: str, tmp_path, *, world: int = 2, config: str | None = None) -> dict:
    """Spawn ``world`` ranks (see the module docstring); returns rank 0's losses."""
    config = config or str(Path(__file__).resolve().parents[2] / "configs" / "gem-tiny.toml")
    if not os.path.exists(config):
        raise FileNotFoundError(f"{config}: pass config= a gem config (gemzoo's configs/gem-tiny.toml)")
    spawn(planner_rank, world, planner_name, str(tmp_path), config)
    out = [json.loads(Path(tmp_path, f"planner{r}.json").read_text()) for r in range(world)]
    for r, o in enumerate(out):
        assert len(o["losses"]) == 2 and len(o["resumed"]) == 1, o
        assert o["resumed"][0] == o["losses"][1], (
            f"planner {planner_name!r} rank {r}: step 2 after resuming from step 1 gives loss {o['resumed'][0]!r}, "
            f"the straight run {o['losses'][1]!r}")
    assert all(o["losses"] == out[0]["losses"] for o in out), "ranks log different global losses"
    return out[0]
