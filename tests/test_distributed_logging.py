"""Several ranks log global numbers: one loss for the step (the mean over ranks), every rank's samples."""

import copy
import json
import os
import socket
import sys

import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed
SUPPORT = os.path.join(os.path.dirname(__file__), "support")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.path.insert(0, SUPPORT)
    import torch.distributed as dist

    import gemzoo
    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train
    from toy_plugin import TOY_CONFIG, install

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


def test_two_ranks_log_the_global_loss_and_throughput(tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["loss"] for s in ranks[0]["steps"]] == [s["loss"] for s in ranks[1]["steps"]]  # one global loss
    for s in ranks[0]["steps"]:
        assert s["samples"] == pytest.approx(ranks[0]["batch_size"])  # both ranks' samples, not rank 0's half
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    start = rows[0]
    assert start["event"] == "start" and start["world_size"] == 2 and start["mesh"] == {"shape": [2], "dims": ["dp"]}
    assert [r["loss"] for r in rows if "loss" in r] == [s["loss"] for s in ranks[0]["steps"]]
    assert [r["is_main"] for r in ranks] == [True, False]  # rank 0 prints the summary
