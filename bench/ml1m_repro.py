"""Reproduce the HSTU paper's MovieLens-1M table: train sasrec, hstu and hstu-large with the shipped configs on
the test split (leave-one-out, every movie of movies.dat, history items left out of the ranking) for their full
schedule, over several seeds and optional kernel/precision variants; print each row as mean ± std beside the
paper's, with the wall-clock time per run.

    python bench/ml1m_repro.py --data data/ml-1m --seeds 0 1 2                 # the paper's table, 9 runs
    python bench/ml1m_repro.py --data data/ml-1m --seeds 0 1 2 \\
        --variant reference=reference --variant bf16=bf16                     # + kernel and precision rows
    python bench/ml1m_repro.py --data data/ml-1m --models hstu --steps 200 --split val   # a short check

--data is a folder with MovieLens-1M's ratings.dat and movies.dat (never commit them). A variant NAME=PLUGINS
trains the same configs with ``--plugins PLUGINS`` on top of their own (the base row is the configs as shipped).
Each run is its own process; ``--jobs`` of them run side by side (small models share one GPU well). Each writes
its run folder under --out (default runs/ml1m-repro); the summary goes to ml1m_repro.json there.
Hyper-parameters are the configs'; model choices were made on the validation split only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"sasrec": "configs/sasrec-ml1m.toml", "hstu": "configs/hstu-ml1m.toml",
           "hstu-large": "configs/hstu-large-ml1m.toml"}
# generative-recommenders README (ML-1M, full ranking over unseen items, test split)
PAPER = {"sasrec": (0.2853, 0.1603, 0.5474, 0.2185), "hstu": (0.3097, 0.1720, 0.5754, 0.2307),
         "hstu-large": (0.3294, 0.1893, 0.5935, 0.2481)}
METRICS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50")
TOLERANCE = 0.02  # a row passes at or above 98% of the paper's figure
BASE = "as shipped"


def train_one(name: str, plugins: str, seed: int, out: Path, args) -> dict:
    """Train one config in this process; returns its final metrics and timings."""
    import torch

    from gemzoo.api import Trainer, attention_sites, load_config

    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.data)
    overrides = [f"data.path='{data / 'ratings.dat'}'", f"data.movies_path='{data / 'movies.dat'}'",
                 f"data.items='{args.items}'", f"data.eval_split='{args.split}'",
                 f"run.out_dir='{out}'", f"run.seed={seed}", *args.set]
    if args.steps:
        overrides.append(f"run.steps={args.steps}")
    cfg = load_config(ROOT / CONFIGS[name], overrides=overrides, plugins=plugins or None)
    steps = cfg.run.steps
    cfg.eval.every = args.eval_every or steps  # by default one evaluation, after the last step
    cfg.checkpoint.every = steps
    t0 = time.perf_counter()
    trainer = Trainer(cfg, progress=False, overwrite=True).assemble()
    kernels = sorted({site.kernel_name for site in attention_sites(trainer.model).values()})
    result = trainer.fit()
    wall = time.perf_counter() - t0
    info = trainer.dataset.info
    users = info["num_users"]
    step_s = sum(r["step_s"] for r in result.history)
    steady = [r["step_s"] for r in result.history[5:]] or [r["step_s"] for r in result.history]
    steps_per_epoch = users / cfg.data.batch_size
    tag = "_unseen" if cfg.model.eval_ranking == "unseen" else ""
    final = {m: result.eval.get(f"eval/{m}{tag}") for m in METRICS}
    curve = [{"step": r["step"], **{m: r.get(f"eval/{m}{tag}") for m in METRICS}}
             for r in result.history if f"eval/hr@10{tag}" in r]
    return {"model": name, "config": CONFIGS[name], "plugins": plugins, "seed": seed, "split": args.split,
            "steps": steps, "epochs": steps / steps_per_epoch, "metrics": final, "curve": curve,
            "final_loss": result.final_loss, "attention": kernels, "precision": cfg.plugins.precision,
            "train_s_per_epoch": step_s / steps * steps_per_epoch, "wall_s": wall,
            "step_ms": 1e3 * sum(steady) / len(steady),
            "num_items": info["num_items"], "items": info["items"], "users": users,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "overrides": overrides}


def summarise(runs: list[dict], variants: dict[str, str]) -> list[dict]:
    """One row per (model, variant): each metric's mean and std over seeds, and the mean wall time per run."""
    rows = []
    for name in CONFIGS:
        for variant, plugins in variants.items():
            mine = [r for r in runs if r["model"] == name and r["plugins"] == plugins]
            if not mine:
                continue
            row = {"model": name, "variant": variant, "plugins": plugins, "seeds": [r["seed"] for r in mine],
                   "attention": mine[0]["attention"], "precision": mine[0]["precision"],
                   "wall_s": statistics.fmean(r["wall_s"] for r in mine),
                   "step_ms": statistics.fmean(r["step_ms"] for r in mine),
                   "train_s_per_epoch": statistics.fmean(r["train_s_per_epoch"] for r in mine),
                   "epochs": mine[0]["epochs"]}
            for m in METRICS:
                values = [r["metrics"][m] for r in mine if r["metrics"].get(m) is not None]
                row[m] = (statistics.fmean(values) if values else None,
                          statistics.stdev(values) if len(values) > 1 else 0.0)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = ["model", "kernel, precision"] + [m.upper() for m in METRICS] + ["ms / step", "s / run", "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        cells = [r["model"], f"{'+'.join(r['attention'])}, {r['precision']}"]
        for m, paper in zip(METRICS, PAPER[r["model"]], strict=True):
            mean, std = r[m]
            if mean is None:
                cells.append("—")
                continue
            mark = " ✓" if mean >= paper * (1 - TOLERANCE) else f" ✗ ({mean / paper - 1:+.1%})"
            cells.append(f"{mean:.4f} ± {std:.4f}{mark}")
        cells += [f"{r['step_ms']:.1f}", f"{r['wall_s']:.0f}", str(len(r["seeds"]))]
        lines.append("| " + " | ".join(cells) + " |")
        if i + 1 == len(rows) or rows[i + 1]["model"] != r["model"]:
            lines.append(f"| {r['model']} | paper | " + " | ".join(f"{v:.4f}" for v in PAPER[r["model"]]) + " | | | |")
    return "\n".join(lines)


def parse_variants(specs: list[str]) -> dict[str, str]:
    variants = {BASE: ""}
    for spec in specs:
        name, sep, plugins = spec.partition("=")
        if not sep or not name or not plugins:
            raise SystemExit(f"ml1m_repro: --variant {spec!r} must be NAME=PLUGINS, e.g. bf16=bf16")
        variants[name] = plugins
    return variants


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="folder with MovieLens-1M ratings.dat and movies.dat")
    p.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per seed (the table: mean ± std)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=PLUGINS",
                   help="also train with --plugins PLUGINS, e.g. reference=reference or bf16=bf16")
    p.add_argument("--split", default="test", choices=("val", "test"), help="test: the paper's table")
    p.add_argument("--items", default="movies", choices=("movies", "rated", "auto"),
                   help="movies: the reference's 3,883 items (default)")
    p.add_argument("--steps", type=int, help="override run.steps (default: the config's full schedule)")
    p.add_argument("--eval-every", type=int, help="also evaluate every N steps (a curve); default: at the end")
    p.add_argument("--set", action="append", default=[], help="extra config overrides, as gemzoo train --set")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in each run (0: leave it)")
    p.add_argument("--jobs", type=int, default=0, help="runs side by side (0: all of them)")
    p.add_argument("--out", default=str(ROOT / "runs" / "ml1m-repro"), help="output folder for the runs and JSON")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: MODEL:SEED:PLUGINS, train it, write its JSON
    args = p.parse_args()
    for f in ("ratings.dat", "movies.dat") if args.items == "movies" else ("ratings.dat",):
        if not (Path(args.data) / f).is_file():
            print(f"ml1m_repro: {Path(args.data) / f} is missing; put MovieLens-1M's ratings.dat and movies.dat "
                  "there (https://grouplens.org/datasets/movielens/1m/)", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        name, seed, plugins = args.one.split(":", 2)
        tag = f"{name}-{plugins.replace(',', '+') or 'shipped'}-seed{seed}"
        row = train_one(name, plugins, int(seed), out / tag, args)
        (out / f"{tag}.json").write_text(json.dumps(row, indent=1))
        shown = ", ".join(f"{m} {v:.4f}" for m, v in row["metrics"].items() if v is not None)
        print(f"ml1m_repro: {tag} done: {row['steps']} steps in {row['wall_s']:.0f} s; {shown}", flush=True)
        return 0
    variants = parse_variants(args.variant)
    jobs = [f"{m}:{s}:{v}" for v in variants.values() for m in args.models for s in args.seeds]
    width = args.jobs or len(jobs)
    base = [a for a in sys.argv[1:]]
    t0 = time.perf_counter()
    running: dict[str, subprocess.Popen] = {}
    failed, pending = [], list(jobs)
    while pending or running:
        while pending and len(running) < width:
            job = pending.pop(0)
            running[job] = subprocess.Popen([sys.executable, __file__, *base, "--out", str(out), "--one", job])
        time.sleep(1.0)
        for job, proc in list(running.items()):
            if proc.poll() is not None:
                del running[job]
                if proc.returncode != 0:
                    failed.append(job)
    if failed:
        print(f"ml1m_repro: {', '.join(failed)} failed (see above)", file=sys.stderr)
    runs = []
    for job in jobs:
        name, seed, plugins = job.split(":", 2)
        path = out / f"{name}-{plugins.replace(',', '+') or 'shipped'}-seed{seed}.json"
        if job not in failed and path.is_file():
            runs.append(json.loads(path.read_text()))
    rows = summarise(runs, variants)
    summary = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "wall_s": time.perf_counter() - t0,
               "paper": {k: dict(zip(METRICS, v, strict=True)) for k, v in PAPER.items()}, "rows": rows,
               "runs": runs, "date": time.strftime("%Y-%m-%d")}
    (out / "ml1m_repro.json").write_text(json.dumps(summary, indent=1))
    if rows:
        print(f"\nMovieLens-1M, {args.split} split, unseen items ranked; {runs[0]['device']}, torch {runs[0]['torch']}; "
              f"mean ± std over seeds {args.seeds}; ✓: at or within {TOLERANCE:.0%} below the paper")
        print(table(rows))
        print(f"({len(runs)} runs, {width} side by side; ms / step: mean training step after the first 5; "
              f"s / run: wall-clock of one run, evaluation included; "
              f"total {summary['wall_s']:.0f} s; JSON in {out / 'ml1m_repro.json'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
