"""End-to-end training throughput: a thin caller of ``gemzoo ablate`` (gemzoo/cli/ablate.py), kept so the
commands recorded in the READMEs still run.

    python bench/e2e.py --ablation configs/ablations/gem-bench.toml [--steps N] [--out DIR]
    python bench/e2e.py --config configs/gem-bench.toml --runs sdpa-padded,bf16,full-ac jfa,bf16 --steps 50

Each plugin set trains in its own process and run folder under --out (default
runs/ablations/<name>), which gets ablation.json, ablation.csv, PNG plots and report.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def main() -> int:
    from gemzoo.cli.ablate import make_plan, plan_from_config, run_ablation
    from gemzoo.cli.ablate_report import markdown_table

    p = argparse.ArgumentParser()
    p.add_argument("--ablation", help="configs/ablations/*.toml: config, runs, steps, warmup and overrides")
    p.add_argument("--config", default="configs/gem-bench.toml")
    p.add_argument("--runs", nargs="+", help="plugin sets (with --config: default sdpa-padded,bf16 flex,bf16)")
    p.add_argument("--steps", type=int, help="default 50, or the ablation's")
    p.add_argument("--warmup", type=int, help="default 5, or the ablation's")
    p.add_argument("--set", action="append", default=[], help="extra config overrides")
    p.add_argument("--out", help="output folder (default runs/ablations/<name>)")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args()
    command = shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv])
    if args.ablation:
        plan = make_plan(args.ablation, steps=args.steps, warmup=args.warmup, out=args.out, overrides=args.set,
                         runs=args.runs, command=command)
    else:
        plan = plan_from_config(args.config, args.runs or ["sdpa-padded,bf16", "flex,bf16"],
                                steps=50 if args.steps is None else args.steps,
                                warmup=5 if args.warmup is None else args.warmup, out=args.out,
                                overrides=args.set, command=command)
    data = run_ablation(plan, overwrite=args.overwrite, echo=lambda s: print(s, flush=True))
    print("\n" + markdown_table(data))
    return 0 if any(r.get("status") == "ok" for r in data["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
