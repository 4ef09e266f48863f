"""Measured per-rank table memory and collective bytes of sharding-2d on 4 gloo ranks (CPU), beside what
``gemzoo plan``'s formula (``scale.embedding_traffic``) gives for the same layout and batches.

gem-tiny narrowed to 1 block of width 16, with 4 tables of 4096 x 16 (1 MiB fp32 in all) and 32 samples a step
(8 a rank), 4 steps, under: 1D (one group of 4, row-wise), 2x2 replicated (gradient sync), 2x2 replicated with
weight sync every 2 steps, 2x2 fully sharded. Bytes are what each rank handed to its collectives, a step, mean
over ranks and steps; "plan" is the formula on each rank's own batch (mean over the same). JSON goes to ``--out``
(or this folder) as ``gloo_bytes.json``.

    .venv/bin/python plugins/gemzoo-sharding-2d/bench/gloo_bytes.py
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # sharding_2d_measure: the tests' measurement
CONFIG = HERE.parents[2] / "configs" / "gem-tiny.toml"
ROWS, DIM, STEPS, WORLD = 4096, 16, 4, 4
LAYOUTS = {
    "1d (4 x 1)": {"group_size": 4, "sharding_types": ["row_wise"]},
    "2d replicated (2 x 2)": {"group_size": 2, "sharding_types": ["row_wise"]},
    "2d replicated, weights every 2": {"group_size": 2, "sharding_types": ["row_wise"], "replica_sync": "weights",
                                       "sync_every": 2},
    "2d fully_sharded (2 x 2)": {"group_size": 2, "sharding_types": ["row_wise"], "strategy": "fully_sharded"},
}


def overrides(out: str, options: dict) -> list[str]:
    sets = [f"run.steps={STEPS}", "run.device='cpu'", "eval.every=0", "checkpoint.every=0", f"run.out_dir='{out}'",
            "plugins.planner='sharding-2d'", "data.batch_size=32", "data.max_len=24", "data.median_len=8",
            "data.max_candidates=4", f"data.sparse_table_size={ROWS}", "model.d_model=16", "model.num_layers=1",
            f"model.embedding_dim={DIM}", "model.mlp_dims=[16, 8]", "run.dense_parallel='ddp'"]
    return sets + [f"plugins.options.sharding-2d.{k}={json.dumps(v)}" for k, v in options.items()]


def rank_main(rank: int, world: int, port: int, tmp: str) -> None:
    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    import torch
    import torch.distributed as dist
    from sharding_2d_measure import train_and_record

    from gemzoo.api import load_config

    torch.set_num_threads(1)
    out = {name: train_and_record(load_config(str(CONFIG), overrides=overrides(f"{tmp}/{i}", o)))
           for i, (name, o) in enumerate(LAYOUTS.items())}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from gemzoo_sharding_2d.layout import plan_layout
    from gemzoo_sharding_2d.scale import embedding_traffic
    from sharding_2d_measure import per_step, sample_ids

    from gemzoo.api import TableConfig, load_config, registry
    from gemzoo.testing.comms import spawn

    tmp = tempfile.mkdtemp(prefix="s2d-bench-")
    spawn(rank_main, WORLD, tmp, timeout=600)
    ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    cfg = load_config(str(CONFIG), overrides=overrides(tmp, {}))
    ds = registry.get("dataset", cfg.data.source).build(cfg.data, cfg.run.seed)
    features = [f"sparse_{t}" for t in range(cfg.data.num_sparse_tables)]
    tables = [TableConfig(f"table_{t}", ROWS, DIM, [f]) for t, f in enumerate(features)]
    rows = []
    for name, o in LAYOUTS.items():
        g = o["group_size"]
        layout = plan_layout(tables, g, WORLD // g, o.get("strategy", "replicated"), o["sharding_types"])
        sync = {k: o[k] for k in ("replica_sync", "sync_every") if k in o}
        measured, planned = {}, {}
        for r, rank in enumerate(ranks):
            for step, got in enumerate(per_step(rank[name]["bytes"])):
                ids, batch = sample_ids(ds, step, r, WORLD)
                for k, v in got.items():
                    measured.setdefault(k, []).append(v)
                for k, v in embedding_traffic(layout, features, batch, ids, **sync, rank=r % g).items():
                    planned.setdefault(k, []).append(v)
        mem = [rank[name]["memory"] for rank in ranks]
        rows.append({"layout": name, "weights_per_rank": statistics.mean(m["weights"] for m in mem),
                     "state_per_rank": statistics.mean(m["state"] for m in mem), "whole": mem[0]["whole"],
                     "measured": {k: sum(v) / (WORLD * STEPS) for k, v in measured.items()},
                     "plan": {k: statistics.mean(v) for k, v in planned.items()},
                     "losses": ranks[0][name]["losses"]})
    print(f"| layout | tables a rank (of {rows[0]['whole']:,} B) | Adagrad state a rank | category | measured B/step | "
          "plan B/step |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for i, k in enumerate(sorted(set(row["measured"]) | set(row["plan"]))):
            head = (f"| {row['layout']} | {row['weights_per_rank']:,.0f} ({row['weights_per_rank'] / row['whole']:.3f})"
                    f" | {row['state_per_rank']:,.0f} ") if i == 0 else "| | | "
            print(f"{head}| {k} | {row['measured'].get(k, 0):,.1f} | {row['plan'].get(k, 0):,.1f} |")
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else HERE) / "gloo_bytes.json"  # an output folder may be given
    dest.write_text(json.dumps(rows, indent=1))
    print(f"wrote {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
