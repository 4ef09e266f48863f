"""Host work of moving samples between ranks (the batching exchange's ``move``) at W ranks, on one CPU.

    .venv/bin/python plugins/gemzoo-batch-shuffle/bench/move.py --worlds 8,64,1024,8192 --out /tmp/move.json

One rank's step 3-4 of ``rebalance`` (``exchange.py``): its route through a partition of W x ``--per-rank``
samples, packing the samples it sends (sample-major columns, one byte buffer in destination order), and
rebuilding what arrives, in the partition's order. The all-to-alls are replaced by a loopback (what is sent
arrives), so the figures are the host work alone, the part that grows with W if anything loops over ranks;
the bytes on the wire are not in them. The rank's part is ``--per-rank`` samples of the config's dataset
(gem-bench: gem-lognormal histories, 16 sparse tables); the partition gives every rank ``--per-rank`` samples
drawn at random from the whole global batch, so nearly every sample moves (the worst case for the host).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "gem-bench.toml"))
    p.add_argument("--worlds", default="8,64,1024,8192")
    p.add_argument("--per-rank", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per world (median reported)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args(argv)


def _loopback(out, inp, output_split_sizes=None, input_split_sizes=None, group=None):
    out.copy_(inp)


def measure(batch, world: int, per_rank: int, repeats: int, rank: int = 1) -> dict:
    from gemzoo.api import DataParallelGroup
    from gemzoo.testing import Planned, move, route

    gen = torch.Generator().manual_seed(world)
    groups = list(torch.randperm(world * per_rank, generator=gen).split(per_rank))
    counts = [per_rank] * world
    dp = DataParallelGroup(rank=rank, size=world, group=None)
    t0 = time.perf_counter()
    rt = route(groups, counts, rank)
    route_ms = 1e3 * (time.perf_counter() - t0)
    planned = Planned(step=0, batch=batch, counts=counts, dp=dp, route=rt)
    times = []
    with mock.patch.object(dist, "all_to_all_single", _loopback):
        for _ in range(repeats + 1):  # the first call warms the allocator
            t0 = time.perf_counter()
            moved = move(planned)
            times.append(1e3 * (time.perf_counter() - t0))
    assert moved.num_samples == per_rank
    return {"world": world, "per_rank": per_rank, "route_ms": round(route_ms, 2),
            "move_ms": round(statistics.median(times[1:]), 2), "history_tokens": int(batch.lengths.sum())}


def main(argv=None):
    from gemzoo.api import load_config, registry

    a = parse(argv)
    cfg = load_config(a.config)
    dataset = registry.get("dataset", cfg.data.source).build(cfg.data, cfg.run.seed)
    batch = dataset.train_batch(0)
    batch = batch.select(torch.arange(min(a.per_rank, batch.num_samples)))
    rows = [measure(batch, int(w), batch.num_samples, a.repeats) for w in a.worlds.split(",")]
    print(f"{'ranks':>6} {'route ms':>9} {'move ms':>8}  ({batch.num_samples} samples, "
          f"{rows[0]['history_tokens']} history tokens a rank; loopback all-to-all)")
    for r in rows:
        print(f"{r['world']:>6} {r['route_ms']:>9.2f} {r['move_ms']:>8.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"config": a.config, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
