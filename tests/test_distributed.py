"""Multi-rank behaviour on gloo: data-parallel training keeps replicas identical."""

import copy
import math
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from gemzoo.testing import skip_unless_torchrec
from gemzoo.testing.comms import rank_env
from gemzoo.testing.timeouts import hang_guard

SUPPORT = os.path.join(os.path.dirname(__file__), "support")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rank(rank: int, world: int, port: int, tmp: str) -> None:
    rank_env(rank, world, port, quiet=False)
    sys.path.insert(0, SUPPORT)
    import torch.distributed as dist
    from toy_plugin import TOY_CONFIG, install

    import gemzoo
    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    built = {}

    class CaptureModel:  # a lifecycle-hook plugin: keeps the assembled model for inspection
        @gemzoo.hookimpl
        def gemzoo_model_built(self, model, config):
            built["model"] = model

    install(registry)
    registry.host().register(CaptureModel(), name="capture-model")
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=os.path.join(tmp, "run"), steps=12)
    train(load_config(raw=raw), progress=False)
    flat = torch.cat([p.detach().reshape(-1) for p in built["model"].parameters()])
    torch.save(flat, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2])
def test_data_parallel_replicas_stay_identical(tmp_path, world):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_train_rank, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=hang_guard(900))
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    params = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert torch.isfinite(params[0]).all()
    for other in params[1:]:
        torch.testing.assert_close(other, params[0], rtol=0, atol=0)
    assert (tmp_path / "run" / "metrics.jsonl").exists()  # rank 0 logs


def _gem_rank(rank: int, world: int, port: int, tmp: str, steps: int, resume: bool, dense: str = "fsdp",
              sharding: str = "table_wise") -> None:
    rank_env(rank, world, port, quiet=False)
    import json

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import gemzoo
    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    built = {}

    class CaptureModel:
        @gemzoo.hookimpl
        def gemzoo_model_built(self, model, config):
            built["model"] = model

    registry.host().register(CaptureModel(), name="capture-model")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "gem-tiny.toml"),
                      overrides=[f"run.steps={steps}", "eval.every=0", "checkpoint.every=2", f"run.out_dir='{tmp}/run'",
                                 f"plugins.options.torchrec.sharding_types=['{sharding}']",
                                 f"run.dense_parallel='{dense}'"])
    result = train(cfg, resume=resume, progress=False)
    fsdp = sum(isinstance(p, DTensor) for p in built["model"].parameters())
    with open(os.path.join(tmp, f"gem-rank{rank}-{steps}-{dense}.json"), "w") as f:
        json.dump({"loss": result.final_loss, "first_step": result.history[0]["step"], "dtensor_params": fsdp,
                   "losses": [h["loss"] for h in result.history]}, f)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(target, world, *args):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=hang_guard(900))
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_gem_with_sharded_tables_trains_checkpoints_and_resumes(tmp_path, sharding):
    """gem-tiny on 2 gloo ranks, tables sharded by the torchrec planner (fused Adagrad)."""
    skip_unless_torchrec()
    import json

    from gemzoo.train import checkpoint as ckpt

    _spawn(_gem_rank, 2, str(tmp_path), 4, False, "fsdp", sharding)
    saved = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in saved] == ["step-00000002", "step-00000004"]
    state = ckpt.load_checkpoint(saved[-1])
    assert any(k.endswith("weight") and v.shape[0] == 1000 for k, v in state["model"].items())  # full tables
    assert (saved[-1] / ckpt.PLANNER_FILE).is_file()  # the planner's own state, beside the model's
    fused = {k: v for k, v in state["planner"].items() if k.endswith("momentum1")}
    assert fused and all(v.abs().sum() > 0 for v in fused.values())  # the tables' Adagrad accumulators
    _spawn(_gem_rank, 2, str(tmp_path), 6, True, "fsdp", sharding)
    _spawn(_gem_rank, 2, str(tmp_path / "straight"), 6, False, "fsdp", sharding)
    straight = json.loads((tmp_path / "straight" / "gem-rank0-6-fsdp.json").read_text())
    for rank in range(2):
        out = json.loads((tmp_path / f"gem-rank{rank}-6-fsdp.json").read_text())
        assert out["first_step"] == 5 and math.isfinite(out["loss"])  # resumed after step 4
        assert out["dtensor_params"] > 0  # transformer blocks are FSDP2-sharded
    # resuming restores everything, the fused table optimizers included: steps 5-6 match a straight run
    resumed = json.loads((tmp_path / "gem-rank0-6-fsdp.json").read_text())
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][4:]), rtol=0, atol=0)


