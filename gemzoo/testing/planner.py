"""Planner conformance: the mesh request, plan, optimizer, shard, one train step, state round trip.

``check_planner_local``: one process. ``mesh_dims`` fits a one-rank world; ``plan`` then ``attach_optimizer``
then ``shard`` keep every state-dict name; ``replicated_parameters`` are the model's own trainable parameters;
a forward+backward+step (+ ``sync``) trains; the whole state (``gemzoo.distributed.state`` for the model,
``state_dict`` for the planner's own) loads into a second sharded model, which then gives the same loss bit for
bit and the same planner state.

``check_planner_protocol_on_gloo``: the same protocol on ``world`` gloo ranks, one call at a time as the trainer
makes them: the mesh with the planner's dims (``gemzoo.distributed.build_mesh``), plan, fused optimizer, shard,
one step with the replicated gradients averaged over ``dp``, ``sync``; then a checkpoint written by rank 0 and
loaded by every rank into a second model with other weights: every rank's loss, and the gathered state, equal
the first model's bit for bit.

``check_planner_on_gloo``: ``world`` gloo ranks run the trainer on a small gem config with the planner
selected: 2 steps with a checkpoint after each, then a second trainer resumes from step 1 and must reproduce
step 2's loss bit for bit (the planner's sharded state and the tables' optimizer state came back).

    from gemzoo.testing.planner import check_planner_local, check_planner_on_gloo, check_planner_protocol_on_gloo
    def test_conformance(tmp_path):
        check_planner_local(MY_PLANNER)
        check_planner_protocol_on_gloo(MY_PLANNER, tmp_path / "protocol")
        check_planner_on_gloo("my-planner", tmp_path / "trainer")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from gemzoo.config import load_config
from gemzoo.distributed import World, all_reduce_gradients, build_mesh, check_mesh_dims
from gemzoo.distributed import state as dstate
from gemzoo.interfaces.planner import SparseOptimizer, Topology
from gemzoo.testing.comms import rank_env, spawn
from gemzoo.testing.memory import tiny_model

SPARSE = SparseOptimizer(lr=0.05)


def _loss(model, batch) -> torch.Tensor:
    return model(batch).loss


def _placed(planner, world: World, seed: int, device_type: str = "cpu"):
    """(model, batch, plan): a tiny gem model with its tables placed by ``planner``, as the trainer places them."""
    model, batch = tiny_model(seed, d_model=16, batch_size=8)
    topology = Topology(world.world_size, device_type)
    plan = planner.plan(model.embedding_tables(), topology)
    planner.attach_optimizer(model, plan, SPARSE)
    return planner.shard(model, plan, world.mesh), batch, plan


def _step(planner, model, world: World, batch, name: str) -> None:
    """One training step as the trainer takes it; the step must change the model (checked on rank 0)."""
    before = {k: v.detach().clone() for k, v in dstate.gather_full_state(model.state_dict(), world.is_main).items()}
    replicated = planner.replicated_parameters(model)
    own = {id(p) for p in model.parameters()}
    assert all(id(p) in own for p in replicated), f"{name}.replicated_parameters lists tensors that are not the model's"
    assert all(p.requires_grad for p in replicated), f"{name}.replicated_parameters lists frozen parameters"
    loss = _loss(model, batch)
    assert torch.isfinite(loss), f"{name}: loss {loss.item()} after shard"
    loss.backward()
    all_reduce_gradients(replicated, world)
    torch.optim.SGD(replicated, lr=0.1).step()
    planner.sync(model, 0)
    after = dstate.gather_full_state(model.state_dict(), world.is_main)
    if world.is_main:
        assert any(not torch.equal(before[k], after[k]) for k in before), f"{name}: the step changed nothing"
        frozen = [k for k in before if k.startswith("sparse_arch.") and torch.equal(before[k], after[k])]
        assert not frozen, (f"{name}: the step left tables {frozen} unchanged: neither a fused optimizer, nor "
                            "replicated_parameters (the trainer's), nor sync updates them")


def check_planner_local(planner, *, seed: int = 0) -> None:
    name = type(planner).__name__
    dims = planner.mesh_dims(Topology(1, "cpu"))
    check_mesh_dims(dims, 1, f"{name}.mesh_dims")
    names = set(tiny_model(seed, d_model=16, batch_size=8)[0].state_dict())
    model, batch, _ = _placed(planner, World(), seed)
    assert set(model.state_dict()) == names, f"{name}.shard renamed state-dict entries on one process"
    _step(planner, model, World(), batch, name)
    full = {k: v.detach().clone() for k, v in dstate.gather_full_state(model.state_dict(), True).items()}
    own = {k: v.detach().clone() for k, v in planner.state_dict(model).items()}
    other, _, _ = _placed(planner, World(), seed + 1)
    missing, unexpected = dstate.load_full_state(other, full)
    assert not missing and not unexpected, f"{name}: state_dict round trip: missing {missing}, unexpected {unexpected}"
    lost = planner.load_state_dict(other, own)
    assert not lost, f"{name}.load_state_dict: its own state_dict lacks {lost[:5]}"
    again = planner.state_dict(other)
    assert set(again) == set(own) and all(torch.equal(again[k], own[k]) for k in own), (
        f"{name}: state_dict after load_state_dict differs from the state loaded")
    with torch.no_grad():
        a, b = _loss(model, batch), _loss(other, batch)
    assert torch.equal(a, b), f"{name}: the reloaded model gives loss {b.item()}, the saved one {a.item()}"


def protocol_rank(rank: int, world_size: int, port: int, planner, tmp: str, env: dict) -> None:
    rank_env(rank, world_size, port)
    os.environ.update(env)
    import torch.distributed as dist

    from gemzoo.train import checkpoint as ckpt  # training layer: `import gemzoo.testing` must not load it

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    name = type(planner).__name__
    world = World(dist.get_rank(), dist.get_world_size())
    dims = planner.mesh_dims(Topology(world_size, "cpu"))
    build_mesh(world, "cpu", dims)
    assert tuple(world.mesh.mesh_dim_names) == tuple(dims) and world.dp_mesh.size() == world_size
    model, batch, plan = _placed(planner, world, 0)
    _step(planner, model, world, batch, name)  # every rank the same batch, so the replicas stay equal
    full = dstate.gather_full_state(model.state_dict(), world.is_main)
    own = planner.state_dict(model)
    if world.is_main:
        ckpt.save_checkpoint(Path(tmp, "checkpoints"), 1, model_state=full, optimizers={}, planner_state=own,
                             manifest={})
    dist.barrier()
    saved = ckpt.load_checkpoint(Path(tmp, "checkpoints", "step-00000001"))
    other, _, _ = _placed(planner, world, 1)
    missing, unexpected = dstate.load_full_state(other, saved["model"])
    lost = planner.load_state_dict(other, saved["planner"])
    again_full = dstate.gather_full_state(other.state_dict(), world.is_main)
    again_own = planner.state_dict(other)
    probe = tiny_model(100 + rank, d_model=16, batch_size=8)[1]  # each rank its own batch
    with torch.no_grad():
        a, b = _loss(model, probe), _loss(other, probe)
    same_state = (set(again_full) == set(saved["model"]) and all(torch.equal(again_full[k], saved["model"][k])
                                                                 for k in again_full)
                  and set(again_own) == set(saved["planner"])
                  and all(torch.equal(again_own[k], saved["planner"][k]) for k in again_own)) if world.is_main else True
    Path(tmp, f"protocol{rank}.json").write_text(json.dumps({
        "sharded": plan is not None, "missing": missing, "unexpected": unexpected, "lost": lost,
        "loss": a.item(), "reloaded": b.item(), "same_state": same_state, "planner_keys": len(saved["planner"])}))
    dist.barrier()
    dist.destroy_process_group()


def check_planner_protocol_on_gloo(planner, tmp_path, *, world: int = 2, env: dict | None = None) -> list[dict]:
    """Spawn ``world`` ranks running the planner's protocol (see the module docstring); ``env``: variables set
    in each rank first (e.g. ``{"GEMZOO_NO_TORCHREC": "1"}``). Returns every rank's report."""
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    spawn(protocol_rank, world, planner, str(tmp_path), dict(env or {}))
    name = type(planner).__name__
    out = [json.loads(Path(tmp_path, f"protocol{r}.json").read_text()) for r in range(world)]
    for r, o in enumerate(out):
        assert not o["missing"] and not o["unexpected"], f"{name} rank {r}: model state round trip {o}"
        assert not o["lost"], f"{name} rank {r}: load_state_dict found no saved value for {o['lost'][:5]}"
        assert o["reloaded"] == o["loss"], (f"{name} rank {r}: the reloaded model gives loss {o['reloaded']!r}, "
                                            f"the saved one {o['loss']!r}")
        assert o["same_state"], f"{name}: the state gathered after loading differs from the checkpoint's"
    return out


def _overrides(planner_name: str, out: str, steps: int) -> list[str]:
    return [f"run.steps={steps}", "eval.every=0", "checkpoint.every=1", "checkpoint.keep=3", f"run.out_dir='{out}'",
            f"plugins.planner='{planner_name}'", "data.batch_size=8", "data.max_len=24", "data.median_len=8",
            "data.max_candidates=4", "data.sparse_table_size=64", "model.d_model=16", "model.num_layers=1",
            "model.embedding_dim=8", "model.mlp_dims=[16, 8]", "run.dense_parallel='ddp'", "run.log_every=1"]


def planner_rank(rank: int, world: int, port: int, planner_name: str, tmp: str, config: str) -> None:
    rank_env(rank, world, port)
    import torch.distributed as dist

    from gemzoo.train.trainer import train  # training layer: `import gemzoo.testing` must not build the trainer

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
