"""End-to-end training throughput: one config, several plugin sets, one process, one table.

    python bench/e2e.py --config configs/gem-bench.toml --runs sdpa-padded,bf16 flex,bf16 --steps 50
    python bench/e2e.py --ablation configs/ablations/gem-bench.toml      # the same from a file

For each plugin set it trains ``--steps`` steps (no eval, no checkpoints), drops the first ``--warmup``
steps (compilation, allocator warm-up) and reports medians of samples/s, tokens/s, TFLOP/s and MFU,
plus peak memory. Writes JSON to $OUT (or --json) and prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch


def run_one(config: str, plugins: str, steps: int, warmup: int, extra: list[str]) -> dict:
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    overrides = [f"run.steps={steps}", "run.log_every=1", "eval.every=0", "checkpoint.every=0",
                 f"run.out_dir='runs/e2e-{plugins.replace(',', '-')}'", *extra]
    cfg = load_config(config, overrides=overrides, plugins=plugins)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train(cfg, progress=False)
    wall = time.perf_counter() - t0
    kept = result.history[warmup:] or result.history
    med = {k: statistics.median(r[k] for r in kept)
           for k in ("samples_per_s", "tokens_per_s", "tflops", "mfu", "step_s")}
    return {"plugins": plugins, "steps": steps, "wall_s": wall, "final_loss": result.final_loss,
            "peak_mem_gib": max(r["peak_mem_gib"] for r in result.history),
            "mfu_peak": result.history[-1]["mfu_peak"], **med}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ablation", help="configs/ablations/*.toml: config, runs, steps, warmup and overrides")
    p.add_argument("--config", default="configs/gem-bench.toml")
    p.add_argument("--runs", nargs="+", default=["sdpa-padded,bf16", "flex,bf16"])
    p.add_argument("--steps", type=int, help="default 50, or the ablation's")
    p.add_argument("--warmup", type=int, help="default 5, or the ablation's")
    p.add_argument("--set", action="append", default=[], help="extra config overrides")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "e2e.json"))
    args = p.parse_args()
    if args.ablation:  # the file gives config, runs and overrides; --steps/--warmup/--set still apply
        from gemzoo.config import load_ablation

        ab = load_ablation(args.ablation)
        args.config, args.runs, args.set = ab.config, ab.runs, ab.set + args.set
        args.steps = args.steps if args.steps is not None else ab.steps
        args.warmup = args.warmup if args.warmup is not None else ab.warmup
    args.steps = 50 if args.steps is None else args.steps
    args.warmup = 5 if args.warmup is None else args.warmup

    rows = []
    for plugins in args.runs:
        print(f"== {plugins}", flush=True)
        try:
            rows.append(run_one(args.config, plugins, args.steps, args.warmup, args.set))
        except Exception as exc:  # keep measuring the other sets; report the failure in the table
            rows.append({"plugins": plugins, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
        with open(args.json, "w") as f:  # after every run, so a killed call keeps what it measured
            json.dump({"config": args.config, "rows": rows}, f, indent=1)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with open(args.json, "w") as f:
        json.dump({"config": args.config, "device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)

    base = next((r for r in rows if "error" not in r), None)
    print(f"\n{args.config} on {device}, {args.steps} steps (median after {args.warmup} warm-up steps)")
    print(f"{'plugins':<24}{'samples/s':>11}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}{'vs first':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['plugins']:<24} FAILED: {r['error']}")
            continue
        ratio = r["samples_per_s"] / base["samples_per_s"]
        print(f"{r['plugins']:<24}{r['samples_per_s']:>11.1f}{r['tokens_per_s']:>12.0f}{r['tflops']:>9.1f}"
              f"{100 * r['mfu']:>6.1f}%{r['peak_mem_gib']:>10.1f}{ratio:>8.2f}x")
    if base:
        print(f"MFU peak: {base['mfu_peak']}")


if __name__ == "__main__":
    main()
