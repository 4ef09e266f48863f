"""Multi-rank behaviour on gloo: data-parallel training keeps replicas identical."""

import copy
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed
SUPPORT = os.path.join(os.path.dirname(__file__), "support")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rank(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.path.insert(0, SUPPORT)
    import torch.distributed as dist

    import gemzoo
    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train
    from toy_plugin import TOY_CONFIG, install

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


@pytest.mark.parametrize("world", [2])
def test_data_parallel_replicas_stay_identical(tmp_path, world):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_train_rank, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    params = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert torch.isfinite(params[0]).all()
    for other in params[1:]:
        torch.testing.assert_close(other, params[0], rtol=0, atol=0)
    assert (tmp_path / "run" / "metrics.jsonl").exists()  # rank 0 logs
