"""Helpers of gemzoo-sharding-2d's tests (a package-unique module name, imported as ``sharding_2d_cases``)."""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG = os.path.join(ROOT, "configs", "gem-tiny.toml")
BATCH = 8  # global samples a step: 2 a rank on 4 ranks
TABLE_ROWS = 64


def overrides(out: str, steps: int, planner: str = "sharding-2d", options: dict | None = None,
              every: int = 0) -> list[str]:
    """gem-tiny, narrowed: 1 block of width 16, 4 tables of 64 x 8 rows, 8 samples a step, no eval; a checkpoint
    every ``every`` steps and at the end (none with 0)."""
    sets = [f"run.steps={steps}", "run.device='cpu'", "eval.every=0", f"checkpoint.every={every}", "checkpoint.keep=8",
            f"run.out_dir='{out}'", f"plugins.planner='{planner}'", f"data.batch_size={BATCH}", "data.max_len=24",
            "data.median_len=8", "data.max_candidates=4", f"data.sparse_table_size={TABLE_ROWS}",
            "model.d_model=16", "model.num_layers=1", "model.embedding_dim=8", "model.mlp_dims=[16, 8]",
            "run.dense_parallel='ddp'", "run.log_every=1"]
    for k, v in (options or {}).items():
        sets.append(f"plugins.options.sharding-2d.{k}={json.dumps(v)}")
    return sets


def run(out: str, steps: int, *, planner: str = "sharding-2d", options: dict | None = None, resume=False,
        every: int = 1):
    """Train the test config; {"losses", "steps", "memory", "bytes"} (sharding_2d_measure.train_and_record)."""
    from sharding_2d_measure import train_and_record

    from gemzoo.api import load_config

    return train_and_record(load_config(CONFIG, overrides=overrides(out, steps, planner, options, every)), resume=resume)


def train_rank(rank: int, world: int, port: int, tmp: str) -> None:
    """One of 4 gloo ranks: 2x2 replicated and fully sharded, resume, the reshard chain 2x2 -> 4x1 -> one
    process (rank 0 alone) -> 2x2, and weight averaging every 2 steps; writes what it saw to rank<r>.json."""
    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rep, fs = {"group_size": 2, "sharding_types": ["row_wise"]}, {"group_size": 2, "strategy": "fully_sharded",
                                                                  "sharding_types": ["row_wise"]}
    out = {"rep": run(f"{tmp}/rep", 5, options=rep, every=2), "fs": run(f"{tmp}/fs", 5, options=fs, every=3)}
    out["rep@resumed"] = run(f"{tmp}/rep-resumed", 5, options=rep, resume=f"{tmp}/rep/checkpoints/step-00000002",
                             every=0)
    out["fs@resumed"] = run(f"{tmp}/fs-resumed", 5, options=fs, resume=f"{tmp}/fs/checkpoints/step-00000003",
                            every=0)
    # the reshard chain: 2x2 (step 2) -> 4x1 -> step 3 -> one process -> step 4 -> 2x2 fully sharded -> step 5
    out["4x1"] = run(f"{tmp}/g4", 3, options={"group_size": 4, "sharding_types": ["table_wise"]},
                     resume=f"{tmp}/rep/checkpoints/step-00000002")
    dist.barrier()
    if rank == 0:
        os.environ["WORLD_SIZE"] = "1"
        try:
            out["1x1"] = run(f"{tmp}/one", 4, options={"group_size": 1}, resume=f"{tmp}/g4/checkpoints/step-00000003")
        finally:
            os.environ["WORLD_SIZE"] = str(world)
    dist.barrier()
    out["2x2"] = run(f"{tmp}/back", 5, options=fs, resume=f"{tmp}/one/checkpoints/step-00000004", every=0)
    out["weights"] = run(f"{tmp}/weights", 4, options={**rep, "replica_sync": "weights", "sync_every": 2}, every=0)
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