@pytest.mark.multiprocess
def test_fsdp_and_replicated_dense_parts_train_alike(tmp_path):
    """FSDP2 on the transformer blocks computes the same steps as plain data parallelism."""
    skip_unless_torchrec()
    import json

    _spawn(_gem_rank, 2, str(tmp_path / "fsdp"), 3, False, "fsdp")
    _spawn(_gem_rank, 2, str(tmp_path / "ddp"), 3, False, "ddp")
    fsdp = json.loads((tmp_path / "fsdp" / "gem-rank0-3-fsdp.json").read_text())
    ddp = json.loads((tmp_path / "ddp" / "gem-rank0-3-ddp.json").read_text())
    assert fsdp["dtensor_params"] > 0 and ddp["dtensor_params"] == 0
    torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(ddp["losses"]), rtol=1e-4, atol=1e-5)


def _logging_rank(rank: int, world: int, port: int, tmp: str) -> None:
    import json

    rank_env(rank, world, port, quiet=False)
    sys.path.insert(0, SUPPORT)
    import torch.distributed as dist
    from toy_plugin import TOY_CONFIG, install

    import gemzoo
    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    seen = []

    class Record:
        @gemzoo.hookimpl
        def gemzoo_step_end(self, trainer, step, metrics):
            seen.append({"loss": metrics["loss"], "samples": metrics["samples_per_s"] * metrics["step_s"]})

    install(registry)
    registry.host().register(Record(), name="record")
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=os.path.join(tmp, "run"), steps=4, log_every=1)
    raw["eval"].update(every=0)
    result = train(load_config(raw=raw), progress=False)
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": seen, "is_main": getattr(result, "is_main", None), "batch_size": load_config(raw=raw).data.batch_size}, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_log_the_global_loss_and_throughput(tmp_path):
    """Several ranks log global numbers: one loss for the step (the mean over ranks), every rank's samples."""
    import json

    _spawn(_logging_rank, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["loss"] for s in ranks[0]["steps"]] == [s["loss"] for s in ranks[1]["steps"]]  # one global loss
    for s in ranks[0]["steps"]:
        assert s["samples"] == pytest.approx(ranks[0]["batch_size"])  # both ranks' samples, not rank 0's half
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    start = rows[0]
    assert start["event"] == "start" and start["world_size"] == 2 and start["mesh"] == {"shape": [2], "dims": ["dp"]}
    assert [r["loss"] for r in rows if "loss" in r] == [s["loss"] for s in ranks[0]["steps"]]
    assert [r["is_main"] for r in ranks] == [True, False]  # rank 0 prints the summary


def _host_group_rank(rank: int, world: int, port: int, tmp: str) -> None:
    """A gloo group for host numbers beside the default group (what an NCCL run gets), and a toy run that
    reduces its loss terms, stop requests and metrics over it under run.sync = "log"."""
    import json

    rank_env(rank, world, port, quiet=False)
    sys.path.insert(0, SUPPORT)
    import torch.distributed as dist
    from toy_plugin import TOY_CONFIG, install

    import gemzoo.distributed as gd
    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.metrics import reduce_across_ranks
    from gemzoo.train.trainer import train

    dist.init_process_group("gloo")
    comms = registry.get("comms", "torch")
    assert gd.host_group_for(comms) is None  # the default group runs CPU tensors on the CPU transport already
    group = gd.host_group_for(comms, force=True)  # what an NCCL default group gets: a gloo group of its own
    got = reduce_across_ranks({"a": float(rank), "b": 1.0}, "sum", torch.device("cpu"), group)
    install(registry)
    losses = {}
    for name, force in (("default", False), ("own", True)):
        plain = gd.host_group_for
        gd.host_group_for = lambda comms, force=force, plain=plain: plain(comms, force=force)
        raw = copy.deepcopy(TOY_CONFIG)
        raw["run"].update(out_dir=os.path.join(tmp, name), steps=6, sync="log")
        try:
            losses[name] = [h["loss"] for h in train(load_config(raw=raw), progress=False).history]
        finally:
            gd.host_group_for = plain
    with open(os.path.join(tmp, f"host{rank}.json"), "w") as f:
        json.dump({"reduced": got, "losses": losses}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_the_cpu_backend_of_a_default_group():
    import gemzoo.distributed as gd

    assert gd.cpu_backend("gloo") == "gloo" and gd.cpu_backend("nccl") == "nccl"
    assert gd.cpu_backend("cpu:gloo,cuda:nccl") == "gloo" and gd.cpu_backend("cuda:nccl") == "cuda:nccl"


@pytest.mark.multiprocess
def test_host_numbers_reduce_over_a_gloo_group_of_their_own(tmp_path):
    import json

    _spawn(_host_group_rank, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"host{r}.json").read_text()) for r in range(2)]
    assert all(r["reduced"] == {"a": 1.0, "b": 2.0} for r in ranks)
    assert ranks[0]["losses"]["own"] == ranks[0]["losses"]["default"] == ranks[1]["losses"]["own"]
    assert len(ranks[0]["losses"]["own"]) == 6


