"""Imbalance simulator for base-batch-shuffle: pure computation, no GPU, no process group.

For each length distribution and world size W, a global batch of ``--per-rank`` samples per rank is drawn,
each sample's cost comes from gem's own ``cost_model`` (``configs/gem-bench.toml``'s model built on ``meta``:
attention pairs of the tower and the cross attention plus linear work per token), and the ranks' summed
costs are compared under:

- ``none``: the contiguous part each rank loads (what the trainer trains without a policy);
- ``round-robin``: sample i to rank i % W;
- ``sorted``: by decreasing cost, dealt round-robin (rank i % W gets the i-th largest);
- ``shuffle``: base-batch-shuffle (free counts), and ``shuffle-eq`` with ``equal_count = true``.

Each cell is max/mean of the per-rank cost, averaged over ``--draws`` global batches (the slowest rank sets
the step, so ``1 - mean/max`` of the step is spent waiting); ``ms`` is the median time of the policy's
``assign`` on the whole global batch (what every rank computes each step). JSON goes to ``--out`` (or this
folder) as ``simulate.json``.

    .venv/bin/python plugins/gemzoo-batch-shuffle/bench/simulate.py --worlds 2,4,8,64 --draws 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from gemzoo_batch_shuffle import BatchShuffle, BatchShuffleOptions, imbalance

ROOT = Path(__file__).resolve().parents[3]


def gem_lognormal(b: int, seed: int) -> torch.Tensor:  # docs/benchmarks.md
    z = torch.randn(b, generator=torch.Generator().manual_seed(seed))
    return (1024 * torch.exp(1.0 * z)).round().clamp(32, 16384).long()


def uniform_8k(b: int, seed: int) -> torch.Tensor:  # docs/benchmarks.md
    return torch.randint(1, 8192, (b,), generator=torch.Generator().manual_seed(seed))


def zipf(b: int, seed: int, a: float = 1.5) -> torch.Tensor:
    """Zipf-distributed history lengths: 32 * k with P(k) ~ k^-a, capped at 16384 events."""
    k = torch.arange(1, 513, dtype=torch.float64)
    p = k.pow(-a)
    idx = torch.multinomial(p / p.sum(), b, replacement=True, generator=torch.Generator().manual_seed(seed))
    return (32 * k[idx]).long().clamp(max=16384)


DISTS = {"gem-lognormal": gem_lognormal, "uniform-8k": uniform_8k, "zipf": zipf}


def gem_cost_model(candidates: int):
    """gem-bench's model on meta; returns lengths -> float64 costs from its cost_model."""
    from gemzoo.api import load_config, registry

    cfg = load_config(ROOT / "configs" / "gem-bench.toml")
    mspec = registry.get("model", "gem")
    info = registry.get("dataset", cfg.data.source).build(cfg.data, 0).info
    with torch.device("meta"):
        model = mspec.build(cfg.model, info)

    def cost(lengths: torch.Tensor) -> torch.Tensor:
        batch = SimpleNamespace(lengths=lengths, cand_lengths=torch.full_like(lengths, candidates))
        return model.cost_model(batch)

    return cost


def baselines(costs: torch.Tensor, w: int) -> dict[str, list[torch.Tensor]]:
    n = costs.numel()
    idx = torch.arange(n)
    order = torch.argsort(-costs, stable=True)
    return {"none": list(idx.tensor_split(w)), "round-robin": [idx[r::w] for r in range(w)],
            "sorted": [order[r::w] for r in range(w)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4,8,64")
    ap.add_argument("--out", default=str(Path(__file__).parent), help="folder for the JSON results")
    ap.add_argument("--dists", default="gem-lognormal,uniform-8k,zipf")
    ap.add_argument("--per-rank", type=int, default=64, help="samples each rank loads (gem-bench: 64)")
    ap.add_argument("--candidates", type=int, default=32, help="candidates per user (gem-bench: 32)")
    ap.add_argument("--draws", type=int, default=5, help="global batches per cell (fewer above 1024 ranks)")
    args = ap.parse_args()
    cost_of = gem_cost_model(args.candidates)
    policies = {"shuffle": BatchShuffle(), "shuffle-eq": BatchShuffle(BatchShuffleOptions(equal_count=True))}
    rows = []
    for dist in args.dists.split(","):
        for w in (int(x) for x in args.worlds.split(",")):
            draws = args.draws if w <= 1024 else max(1, args.draws // 5)
            cells: dict[str, list[float]] = {}
            times: dict[str, list[float]] = {}
            for d in range(draws):
                costs = cost_of(DISTS[dist](args.per_rank * w, seed=1000 * w + d))
                for name, groups in baselines(costs, w).items():
                    cells.setdefault(name, []).append(imbalance(costs, groups))
                for name, pol in policies.items():
                    t = time.perf_counter()
                    groups = pol.assign(costs, w)
                    times.setdefault(name, []).append(time.perf_counter() - t)
                    cells.setdefault(name, []).append(imbalance(costs, groups))
            row = {"dist": dist, "world": w, "samples": args.per_rank * w, "draws": draws,
                   **{k: statistics.fmean(v) for k, v in cells.items()},
                   **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}}
            row["wait_none"] = 1 - 1 / row["none"]  # the share of the step the average rank waits
            row["wait_shuffle"] = 1 - 1 / row["shuffle"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    head = "| dist | W | none | round-robin | sorted | shuffle | shuffle-eq | wait none → shuffle | assign ms |"
    print("\n" + head + "\n|" + "---|" * 9)
    for r in rows:
        print(f"| {r['dist']} | {r['world']} | {r['none']:.3f} | {r['round-robin']:.3f} | {r['sorted']:.3f} | "
              f"{r['shuffle']:.4f} | {r['shuffle-eq']:.4f} | {100 * r['wait_none']:.1f}% → "
              f"{100 * r['wait_shuffle']:.2f}% | {r['shuffle_ms']:.0f} |")


if __name__ == "__main__":
    main()
