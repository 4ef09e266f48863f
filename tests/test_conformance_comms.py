"""Comms conformance over every registered backend (gemzoo.testing.comms) plus a toy third-party backend with
its own c10d name and per-dimension groups, on 2 gloo ranks; the trainer reaches collectives only through
process groups."""

import copy
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import gemzoo
from gemzoo.errors import PluginError
from gemzoo.interfaces.comms import COLLECTIVES, CommsCapabilities, dim_backends
from gemzoo.testing.comms import BASE_COLLECTIVES, check_comms_on_gloo, compare, spawn

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = str(ROOT / "tests" / "support")


def _say_cuda_env(rank, world, port, out):
    Path(out, f"env{rank}.json").write_text(json.dumps(os.environ.get("CUDA_VISIBLE_DEVICES")))


@pytest.mark.multiprocess
def test_spawn_can_hide_cuda_from_the_ranks(tmp_path, monkeypatch):
    """The comms suite's ranks are CPU ranks on a GPU machine too: spawned with CUDA_VISIBLE_DEVICES="" (with a
    GPU visible, ncclx's ranks would share one GPU's NCCL group); the caller's environment is left as it was."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    spawn(_say_cuda_env, 2, str(tmp_path), hide_cuda=True)
    assert [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(2)] == ["", ""]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    spawn(_say_cuda_env, 1, str(tmp_path), hide_cuda=True)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.multiprocess
def test_every_backend_gives_c10d_answers(tmp_path):
    from toy_kinds import ToyGlooComms

    names = gemzoo.registry.names("comms")
    assert "torch" in names
    backends = {**{n: None for n in names}, "toy-gloo": ToyGlooComms()}
    summary = check_comms_on_gloo(backends, tmp_path)  # one spawn for all backends: gloo start-up is slow
    for name in backends:
        assert set(summary[name]["checked"]) == set(BASE_COLLECTIVES) | set(summary[name]["claimed"]), name
    assert summary["toy-gloo"]["claimed"] == ["all_reduce", "all_to_all_single"]
    assert summary["toy-gloo"]["meshes"] == {"2": {"dp": "toygloo"}, "2x1": {"replica": "toygloo", "shard": "gloo"},
                                             "1x2": {"replica": "toygloo", "shard": "gloo"}}
    assert summary["torch"]["meshes"]["1x2"] == {"replica": "gloo", "shard": "gloo"}


def _train_rank(rank: int, world: int, port: int, tmp: str) -> None:
    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    sys.path.insert(0, SUPPORT)
    import torch.distributed as dist
    import toy_kinds
    from toy_plugin import TOY_CONFIG, install

    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    install(registry)
    registry.host().register(toy_kinds, name="toy-kinds")
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=os.path.join(tmp, "run"), steps=2)
    raw["eval"].update(every=0)
    raw["checkpoint"].update(every=2)
    raw["plugins"] = {"comms": "toy-gloo"}
    train(load_config(raw=raw), progress=False)
    Path(tmp, f"backend{rank}.txt").write_text(str(dist.get_backend()))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_the_trainer_runs_on_a_backend_it_knows_only_by_its_groups(tmp_path):
    """2 ranks train, checkpoint and log through 'toygloo', a c10d name nothing in gemzoo spells: the default
    group and the mesh's run it, and the start row logs the backend's sm_free, claims and groups."""
    spawn(_train_rank, 2, str(tmp_path))
    assert [Path(tmp_path, f"backend{r}.txt").read_text() for r in range(2)] == ["toygloo"] * 2
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["comms"] == {"name": "toy-gloo", "sm_free": False, "implements": ["all_reduce", "all_to_all_single"],
                              "groups": {"dp": "toygloo"}}


def test_one_process_run_logs_the_backend(tmp_path):
    from gemzoo.distributed.comms_groups import comms_summary

    torch_comms = gemzoo.registry.get("comms", "torch")
    assert comms_summary("torch", torch_comms) == {"name": "torch", "sm_free": False, "implements": []}


def test_no_core_code_asks_for_a_backend_by_name():
    """Collectives reach the backend through process groups: outside the comms backends themselves and the
    test suites, no gemzoo module names a c10d backend or passes one to new_group / init_process_group."""
    allowed = {"gemzoo/builtin/comms.py"}
    pattern = re.compile(r"""backend\s*=\s*["'](gloo|nccl|mpi|ucc|xccl)["']|["'](nccl|gloo)["']""")
    hits = []
    for path in sorted((ROOT / "gemzoo").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed or rel.startswith("gemzoo/testing/"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                hits.append(f"{rel}:{i}: {line.strip()}")
    assert not hits, "use the process groups (default group, DeviceMesh), not a backend name:\n" + "\n".join(hits)


def test_capabilities_name_real_collectives():
    caps = CommsCapabilities(sm_free=True, implements={"all_gather_into_tensor", "all_to_all_single"})
    assert caps.summary() == {"sm_free": True, "implements": ["all_gather_into_tensor", "all_to_all_single"]}
    assert caps.delegated == COLLECTIVES - caps.implements and "all_reduce" in caps.delegated
    with pytest.raises(PluginError, match=r"unknown collectives \['allgather'\].*all_gather_into_tensor"):
        CommsCapabilities(implements=frozenset({"allgather"}))


def test_per_dim_backends_are_checked():
    class Odd:
        capabilities = CommsCapabilities()

        def backend_for(self, device_type):
            return "gloo"

        def install(self):
            pass

        def backend_for_dim(self, dim, device_type):
            return {"shard": "gloo", "replica": 3}.get(dim)

    assert dim_backends(Odd(), ["dp", "shard"], "cpu") == {"shard": "gloo"}
    assert dim_backends(gemzoo.registry.get("comms", "torch"), ["dp"], "cpu") == {}
    with pytest.raises(PluginError, match=r"backend_for_dim\('replica', 'cpu'\) returned 3"):
        dim_backends(Odd(), ["replica"], "cpu")


def test_the_suite_refuses_a_wrong_answer():
    right = torch.tensor([1.0, 2.0])
    compare("x", "all_reduce", "sum", torch.float32, 2, right.clone(), right, right)
    with pytest.raises(AssertionError, match=r"'x': all_reduce/sum .* gives \[1.0, 3.0\], c10d \(gloo\) gives"):
        compare("x", "all_reduce", "sum", torch.float32, 2, torch.tensor([1.0, 3.0]), right, right)
    with pytest.raises(AssertionError, match="the closed form"):  # same values, another dtype
        compare("x", "broadcast", "", torch.float32, 2, right.double(), right)
