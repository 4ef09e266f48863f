"""Memory policies end to end: compiled rows of one config, peak and activation memory, samples/s, loss.

    python plugins/gemzoo-auto-ac/bench/bench_memory.py --config configs/gem-bench.toml --steps 20 --warmup 8

Rows, every one with run.compile = true and dynamic shapes from the first compile:
  jfa,bf16 | jfa,bf16,full-ac | jfa,bf16,act-quant | jfa,bf16,auto-ac target_gib=45 |
  jfa,bf16,auto-ac at full-ac's peak (target_gib = that row's measured peak) |
  jfa,mxfp8,act-quant,auto-ac (auto-ac at the budget the previous row chose)
Medians of samples/s after --warmup steps; peak = torch.cuda.max_memory_allocated over the measured steps;
static = memory allocated after the run (parameters, optimizer state); activations = peak - static.
Rows start only while --budget-s seconds are left, so a time-limited job ends in time; JSON after every row.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import tempfile
import time

import torch

GIB = 2**30


def _compiler_configs():
    return {m: m.get_config_copy() for m in (torch._dynamo.config, torch._functorch.config)}


def _restore(saved) -> None:
    for module, values in saved.items():
        for k, v in values.items():
            if getattr(module, k) is not v:
                setattr(module, k, v)


def run_row(config: str, label: str, plugins: str, sets: list[str], steps: int, warmup: int) -> dict:
    from gemzoo.api import Trainer, load_config

    cfg = load_config(config, plugins=plugins, overrides=[
        f"run.steps={steps}", "run.log_every=1", "eval.every=0", "checkpoint.every=0", "run.compile=true", *sets])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.config.assume_static_by_default = False  # every row: dynamic shapes from the first compile
    t0 = time.perf_counter()
    tr = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="bench-mem-"), progress=False).assemble()
    result = tr.fit()
    wall = time.perf_counter() - t0
    kept = result.history[warmup:] or result.history
    static = torch.cuda.memory_allocated() / GIB if cuda else math.nan
    peak = max(r["peak_mem_gib"] for r in kept)
    row = {"label": label, "plugins": plugins, "set": sets, "steps": steps, "warmup": warmup, "wall_s": wall,
           "samples_per_s": statistics.median(r["samples_per_s"] for r in kept),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in kept),
           "mfu": statistics.median(r["mfu"] for r in kept),
           "peak_gib": peak, "static_gib": static, "activation_gib": peak - static,
           "final_loss": result.final_loss, "losses": [r["loss"] for r in result.history],
           "memory": tr.memory_reports()}
    del tr, result
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gem-bench.toml")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--target-gib", type=float, default=45.0)
    p.add_argument("--budget-s", type=float, default=1e9, help="start no row after this many seconds")
    p.add_argument("--set", action="append", default=[], help="extra overrides for every row")
    p.add_argument("--rows", default="bf16,full-ac,act-quant,target,match,combo")
    p.add_argument("--json", default="bench_memory.json")
    args = p.parse_args()

    t_start = time.perf_counter()
    base_cfg = _compiler_configs()
    search = ["plugins.options.auto-ac.trials=3", "plugins.options.auto-ac.tolerance_gib=2.0"]
    rows: list[dict] = []
    by = {}

    def plan(key):
        if key == "bf16":
            return "jfa,bf16", "jfa,bf16", []
        if key == "full-ac":
            return "jfa,bf16,full-ac", "jfa,bf16,full-ac", []
        if key == "act-quant":
            return "jfa,bf16,act-quant", "jfa,bf16,act-quant", []
        if key == "target":
            return (f"jfa,bf16,auto-ac target_gib={args.target_gib:g}", "jfa,bf16,auto-ac",
                    [f"plugins.options.auto-ac.target_gib={args.target_gib}", *search])
        if key == "match":
            ref = by.get("full-ac")
            if ref is None or "error" in ref:
                return None
            t = math.ceil(ref["peak_gib"] * 10) / 10
            return (f"jfa,bf16,auto-ac target_gib={t:g} (full-ac's peak)", "jfa,bf16,auto-ac",
                    [f"plugins.options.auto-ac.target_gib={t}", *search])
        if key == "combo":
            src = by.get("match") or by.get("target")
            budget = 0.3
            if src is not None and "error" not in src:
                budget = src["memory"]["auto-ac"]["budget"]
            return (f"jfa,mxfp8,act-quant,auto-ac budget={budget:.3f}", "jfa,mxfp8,act-quant,auto-ac",
                    [f"plugins.options.auto-ac.budget={budget}"])
        raise SystemExit(f"unknown row {key!r}")

    for key in args.rows.split(","):
        elapsed = time.perf_counter() - t_start
        planned = plan(key)
        if planned is None:
            continue
        label, plugins, sets = planned
        if elapsed > args.budget_s:
            rows.append({"label": label, "plugins": plugins, "error": f"not run: {elapsed:.0f} s spent"})
            continue
        print(f"== {label} ({elapsed:.0f} s)", flush=True)
        try:
            row = run_row(args.config, label, plugins, [*args.set, *sets], args.steps, args.warmup)
        except Exception as exc:  # keep measuring the other rows
            row = {"label": label, "plugins": plugins, "error": f"{type(exc).__name__}: {exc}"[:600]}
        rows.append(row)
        by[key] = row
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        _restore(base_cfg)
        torch._dynamo.reset()
        gc.collect()
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "rows": rows}, f, indent=1)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with open(args.json, "w") as f:
        json.dump({"config": args.config, "device": device, "torch": torch.__version__, "steps": args.steps,
                   "warmup": args.warmup, "rows": rows}, f, indent=1)
    base = by.get("bf16")
    ok = base is not None and "error" not in base
    print(f"\n{args.config} on {device}, torch {torch.__version__}, compiled, {args.steps} steps "
          f"(medians after {args.warmup})")
    print(f"{'plugins':<52}{'samples/s':>10}{'MFU':>7}{'peak GiB':>9}{'act GiB':>8}{'vs bf16':>8}{'loss':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<52} FAILED: {r['error']}")
            continue
        ratio = r["samples_per_s"] / base["samples_per_s"] if ok else math.nan
        print(f"{r['label']:<52}{r['samples_per_s']:>10.1f}{100 * r['mfu']:>6.1f}%{r['peak_gib']:>9.1f}"
              f"{r['activation_gib']:>8.1f}{ratio:>7.2f}x{r['final_loss']:>8.4f}")
    for r in rows:
        for name, rep in (r.get("memory") or {}).items():
            print(f"  {r['label']}: {name}: {rep.get('summary')}")
    print("\n| plugins | samples/s | MFU | peak GiB | activation GiB | vs `jfa,bf16` | loss at the last step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| `{r['label']}` | {r['error'][:120]} | | | | | |")
            continue
        ratio = r["samples_per_s"] / base["samples_per_s"] if ok else math.nan
        print(f"| `{r['label']}` | {r['samples_per_s']:.1f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
              f"{r['activation_gib']:.1f} | {ratio:.2f}x | {r['final_loss']:.4f} |")


if __name__ == "__main__":
    main()
