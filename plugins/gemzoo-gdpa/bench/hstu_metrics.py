"""HSTU trained with gdpa against the same config on other attention kernels, at equal steps.

    python plugins/gemzoo-gdpa/bench/hstu_metrics.py --steps 150 --out results/hstu_metrics.json

`configs/hstu-ml1m.toml` (pointwise silu attention, no relative bias: gdpa has none fused) on MovieLens-1M-
shaped synthetic data written to a temporary folder (6,040 users, 3,706 items, ML-1M's length spread; each
user walks a neighbourhood of items inside two or three favourite genres, so next-item prediction has
signal). Runs, each from the same seed and batches:

- ``gdpa`` on CUDA (fp32), the kernel under test;
- ``reference`` on CUDA (the torch definition), the same RNG streams on the same device: only the kernel
  differs, so this pair bounds gdpa's numerical effect on training;
- ``cpu`` on CPU (the C++ kernel), the issue's comparison: another device draws other dropout masks and
  negatives, so it also carries run-to-run noise;
- ``cpu-host`` on CUDA: the same C++ ``cpu`` kernel called from the CUDA run (q, k, v copied to the host and
  the output back, autograd through the copies), so the model, its RNG streams and every other op stay on
  the GPU and only the attention kernel differs from the gdpa run: the issue's comparison without the
  device's noise. Each row records whether ``gemzoo._C`` was built (without it ``cpu`` runs the reference).

Every run evaluates every user once at the end; the JSON holds each run's metrics and the relative
difference of each metric from the gdpa run. MovieLens-1M itself is not used (nothing downloads here).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "hstu-ml1m.toml"


def write_synthetic_ml1m(folder: Path, users: int = 6040, items: int = 3706, genres: int = 18,
                         seed: int = 0) -> Path:
    """ratings.dat and movies.dat in MovieLens-1M's format; returns the ratings path."""
    rng = np.random.default_rng(seed)
    genre_of = np.sort(rng.integers(0, genres, size=items))  # items of a genre are neighbours in id
    members = [np.flatnonzero(genre_of == g) for g in range(genres)]
    lengths = np.clip(np.round(np.exp(rng.normal(math.log(96), 1.0, size=users))), 20, 2314).astype(int)
    lines = []
    for u in range(users):
        favourite = rng.choice(genres, size=int(rng.integers(2, 4)), replace=False)
        pool = np.concatenate([members[g] for g in favourite if len(members[g])])
        n = int(min(lengths[u], len(pool)))
        # a walk over the pool: usually a short step to a neighbouring item, sometimes a jump; first visits
        # in order are the user's history
        walk = np.empty(0, dtype=np.int64)
        while len(np.unique(walk)) < n:
            steps = np.where(rng.random(4 * n) < 0.6, rng.integers(-3, 4, size=4 * n),
                             rng.integers(0, len(pool), size=4 * n))
            start = walk[-1] if len(walk) else int(rng.integers(0, len(pool)))
            walk = np.concatenate([walk, (start + np.cumsum(steps)) % len(pool)])
        _, first = np.unique(walk, return_index=True)
        seq = pool[walk[np.sort(first)[:n]]]
        t0 = 978_300_000 + int(rng.integers(0, 10_000_000))
        times = t0 + np.cumsum(rng.integers(1, 4000, size=len(seq)))
        lines += [f"{u + 1}::{m + 1}::{int(rng.integers(1, 6))}::{t}" for m, t in zip(seq, times, strict=False)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ratings.dat").write_text("\n".join(lines) + "\n")
    (folder / "movies.dat").write_text("".join(f"{m + 1}::Movie {m + 1} (2000)::Genre{genre_of[m]}\n"
                                               for m in range(items)), encoding="latin-1")
    return folder / "ratings.dat"


def register_cpu_host() -> None:
    """Attention kernel ``cpu-host``: the registered ``cpu`` kernel run on host copies of CUDA tensors."""
    import dataclasses

    from gemzoo.api import FunctionKernel, registry

    if "cpu-host" in registry.names("attention"):
        return
    cpu = registry.get("attention", "cpu")

    def on_host(q, k, v, q_offsets, k_offsets=None, **kw):
        out = cpu(q.cpu(), k.cpu(), v.cpu(), q_offsets.cpu(), None if k_offsets is None else k_offsets.cpu(), **kw)
        return out.to(q.device)

    devices = cpu.capabilities.devices | {"cuda"}
    caps = dataclasses.replace(cpu.capabilities, devices=devices, backward_devices=devices)
    registry.register("attention", "cpu-host", FunctionKernel(on_host, caps, "the cpu kernel on host copies"),
                      distribution="hstu_metrics.py")


def train_one(ratings: Path, plugins: str, device: str, steps: int, out: Path, threads: int | None,
              seed: int = 0) -> dict:
    import torch

    from gemzoo.api import Trainer, load_config
    from gemzoo.testing import extension_available

    register_cpu_host()
    if threads:
        torch.set_num_threads(threads)
    cfg = load_config(CONFIG, plugins=plugins, overrides=[
        f"data.path='{ratings}'", f"data.movies_path='{ratings.parent / 'movies.dat'}'", "model.relative_bias='none'",
        f"run.steps={steps}", f"run.device='{device}'", f"eval.every={steps}", "checkpoint.every=0",
        f"run.out_dir='{out}'", f"run.seed={seed}"])
    t0 = time.perf_counter()
    trainer = Trainer(cfg, progress=False).assemble()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    metrics = {k: float(v) for k, v in result.eval.items()}
    return {"plugins": plugins, "device": device, "seed": seed, "steps": steps, "wall_s": wall,
            "extension": extension_available(),
            "final_loss": result.final_loss, "metrics": metrics}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--runs", default="gdpa:cuda,reference:cuda,cpu-host:cuda,cpu:cpu",
                   help="plugins:device, comma-separated")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the cpu run")
    p.add_argument("--seed", type=int, default=0, help="run.seed of every run (the data stays seed 0)")
    p.add_argument("--out", default="hstu_metrics.json")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hstu-metrics-"))
    ratings = write_synthetic_ml1m(work / "data")
    rows = []
    for spec in args.runs.split(","):
        plugins, device = spec.split(":")
        try:
            row = train_one(ratings, plugins, device, args.steps, work / f"{plugins}-{device}", args.threads,
                            args.seed)
        except Exception as e:  # one kernel's failure is a row, not the end of the comparison
            row = {"plugins": plugins, "device": device, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0].get("metrics", {})
    for row in rows[1:]:
        m = row.get("metrics", {})
        row["rel_diff_vs_first"] = {k: (m[k] - base[k]) / abs(base[k]) if base[k] else math.nan
                                    for k in base if k in m}
    worst = {f"{r['plugins']}:{r['device']}": max((abs(v) for v in r.get("rel_diff_vs_first", {}).values()),
                                                  default=math.nan) for r in rows[1:]}
    summary = {"config": str(CONFIG.relative_to(ROOT)), "set": ["model.relative_bias='none'"], "steps": args.steps,
               "data": "synthetic, MovieLens-1M-shaped (write_synthetic_ml1m)", "rows": rows,
               "worst_rel_diff_vs_first": worst}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({"worst_rel_diff_vs_first": worst}))


if __name__ == "__main__":
    main()
