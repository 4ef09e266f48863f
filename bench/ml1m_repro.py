"""Reproduce the HSTU paper's MovieLens-1M table: train sasrec, hstu and hstu-large with the
shipped configs on the test split (leave-one-out, every movie of movies.dat, history items left out of the
ranking) for their full schedule, then print gemzoo's row beside the paper's for each, and the time per epoch.

    python bench/ml1m_repro.py --data data/ml-1m                      # the three configs, in parallel
    python bench/ml1m_repro.py --data data/ml-1m --models hstu --steps 200 --split val   # a short check

--data is a folder with MovieLens-1M's ratings.dat and movies.dat (never commit them). Each model trains in
its own process (on one GPU the three small models run side by side); each writes its run folder under --out
(default runs/ml1m-repro) and the summary goes to ml1m_repro.json there.
Hyper-parameters are the configs'; model choices were made on the validation split only.
"""

from __future__ import annotations

import argparse
import json
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
TOLERANCE = 0.02  # "within 2% relative where seeds vary"


def train_one(name: str, args) -> dict:
    """Train one config in this process; returns its final metrics and timings."""
    import torch

    from gemzoo.config import load_config
    from gemzoo.train.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.data)
    overrides = [f"data.path='{data / 'ratings.dat'}'", f"data.movies_path='{data / 'movies.dat'}'",
                 f"data.items='{args.items}'", f"data.eval_split='{args.split}'",
                 f"run.out_dir='{Path(args.out) / name}'", f"run.seed={args.seed}", *args.set]
    if args.steps:
        overrides.append(f"run.steps={args.steps}")
    cfg = load_config(ROOT / CONFIGS[name], overrides=overrides, plugins=args.plugins or None)
    steps = cfg.run.steps
    cfg.eval.every = args.eval_every or steps  # by default one evaluation, after the last step
    cfg.checkpoint.every = steps
    t0 = time.perf_counter()
    trainer = Trainer(cfg, progress=False, overwrite=True).assemble()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    info = trainer.dataset.info
    users = info["num_users"]
    step_s = sum(r["step_s"] for r in result.history)
    steps_per_epoch = users / cfg.data.batch_size
    tag = "_unseen" if cfg.model.eval_ranking == "unseen" else ""
    final = {m: result.eval.get(f"eval/{m}{tag}") for m in METRICS}
    curve = [{"step": r["step"], **{m: r.get(f"eval/{m}{tag}") for m in METRICS}}
             for r in result.history if f"eval/hr@10{tag}" in r]
    return {"model": name, "config": CONFIGS[name], "split": args.split, "steps": steps,
            "epochs": steps / steps_per_epoch, "metrics": final, "curve": curve, "final_loss": result.final_loss,
            "train_s_per_epoch": step_s / steps * steps_per_epoch, "wall_s": wall,
            "num_items": info["num_items"], "items": info["items"], "users": users,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "plugins": args.plugins, "overrides": overrides}


def table(rows: list[dict]) -> str:
    head = ["model"] + [f"{w} {m.upper()}" for m in METRICS for w in ("gemzoo", "paper")]
    lines = ["| " + " | ".join(head + ["s / epoch", "epochs"]) + " |", "|" + "---|" * (len(head) + 2)]
    for r in rows:
        cells = [r["model"]]
        for m, paper in zip(METRICS, PAPER[r["model"]], strict=True):
            got = r["metrics"].get(m)
            mark = "" if got is None else (" ✓" if got >= paper * (1 - TOLERANCE) else " ✗")
            cells += ["—" if got is None else f"{got:.4f}{mark}", f"{paper:.4f}"]
        cells += [f"{r['train_s_per_epoch']:.2f}", f"{r['epochs']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="folder with MovieLens-1M ratings.dat and movies.dat")
    p.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--split", default="test", choices=("val", "test"), help="test: the paper's table")
    p.add_argument("--items", default="movies", choices=("movies", "rated", "auto"),
                   help="movies: the reference's 3,883 items (default)")
    p.add_argument("--steps", type=int, help="override run.steps (default: the config's full schedule)")
    p.add_argument("--eval-every", type=int, help="also evaluate every N steps (a curve); default: at the end")
    p.add_argument("--plugins", default="", help="extra --plugins, e.g. bf16")
    p.add_argument("--set", action="append", default=[], help="extra config overrides, as gemzoo train --set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in each run (0: leave it)")
    p.add_argument("--serial", action="store_true", help="one model after another in this process")
    p.add_argument("--out", default=str(ROOT / "runs" / "ml1m-repro"), help="output folder for the runs and JSON")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: train one model, write its JSON
    args = p.parse_args()
    for f in ("ratings.dat", "movies.dat") if args.items == "movies" else ("ratings.dat",):
        if not (Path(args.data) / f).is_file():
            print(f"ml1m_repro: {Path(args.data) / f} is missing; put MovieLens-1M's ratings.dat and movies.dat "
                  "there (https://grouplens.org/datasets/movielens/1m/)", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        row = train_one(args.one, args)
        (out / f"{args.one}.json").write_text(json.dumps(row, indent=1))
        shown = ", ".join(f"{m} {v:.4f}" for m, v in row["metrics"].items() if v is not None)
        print(f"ml1m_repro: {args.one} done: {row['steps']} steps in {row['wall_s']:.0f} s "
              f"({row['train_s_per_epoch']:.2f} s / epoch); {shown}", flush=True)
        return 0
    t0 = time.perf_counter()
    if args.serial:
        rows = [train_one(name, args) for name in args.models]
    else:
        base = [a for a in sys.argv[1:] if a != "--serial"]
        procs = {name: subprocess.Popen([sys.executable, __file__, *base, "--out", str(out), "--one", name])
                 for name in args.models}
        failed = [name for name, proc in procs.items() if proc.wait() != 0]
        if failed:
            print(f"ml1m_repro: {', '.join(failed)} failed (see above)", file=sys.stderr)
        rows = [json.loads((out / f"{n}.json").read_text()) for n in args.models if n not in failed]
    summary = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "wall_s": time.perf_counter() - t0,
               "paper": {k: dict(zip(METRICS, v, strict=True)) for k, v in PAPER.items()}, "runs": rows,
               "date": time.strftime("%Y-%m-%d")}
    (out / "ml1m_repro.json").write_text(json.dumps(summary, indent=1))
    if rows:
        print(f"\nMovieLens-1M, {args.split} split, unseen items ranked; {rows[0]['device']}, torch {rows[0]['torch']}; "
              f"✓: at or within {TOLERANCE:.0%} below the paper")
        print(table(rows))
        print(f"(s / epoch: training steps only, {len(rows)} runs side by side; wall {summary['wall_s']:.0f} s; "
              f"JSON in {out / 'ml1m_repro.json'})")
    return 1 if len(rows) < len(args.models) else 0


if __name__ == "__main__":
    sys.exit(main())
