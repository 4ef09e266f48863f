"""Old against new partition on the same draws, in one process: ms (median of ``--reps``) and max/mean.

The old ``partition.py`` comes from a git revision (``git show REV:...``) and is loaded beside the installed
one; each draw (the simulator's generators, gem-bench's ``cost_model``, ``--per-rank`` samples a rank, plus
``--extra``) is partitioned by both, alternately, with free and equal counts. ``same`` says whether the
groups are identical. JSON to ``--out`` (one row per draw and counts).

    .venv/bin/python plugins/gemzoo-batch-shuffle/bench/ab_partition.py --old 3cfd173 --worlds 64,1024,8192
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import simulate  # noqa: E402
from gemzoo_batch_shuffle import imbalance, partition  # noqa: E402

PATH = "plugins/gemzoo-batch-shuffle/gemzoo_batch_shuffle/partition.py"


def load_old(rev: str):
    text = subprocess.run(["git", "show", f"{rev}:{PATH}"], cwd=simulate.ROOT, check=True, capture_output=True,
                          text=True).stdout
    path = Path(tempfile.mkdtemp()) / "partition_old.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("partition_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="git revision of the old partition.py")
    ap.add_argument("--worlds", default="64,1024,8192")
    ap.add_argument("--dists", default="gem-lognormal,uniform-8k,zipf")
    ap.add_argument("--per-rank", type=int, default=64)
    ap.add_argument("--extra", type=int, default=0, help="samples beyond per-rank x W (uneven parts)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    old = load_old(args.old)
    cost = simulate.gem_cost_model(32)
    rows = []
    for dist in args.dists.split(","):
        for w in (int(x) for x in args.worlds.split(",")):
            costs = cost(simulate.DISTS[dist](args.per_rank * w + args.extra, seed=1000 * w)).double()
            for eq in (False, True):
                times = {"old": [], "new": []}
                got = {}
                for _ in range(args.reps):
                    for name, fn in (("old", old.partition), ("new", partition)):
                        t = time.perf_counter()
                        got[name] = fn(costs, w, equal_count=eq)
                        times[name].append(1e3 * (time.perf_counter() - t))
                row = {"dist": dist, "world": w, "samples": costs.numel(), "counts": "equal" if eq else "free",
                       **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
                       **{f"{k}_max_mean": imbalance(costs, g) for k, g in got.items()},
                       "same": all(torch.equal(a, b) for a, b in zip(got["old"], got["new"], strict=False)),
                       "sizes_new": sorted({len(g) for g in got["new"]})[:3]}
                rows.append(row)
                print(f"| {dist} | {w} | {row['counts']} | {row['old_ms']:.0f} | {row['new_ms']:.0f} | "
                      f"{row['old_ms'] / row['new_ms']:.2f}x | "
                      + ("same groups" if row["same"] else
                         f"{row['old_max_mean']:.6f} → {row['new_max_mean']:.6f}") + " |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows},
                                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