def _mesh_rank(rank: int, world: int, port: int, tmp: str) -> None:
    import json

    rank_env(rank, world, port, quiet=False)
    import torch.distributed as dist

    from gemzoo.distributed import World, all_reduce_gradients, build_mesh

    dist.init_process_group("gloo")
    world_ = build_mesh(World(rank, world), "cpu", {"replica": 2, "shard": 2})
    mesh = world_.mesh
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), float(rank))
    all_reduce_gradients([p], world_)  # over dp: every rank
    shard = torch.tensor([float(rank)])
    dist.all_reduce(shard, group=mesh.get_group("shard"))
    with open(os.path.join(tmp, f"mesh{rank}.json"), "w") as f:
        json.dump({"dims": list(mesh.mesh_dim_names), "shape": list(mesh.mesh.shape), "dp": world_.dp_mesh.size(),
                   "dp_name": list(world_.dp_mesh.mesh_dim_names), "grad": p.grad.tolist(), "shard_sum": shard.item()},
                  f)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it (SIGABRT in CI once)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_planner_mesh_dims_build_one_nd_mesh_with_dp_across_them(tmp_path):
    """4 gloo ranks, a planner's {"replica": 2, "shard": 2}: one 2-D mesh; dense dp flattened over both dims."""
    import json

    _spawn(_mesh_rank, 4, str(tmp_path))
    for rank in range(4):
        out = json.loads((tmp_path / f"mesh{rank}.json").read_text())
        assert out["dims"] == ["replica", "shard"] and out["shape"] == [2, 2]
        assert out["dp"] == 4 and out["dp_name"] == ["dp"] and out["grad"] == [1.5] * 3  # mean of ranks 0..3
        assert out["shard_sum"] == (1.0 if rank < 2 else 5.0)  # shard groups {0, 1} and {2, 3}


@pytest.mark.parametrize("dims,problem", [
    ({"replica": 3, "shard": 2}, "= 6 ranks, but the world has 4"),
    ({}, "non-empty"),
    ({"shard": 0}, "positive integers"),
    ({"dp": 2, "shard": 2}, "rename the planner's own"),
    ({"two words": 4}, "identifiers"),
])
def test_mesh_dims_that_do_not_fit_the_world_are_config_errors(dims, problem):
    from gemzoo.distributed import check_mesh_dims
    from gemzoo.errors import ConfigError

    with pytest.raises(ConfigError, match=problem):
        check_mesh_dims(dims, 4)


def test_one_rank_checks_the_dims_and_builds_no_mesh():
    from gemzoo.distributed import World, build_mesh
    from gemzoo.errors import ConfigError

    assert build_mesh(World(), "cpu", {"dp": 1}).mesh is None
    with pytest.raises(ConfigError, match="tensor parallelism"):
        build_mesh(World(), "cpu", {"dp": 1}, dense={"dp": 1, "tp": 2})
    with pytest.raises(ConfigError, match="= 2 ranks, but the world has 1"):
        build_mesh(World(), "cpu", {"replica": 2, "shard": 1})


def test_more_ranks_than_gpus_names_the_fix(monkeypatch):
    """Two ranks on a one-GPU node: rank 1 would ask for cuda:1 and fail deep inside CUDA (or hang rank 0)."""
    from gemzoo.distributed import World, pick_device
    from gemzoo.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 1 .* 1 GPU\(s\).*nproc-per-node 1.*run.device"):
        pick_device("auto", World(rank=1, world_size=2, local_rank=1))


def test_cuda_without_a_gpu_is_refused_before_the_process_group_starts(monkeypatch):
    """Under torchrun with run.device = "cuda" on a machine without GPUs, NCCL would fail on every rank with a
    traceback; the ConfigError comes first and no process group is started."""
    import torch.distributed as dist

    from gemzoo.distributed import init_distributed
    from gemzoo.errors import ConfigError

    class Comms:  # fails the test if the process group were about to start
        def install(self):
            raise AssertionError("the process group was started")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"no GPU is visible; set run.device"):
        init_distributed(Comms(), "cuda")
    assert not dist.is_initialized()


def test_clip_grad_norm_matches_torch_on_cpu_and_cuda():
    """gemzoo's clip (plain tensors and DTensors; foreach kernels for plain CUDA gradients) against torch's."""
    from gemzoo.distributed import clip_grad_norm

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        gen = torch.Generator().manual_seed(0)
        ours = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((7, 3), (11,), (2, 2, 5))]
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen).to(device)
            b.grad = a.grad.clone()
        theirs[1].grad = ours[1].grad = None  # a parameter without a gradient is skipped
        total = clip_grad_norm(ours, 0.5)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        assert torch.allclose(total, expected, rtol=1e-6), device
        for a, b in zip(ours, theirs, strict=True):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7), device
