"""Reproduce the HSTU paper's MovieLens-1M table: train sasrec, hstu and hstu-large with the shipped configs on
the test split (leave-one-out, every movie of movies.dat, history items left out of the ranking) for their full
schedule, over several seeds and optional kernel/precision variants; the table gives each row as mean ± std
beside the paper's, with the wall-clock time per run and the kernel and precision deltas.

The work is a plan of runs (model, seed, variant), each with an index (``--list``). A call trains a selection of
them (``--only``, ``--shard``), each in its own process, ``--jobs`` side by side, and writes each run's result
to its own JSON under --out as it finishes; a run already complete there is skipped, so a call that was cut off
resumes where it stopped. ``--max-wall-s`` bounds a call: no run starts that would not finish in time, and a run
still going then stops with a checkpoint (also written every ``--checkpoint-every`` steps) that the next call with
the same --out continues from (``--partial`` starts such runs on purpose, for runs longer than one call).
``--merge DIR...`` builds the table from the per-run JSONs of several folders (pieces run apart).
``--select-by METRIC`` adds early-stopped rows: runs on both splits with ``--eval-every`` curves give the test
metrics at the step the val curve is best in METRIC (the paper's figures are read that way, not at the last
epoch); ``--split test val`` plans each test run's val twin, so one call trains both and builds those rows.

    python bench/ml1m_repro.py --data data/ml-1m --seeds 0 1 2 --list                 # the plan: 9 runs
    python bench/ml1m_repro.py --data data/ml-1m --seeds 0 1 2 --out runs/ml1m          # train them all
    python bench/ml1m_repro.py --data data/ml-1m --seeds 0 1 2 --shard 2/3 --out runs/ml1m-2 \\
        --max-wall-s 570 --run-budget-s 300                                            # one bounded piece
    python bench/ml1m_repro.py --merge runs/ml1m-1 runs/ml1m-2 runs/ml1m-3 --out runs/ml1m   # the table
    python bench/ml1m_repro.py --data data/ml-1m --seeds 0 --variant short=@300 \\
        --variant reference=reference@300 --variant bf16=bf16                         # + kernel, precision rows
    python bench/ml1m_repro.py --data data/ml-1m --seeds 0 1 2 --split test val --eval-every 47 \
        --select-by ndcg@10 --out runs/ml1m-es                                       # + early-stopped rows

--data is a folder with MovieLens-1M's ratings.dat and movies.dat (never commit them). A variant
NAME=PLUGINS[@STEPS] trains the same configs with ``--plugins PLUGINS`` on top of their own (the base variant,
``shipped``, is the configs as they are), for STEPS steps when given. A kernel or precision delta compares a
variant with the ``shipped`` row of the same model, steps and seeds, so a shortened variant
(``reference=reference@300``) needs a shipped one of the same length (``short=@300``).
Hyper-parameters are the configs'; model choices were made on the validation split only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"sasrec": "configs/sasrec-ml1m.toml", "hstu": "configs/hstu-ml1m.toml",
           "hstu-large": "configs/hstu-large-ml1m.toml"}
# generative-recommenders README (ML-1M, full ranking over unseen items, test split)
PAPER = {"sasrec": (0.2853, 0.1603, 0.5474, 0.2185), "hstu": (0.3097, 0.1720, 0.5754, 0.2307),
         "hstu-large": (0.3294, 0.1893, 0.5935, 0.2481)}
METRICS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50")
TOLERANCE = 0.02  # a row passes at or above 98% of the paper's figure
LIMITS = {"kernel": 0.005, "precision": 0.01}  # |variant / shipped - 1| of every metric, same steps and seeds
BASE = "shipped"  # the variant name of the configs as shipped
RECORD = "ml1m-repro-run"  # the "kind" of a per-run JSON
EXIT_LEFT = 3  # some selected runs were not started (or were cut off) for lack of time: call again
MIN_PIECE_S = 60.0  # an unestimated or --partial run starts only with this long left (start-up takes part of it)


class UsageError(Exception):
    """A bad argument or input file; the message names the problem and the fix."""


# -- the plan ------------------------------------------------------------------------------------------------
def parse_variants(specs: list[str]) -> dict[str, tuple[str, int | None]]:
    """``NAME=PLUGINS[@STEPS]`` -> {name: (plugins, steps or None)}, the shipped variant first."""
    variants: dict[str, tuple[str, int | None]] = {BASE: ("", None)}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        plugins, at, steps = rest.partition("@")
        example = "e.g. bf16=bf16, reference=reference@300 or short=@300"
        if not sep or not name or not (plugins or at):
            raise UsageError(f"--variant {spec!r} must be NAME=PLUGINS[@STEPS], {example}")
        if not all(c.isalnum() or c in "-_." for c in name):
            raise UsageError(f"--variant {spec!r}: the name {name!r} is used in file names; use letters, digits, "
                             "'-', '_' and '.' only")
        if name in variants:
            raise UsageError(f"--variant {spec!r}: the name {name!r} is taken"
                             + (" by the configs as shipped" if name == BASE else "") + "; choose another")
        if at and not (steps.isdigit() and int(steps) > 0):
            raise UsageError(f"--variant {spec!r}: STEPS after '@' must be a whole number > 0, {example}")
        variants[name] = (plugins, int(steps) if at else None)
    return variants


def config_steps(model: str) -> int:
    with open(ROOT / CONFIGS[model], "rb") as f:
        return int(tomllib.load(f)["run"]["steps"])


def plan(args) -> list[dict]:
    """Every planned run, in index order: variants (as given, shipped first), then models, then seeds, then
    splits (a seed's runs on each split side by side: ``--split test val`` plans each test run's val twin)."""
    runs = []
    for variant, (plugins, steps) in parse_variants(args.variant).items():
        for model in args.models:
            full = config_steps(model)
            for seed in args.seeds:
                n = steps or args.steps or full
                for split in args.split:
                    runs.append({"index": len(runs), "model": model, "seed": seed, "variant": variant,
                                 "plugins": plugins, "steps": n, "config_steps": full, "split": split,
                                 "tag": f"{model}_{variant}_{split}_{n}steps_seed{seed}"})
    return runs


def run_key(run: dict, args) -> dict:
    """What must agree for a stored result to stand for a planned run."""
    return {"model": run["model"], "plugins": run["plugins"], "seed": run["seed"], "steps": run["steps"],
            "split": run["split"], "items": args.items, "set": list(args.set)}


def parse_only(text: str, count: int) -> list[int]:
    picked = []
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            picked += list(range(int(lo), int(hi) + 1)) if dash else [int(part)]
        except ValueError:
            raise UsageError(f"--only {text!r}: expected indices and ranges, e.g. 0,3,5-8") from None
    bad = [i for i in picked if not 0 <= i < count]
    if bad:
        raise UsageError(f"--only {text!r}: {bad} not in the plan's indices 0..{count - 1}; see --list")
    return sorted(set(picked))


def parse_shard(text: str) -> tuple[int, int]:
    k, slash, n = text.partition("/")
    if not (slash and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise UsageError(f"--shard {text!r} must be K/N with 1 <= K <= N, e.g. 2/3 (the second of three pieces)")
    return int(k), int(n)


def select(runs: list[dict], args) -> list[dict]:
    """``--only`` indices, then ``--shard K/N`` (every N-th of those, starting at the K-th)."""
    if args.only is not None:
        keep = set(parse_only(args.only, len(runs)))
        runs = [r for r in runs if r["index"] in keep]
    if args.shard:
        k, n = parse_shard(args.shard)
        runs = runs[k - 1::n]
    return runs


def stored(run: dict, out: Path, args) -> dict | None:
    """The complete result of ``run`` under ``out``, or None. One made with other settings is an error (it would
    be overwritten or mistaken for this run)."""
    path = out / f"{run['tag']}.json"
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a torn write of an older version: train again
    if rec.get("kind") != RECORD or not rec.get("complete"):
        return None
    if rec.get("key") != run_key(run, args):
        raise UsageError(f"{path} holds a run with other settings ({rec.get('key')}) than planned "
                         f"({run_key(run, args)}); use another --out or remove that file")
    return rec


# -- one run ---------------------------------------------------------------------------------------------------
def checkpointed_step(run: dict, out: Path) -> int:
    """The step of the newest checkpoint in ``run``'s folder under ``out`` (0: none): a run cut off there."""
    steps = [int(p.name[5:]) for p in (out / run["tag"] / "checkpoints").glob("step-*") if p.name[5:].isdigit()]
    return max(steps, default=0)


def segments_path(run: dict, out: Path) -> Path:
    return out / f".{run['tag']}.segments.json"


def train_one(run: dict, out: Path, args, jobs: int) -> dict:
    """Train one planned run in this process, from the checkpoint it was cut off at if its folder has one;
    returns its record (final metrics, timings over every piece it ran in, settings)."""
    import torch

    from gemzoo.api import Trainer, TrainingInterrupted, attention_sites, load_config

    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.data)
    folder = out / run["tag"]
    overrides = [f"data.path='{data / 'ratings.dat'}'", f"data.items='{args.items}'",
                 f"data.eval_split='{run['split']}'", f"run.out_dir='{folder}'", f"run.seed={run['seed']}",
                 f"run.steps={run['steps']}", *args.set]
    if (data / "movies.dat").is_file():
        overrides.insert(1, f"data.movies_path='{data / 'movies.dat'}'")
    cfg = load_config(ROOT / CONFIGS[run["model"]], overrides=overrides, plugins=run["plugins"] or None)
    steps = cfg.run.steps
    cfg.eval.every = args.eval_every or steps  # by default one evaluation, after the last step
    cfg.checkpoint.every = min(args.checkpoint_every, steps) if args.checkpoint_every else steps
    resume = checkpointed_step(run, out) > 0
    seg_file = segments_path(run, out)
    segments = json.loads(seg_file.read_text()) if resume and seg_file.is_file() else []
    t0 = time.perf_counter()
    trainer = Trainer(cfg, progress=False, overwrite=not resume, resume=resume).assemble()
    start = trainer.start_step
    if start:
        print(f"ml1m_repro: [{run['index']}] {run['tag']} continues from its checkpoint at step {start}", flush=True)
    kernels = sorted({site.kernel_name for site in attention_sites(trainer.model).values()})
    try:
        result = trainer.fit()
    except TrainingInterrupted as e:  # cut off: the next call continues from the checkpoint it wrote
        segments.append({"from": start, "to": e.step, "wall_s": time.perf_counter() - t0})
        write_json(seg_file, segments)
        raise
    segments.append({"from": start, "to": steps, "wall_s": time.perf_counter() - t0})
    info = trainer.dataset.info
    users = info["num_users"]
    history = result.history or [{"step_s": 0.0}]
    steady = [r["step_s"] for r in history[5:]] or [r["step_s"] for r in history]
    steps_per_epoch = users / cfg.data.batch_size
    tag = "_unseen" if cfg.model.eval_ranking == "unseen" else ""
    final = {m: result.eval.get(f"eval/{m}{tag}") for m in METRICS}
    curve = []
    metrics_file = folder / "metrics.jsonl"
    for line in metrics_file.read_text().splitlines() if metrics_file.is_file() else []:
        row = json.loads(line)
        if f"eval/hr@10{tag}" in row and "step" in row and "event" not in row:  # the end event repeats the last
            curve.append({"step": row["step"], **{m: row.get(f"eval/{m}{tag}") for m in METRICS}})
    return {"kind": RECORD, "complete": True, "key": run_key(run, args), "tag": run["tag"],
            "model": run["model"], "variant": run["variant"], "config": CONFIGS[run["model"]],
            "plugins": run["plugins"], "seed": run["seed"], "split": run["split"], "items": args.items,
            "set": list(args.set), "steps": steps, "config_steps": run["config_steps"],
            "epochs": steps / steps_per_epoch, "metrics": final, "curve": curve, "final_loss": result.final_loss,
            "attention": kernels, "precision": cfg.plugins.precision,
            "train_s_per_epoch": sum(r["step_s"] for r in history) / len(history) * steps_per_epoch,
            "wall_s": sum(seg["wall_s"] for seg in segments), "segments": segments, "jobs": jobs,
            "step_ms": 1e3 * sum(steady) / len(steady),
            "num_items": info["num_items"], "items_source": info["items"], "users": users,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
            "overrides": overrides}


def git_commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it (the code that ran is then not
    that commit's alone); None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def write_json(path: Path, obj) -> None:
    """Written whole or not at all (a run cut off mid-write leaves no half file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# -- the table -------------------------------------------------------------------------------------------------
def load_records(sources: list[Path]) -> list[dict]:
    """Every complete per-run record in ``sources`` (folders of per-run JSONs, or table.json files, whose runs
    count too); a run found twice (same settings and seed) counts once."""
    found: dict[str, dict] = {}
    for src in sources:
        if src.is_dir():
            files = sorted(p for p in src.glob("*.json") if not p.name.startswith("."))
        elif src.is_file():
            files = [src]
        else:
            raise UsageError(f"--merge: {src} is neither a folder nor a file; give the --out folders of the pieces")
        for path in files:
            try:
                obj = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise UsageError(f"--merge: {path} is not JSON ({e}); remove it or fix it") from None
            recs = obj.get("runs", []) if isinstance(obj, dict) and obj.get("kind") == "ml1m-repro-table" else [obj]
            for rec in recs:
                # an early-stopped record is read from its runs' curves, never from a file (a table.json written
                # before they were kept apart lists them among its runs)
                if isinstance(rec, dict) and rec.get("kind") == RECORD and rec.get("complete") \
                        and "selected_step" not in rec:
                    found.setdefault(json.dumps(rec["key"], sort_keys=True), rec)
    return list(found.values())


def _row_key(rec: dict) -> tuple:
    return (rec["model"], rec["variant"], rec["plugins"], rec["steps"], rec["split"], rec["items"],
            tuple(rec["set"]))


def _mean_std(values: list[float]) -> tuple[float | None, float]:
    if not values:
        return None, 0.0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(records: list[dict]) -> list[dict]:
    """One row per (model, variant, steps, split, ...): each metric's mean and std over seeds, the pass mark
    against the paper (full schedule on the test split only), the mean and largest wall time per run."""
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault(_row_key(rec), []).append(rec)
    order = {m: i for i, m in enumerate(CONFIGS)}
    rows = []
    # per model: the longest runs first, the configs as shipped before their variants
    for key in sorted(groups, key=lambda k: (order.get(k[0], 99), -k[3], k[2] != "", k[1], k[4])):
        mine = sorted(groups[key], key=lambda r: r["seed"])
        first = mine[0]
        comparable = first["split"] == "test" and first["steps"] == first["config_steps"]
        row = {"model": first["model"], "variant": first["variant"], "plugins": first["plugins"],
               "steps": first["steps"], "config_steps": first["config_steps"], "split": first["split"],
               "items": first["items"], "set": first["set"], "seeds": [r["seed"] for r in mine],
               "attention": first["attention"], "precision": first["precision"],
               "wall_s": statistics.fmean(r["wall_s"] for r in mine), "wall_s_max": max(r["wall_s"] for r in mine),
               "jobs": sorted({r.get("jobs") for r in mine if r.get("jobs")}),
               "step_ms": statistics.fmean(r["step_ms"] for r in mine),
               "train_s_per_epoch": statistics.fmean(r["train_s_per_epoch"] for r in mine),
               "epochs": first["epochs"], "devices": sorted({r["device"] for r in mine}),
               "commits": sorted({r.get("commit") or "?" for r in mine}), "paper_comparable": comparable,
               "metrics": {}, "passes": {}, "per_seed": {str(r["seed"]): r["metrics"] for r in mine}}
        for m, paper in zip(METRICS, PAPER[first["model"]], strict=True):
            mean, std = _mean_std([r["metrics"][m] for r in mine if r["metrics"].get(m) is not None])
            row["metrics"][m] = {"mean": mean, "std": std}
            row["passes"][m] = (mean >= paper * (1 - TOLERANCE)) if comparable and mean is not None else None
        rows.append(row)
    return rows


def deltas(rows: list[dict]) -> list[dict]:
    """Each variant row against the row of the configs as shipped (no extra plugins: ``shipped`` or a shortened
    ``NAME=@STEPS``) of the same model, steps, split and settings, over the seeds
    both have: a kernel delta (the attention kernels differ, the precision does not; limit 0.5%), a precision
    delta (the other way round; limit 1%), or another change (no limit)."""
    out = []
    for row in rows:
        if not row["plugins"]:
            continue
        entry = {"model": row["model"], "variant": row["variant"], "steps": row["steps"], "split": row["split"],
                 "attention": row["attention"], "precision": row["precision"], "kind": None, "limit": None,
                 "seeds": [], "within": None}
        same = [b for b in rows if not b["plugins"]
                and all(b[k] == row[k] for k in ("model", "steps", "split", "items", "set"))]
        if not same:
            entry["note"] = (f"no run of the configs as shipped with {row['steps']} steps on the {row['split']} "
                             f"split to compare with; add --variant NAME=@{row['steps']}")
            out.append(entry)
            continue
        base = same[0]
        kernel, precision = row["attention"] != base["attention"], row["precision"] != base["precision"]
        kind = "kernel" if kernel and not precision else "precision" if precision and not kernel else "other"
        seeds = sorted(set(row["per_seed"]) & set(base["per_seed"]), key=int)
        entry.update(kind=kind, limit=LIMITS.get(kind), seeds=[int(s) for s in seeds], against={
            "variant": base["variant"], "attention": base["attention"], "precision": base["precision"]})
        if not seeds:
            entry["note"] = f"no seed in common with the {base['variant']} row (seeds {base['seeds']} and {row['seeds']})"
            out.append(entry)
            continue
        entry["delta"] = {}
        for m in METRICS:
            mine = [row["per_seed"][s].get(m) for s in seeds]
            theirs = [base["per_seed"][s].get(m) for s in seeds]
            ok = None not in mine and None not in theirs and statistics.fmean(theirs) > 0
            entry["delta"][m] = statistics.fmean(mine) / statistics.fmean(theirs) - 1 if ok else None
        values = [d for d in entry["delta"].values() if d is not None]
        if entry["limit"] is not None and values:
            entry["within"] = all(abs(d) <= entry["limit"] for d in values)
        out.append(entry)
    return out


def _secs(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _pct(x: float) -> str:
    return f"{x:+.2%}"


def table_md(rows: list[dict], delta_rows: list[dict]) -> str:
    head = ["model", "variant", "kernel, precision", "split", "steps"] + [m.upper() for m in METRICS] + \
        ["ms / step", "s / run", "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        cells = [r["model"], r["variant"] + (f" ({r['plugins']})" if r["plugins"] else ""),
                 f"{'+'.join(r['attention'])}, {r['precision']}", r["split"], str(r["steps"])]
        for m, paper in zip(METRICS, PAPER[r["model"]], strict=True):
            mean, std = r["metrics"][m]["mean"], r["metrics"][m]["std"]
            if mean is None:
                cells.append("—")
                continue
            passed = r["passes"][m]
            mark = "" if passed is None else " ✓" if passed else f" ✗ ({mean / paper - 1:+.1%})"
            cells.append(f"{mean:.4f} ± {std:.4f}{mark}")
        wall = _secs(r["wall_s"]) + (f" (max {_secs(r['wall_s_max'])})" if len(r["seeds"]) > 1 else "")
        cells += [f"{r['step_ms']:.1f}", wall, ", ".join(map(str, r["seeds"]))]
        lines.append("| " + " | ".join(cells) + " |")
        if i + 1 == len(rows) or rows[i + 1]["model"] != r["model"]:
            lines.append(f"| {r['model']} | paper | | test | {r['config_steps']} | "
                         + " | ".join(f"{v:.4f}" for v in PAPER[r["model"]]) + " | | | |")
    if delta_rows:
        lines += ["", "Deltas against the configs as shipped, same model, steps and seeds (kernel: within "
                      f"{LIMITS['kernel']:.1%}, precision: within {LIMITS['precision']:.0%}):", "",
                  "| model | variant | steps | change | " + " | ".join(m.upper() for m in METRICS)
                  + " | limit | within |", "|" + "---|" * (6 + len(METRICS))]
        for d in delta_rows:
            if "delta" not in d:
                lines.append(f"| {d['model']} | {d['variant']} | {d['steps']} | — | "
                             + " | ".join("—" for _ in METRICS) + f" | | {d['note']} |")
                continue
            change = (f"{'+'.join(d['against']['attention'])} → {'+'.join(d['attention'])}" if d["kind"] == "kernel"
                      else f"{d['against']['precision']} → {d['precision']}" if d["kind"] == "precision"
                      else "kernels and precision")
            cells = [_pct(v) if v is not None else "—" for v in d["delta"].values()]
            limit = f"{d['limit']:.1%}" if d["limit"] is not None else "—"
            within = "—" if d["within"] is None else "✓" if d["within"] else "✗"
            lines.append(f"| {d['model']} | {d['variant']} | {d['steps']} | {d['kind']}: {change} | "
                         + " | ".join(cells) + f" | {limit} | {within} (seeds {', '.join(map(str, d['seeds']))}) |")
    return "\n".join(lines)


def early_stopped(records: list[dict], metric: str) -> list[dict]:
    """The test figures at the epoch the validation split picks, as the reference's authors read their table
    (the last epoch is not it: github.com/meta-recsys/generative-recommenders/issues/61). For every run on the test split
    whose twin on the val split (same model, variant, plugins, steps, items, settings and seed) has an
    evaluation curve (``--eval-every``), the val curve's first step with the best ``metric`` is taken and the
    test curve's metrics at that step make a new record, variant ``<variant>+es``."""
    def twin_key(rec: dict) -> tuple:
        return (rec["model"], rec["variant"], rec["plugins"], rec["steps"], rec["items"], tuple(rec["set"]),
                rec["seed"])

    val = {twin_key(r): r for r in records if r["split"] == "val" and r.get("curve")}
    out = []
    for rec in records:
        twin = val.get(twin_key(rec))
        if rec["split"] != "test" or twin is None or not rec.get("curve"):
            continue
        scored = [p for p in twin["curve"] if p.get(metric) is not None]
        if not scored:
            continue
        best = max(scored, key=lambda p: p[metric])  # max keeps the first of equal values
        at = {p["step"]: p for p in rec["curve"]}.get(best["step"])
        if at is None:
            continue
        variant = f"{rec['variant']}+es"
        out.append({**rec, "variant": variant, "key": {**rec["key"], "select": metric},
                    "tag": rec["tag"].replace(rec["variant"], variant, 1),
                    "metrics": {m: at.get(m) for m in METRICS}, "selected_step": best["step"],
                    "selected_by": f"val {metric}", "epochs": rec["epochs"] * best["step"] / rec["steps"]})
    return out


def merge(sources: list[Path], out: Path, command: str, select: str | None = None) -> tuple[list[dict], str]:
    """Write table.md and table.json into ``out`` from the runs in ``sources``; returns the rows and the text.
    ``select``: also the early-stopped rows (:func:`early_stopped`) by this validation metric."""
    trained = load_records(sources)
    derived = early_stopped(trained, select) if select else []
    records = trained + derived
    rows = summarise(records)
    delta_rows = deltas(rows)
    devices = sorted({r["device"] for r in records})
    torches = sorted({r["torch"] for r in records})
    note = (f"MovieLens-1M, unseen items ranked; {', '.join(devices) or 'no runs'}, torch {', '.join(torches)}; "
            f"mean ± std over seeds; ✓: at or within {TOLERANCE:.0%} below the paper (test split, full schedule "
            f"only); s / run: wall-clock of one run, evaluation included; ms / step: mean step after the first 5")
    text = note + "\n\n" + table_md(rows, delta_rows) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    write_json(out / "table.json", {
        "kind": "ml1m-repro-table", "command": command, "sources": [str(s) for s in sources],
        "date": time.strftime("%Y-%m-%d"), "tolerance": TOLERANCE, "limits": LIMITS,
        "paper": {k: dict(zip(METRICS, v, strict=True)) for k, v in PAPER.items()}, "rows": rows,
        "deltas": delta_rows, "runs": sorted(trained, key=lambda r: (r["model"], r["variant"], r["seed"])),
        "early_stopped": sorted(derived, key=lambda r: (r["model"], r["variant"], r["seed"]))})
    return rows, text


# -- the calls -------------------------------------------------------------------------------------------------
def expected_s(run: dict, done: list[dict], args, out: Path) -> float | None:
    """Seconds ``run`` is expected to take: the longest measured run of its model and plugins (scaled to its
    steps), else --run-budget-s; for a run cut off at a checkpoint, the part still to train."""
    same = [r["wall_s"] * run["steps"] / r["steps"] for r in done
            if r["model"] == run["model"] and r["plugins"] == run["plugins"]]
    full = max(same) if same else args.run_budget_s
    return None if full is None else full * (1 - checkpointed_step(run, out) / run["steps"])


def run_calls(runs: list[dict], todo: list[dict], out: Path, args, argv: list[str]) -> int:
    """Train ``todo`` in child processes, ``jobs`` side by side, within --max-wall-s; returns the exit code."""
    t0 = time.monotonic()
    width = args.jobs or default_jobs()
    deadline = t0 + args.max_wall_s if args.max_wall_s else None
    done = [r for r in (stored(x, out, args) for x in runs) if r is not None]
    running: dict[int, tuple[subprocess.Popen, dict]] = {}
    pending, failed, left, cut = list(todo), [], [], []
    print(f"ml1m_repro: {len(todo)} runs to train, {width} side by side"
          + (f", within {args.max_wall_s:.0f} s" if deadline else ""), flush=True)
    while pending or running:
        while pending and len(running) < width:
            run = pending[0]
            need = expected_s(run, done, args, out)
            if deadline is not None:
                spare = deadline - time.monotonic() - args.grace_s
                if need is None and spare >= MIN_PIECE_S:
                    print(f"ml1m_repro: no time estimate for {run['tag']} (no run of it measured in {out}); "
                          "give --run-budget-s to bound it", file=sys.stderr, flush=True)
                elif need is None or need > spare:
                    if not (args.partial and need is not None and spare >= MIN_PIECE_S):
                        left.append(pending.pop(0))
                        needs = "an unknown time" if need is None else f"about {need:.0f} s"
                        print(f"ml1m_repro: [{run['index']}] {run['tag']} not started: it needs {needs} and "
                              f"{max(spare, 0):.0f} s are left", flush=True)
                        continue
                    print(f"ml1m_repro: [{run['index']}] {run['tag']} needs about {need:.0f} s, {spare:.0f} s are "
                          "left: --partial trains it until --max-wall-s and keeps its checkpoint", flush=True)
            pending.pop(0)
            cmd = [sys.executable, __file__, *argv, "--out", str(out), "--jobs", str(width), "--one", str(run["index"])]
            running[run["index"]] = (launch(cmd), run)
            print(f"ml1m_repro: [{run['index']}] {run['tag']} started", flush=True)
        time.sleep(0.2)
        for index, (proc, run) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[index]
            rec = stored(run, out, args) if rc == 0 else None
            if rec is None:
                failed.append(run)
            else:
                done.append(rec)
        if deadline is not None and time.monotonic() > deadline and running:
            for proc, run in running.values():
                proc.send_signal(signal.SIGTERM)
                cut.append(run)
                print(f"ml1m_repro: [{run['index']}] {run['tag']} cut off at --max-wall-s; the next call with the "
                      f"same --out continues it from its checkpoint", file=sys.stderr, flush=True)
            for proc, _ in running.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            running.clear()
    complete = len(todo) - len(failed) - len(left) - len(cut)
    print(f"ml1m_repro: {complete} of {len(todo)} runs complete in {time.monotonic() - t0:.0f} s", flush=True)
    if failed:
        print(f"ml1m_repro: failed: {', '.join(r['tag'] for r in failed)} (see above)", file=sys.stderr)
    if left or cut:
        print(f"ml1m_repro: {len(left) + len(cut)} runs left ({', '.join(str(r['index']) for r in left + cut)}); "
              "call again with the same arguments and --out to continue", file=sys.stderr)
    return 1 if failed else EXIT_LEFT if left or cut else 0


def launch(cmd: list[str]) -> subprocess.Popen:
    """One run's process (its own, so each run starts from a fresh interpreter, device and random state)."""
    return subprocess.Popen(cmd)


def default_jobs() -> int:
    import torch

    return 3 if torch.cuda.is_available() else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--data", help="folder with MovieLens-1M ratings.dat and movies.dat (to train)")
    p.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per seed (the table: mean ± std)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=PLUGINS[@STEPS]",
                   help="also train with --plugins PLUGINS (for STEPS steps), e.g. bf16=bf16, "
                        "reference=reference@300, short=@300")
    p.add_argument("--split", nargs="+", default=["test"], choices=("val", "test"),
                   help="test: the paper's table; test val: each test run with its val twin, for --select-by")
    p.add_argument("--items", default="movies", choices=("movies", "rated", "auto"),
                   help="movies: the reference's 3,883 items (default)")
    p.add_argument("--steps", type=int, help="override run.steps (default: the config's full schedule)")
    p.add_argument("--eval-every", type=int, help="also evaluate every N steps (a curve); default: at the end")
    p.add_argument("--set", action="append", default=[], help="extra config overrides, as gemzoo train --set")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in each run (0: leave it)")
    p.add_argument("--out", default=str(ROOT / "runs" / "ml1m-repro"),
                   help="folder of the per-run JSONs, run folders and the table")
    sel = p.add_argument_group("selection and time")
    sel.add_argument("--list", action="store_true", help="print the planned runs with their index and status")
    sel.add_argument("--only", metavar="IDX[,IDX]", help="train only these plan indices (ranges: 3-5)")
    sel.add_argument("--shard", metavar="K/N", help="train the K-th of N pieces of the plan (every N-th run)")
    sel.add_argument("--jobs", type=int, default=0, help="runs side by side (default: 3 on a GPU, 1 on CPU)")
    sel.add_argument("--max-wall-s", type=float, help="start no run that would end later than this many seconds "
                                                      "after the call began; cut off what still runs then")
    sel.add_argument("--run-budget-s", type=float,
                     help="expected seconds of one run, until a run of the same model and variant is measured")
    sel.add_argument("--grace-s", type=float, default=30.0, help="margin kept free before --max-wall-s")
    sel.add_argument("--partial", action="store_true",
                     help="also start runs that cannot finish before --max-wall-s: they stop there with a "
                          "checkpoint, and a later call with the same --out continues them")
    sel.add_argument("--checkpoint-every", type=int, default=500,
                     help="checkpoint each run every N steps (a run cut off continues from the last; 0: at the end)")
    sel.add_argument("--merge", nargs="*", metavar="DIR",
                     help="build table.md and table.json in --out from the per-run JSONs of these folders "
                          "(none: --out itself); trains nothing")
    sel.add_argument("--select-by", metavar="METRIC", choices=METRICS,
                     help="also rows '<variant>+es': the test metrics at the step where the val twin's curve "
                          "(--eval-every; --split test val, or --merge of folders of each split) is best in METRIC, "
                          "as the paper's table is read")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: train plan index N, write its JSON
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    out = Path(args.out)
    command = " ".join([Path(sys.executable).name, "bench/ml1m_repro.py", *argv])
    try:
        if args.merge is not None:
            sources = [Path(s) for s in args.merge] or [out]
            rows, text = merge(sources, out, command, args.select_by)
            print(text)
            print(f"ml1m_repro: {len(rows)} rows from {sum(len(r['seeds']) for r in rows)} runs; "
                  f"table.md and table.json in {out}")
            return 0 if rows else 1
        if len(set(args.split)) != len(args.split):
            raise UsageError(f"--split {' '.join(args.split)} names a split twice; give each once, e.g. --split test val")
        if args.select_by and not args.eval_every:
            raise UsageError(f"--select-by {args.select_by} reads the val run's curve, and runs evaluate only at "
                             "the end without --eval-every; add --eval-every N (e.g. 47, every epoch)")
        runs = plan(args)
        chosen = select(runs, args)
        if args.list:
            lines = [f"{'idx':>4}  {'model':<11}{'seed':>5}  {'variant':<14}{'plugins':<16}{'split':<6}{'steps':>6}"
                     "  status"]
            for r in chosen:
                rec = stored(r, out, args)
                at = 0 if rec else checkpointed_step(r, out)
                status = f"done ({rec['wall_s']:.0f} s)" if rec else f"at step {at} (checkpoint)" if at else "to train"
                lines.append(f"{r['index']:>4}  {r['model']:<11}{r['seed']:>5}  {r['variant']:<14}"
                             f"{r['plugins'] or '-':<16}{r['split']:<6}{r['steps']:>6}  {status}")
            print("\n".join(lines))
            print(f"({len(chosen)} of {len(runs)} planned runs; results in {out})")
            return 0
        if not args.data:
            raise UsageError("--data is needed to train: a folder with MovieLens-1M's ratings.dat and movies.dat")
        for f in ("ratings.dat", "movies.dat") if args.items == "movies" else ("ratings.dat",):
            if not (Path(args.data) / f).is_file():
                raise UsageError(f"{Path(args.data) / f} is missing; put MovieLens-1M's ratings.dat and movies.dat "
                                 "there (https://grouplens.org/datasets/movielens/1m/)")
        out.mkdir(parents=True, exist_ok=True)
        if args.one is not None:
            from gemzoo.api import TrainingInterrupted

            run = runs[args.one]
            try:
                rec = train_one(run, out, args, args.jobs or 1)
            except TrainingInterrupted as e:  # cut off at --max-wall-s: no record; the next call continues it
                print(f"ml1m_repro: [{run['index']}] {run['tag']} stopped by {e.signal_name} at step {e.step}; "
                      f"checkpoint {e.checkpoint} kept", file=sys.stderr, flush=True)
                return 4
            write_json(out / f"{run['tag']}.json", rec)
            segments_path(run, out).unlink(missing_ok=True)
            shown = ", ".join(f"{m} {v:.4f}" for m, v in rec["metrics"].items() if v is not None)
            print(f"ml1m_repro: [{run['index']}] {run['tag']} done: {rec['steps']} steps in {rec['wall_s']:.0f} s; "
                  f"{shown}", flush=True)
            return 0
        todo = []
        for r in chosen:
            if stored(r, out, args) is not None:
                print(f"ml1m_repro: [{r['index']}] {r['tag']} already complete in {out}; skipped")
            else:
                todo.append(r)
        code = run_calls(runs, todo, out, args, argv) if todo else 0
        rows, text = merge([out], out, command, args.select_by)
        if rows:
            print("\n" + text)
            print(f"ml1m_repro: table.md and table.json in {out} (every complete run there, not only this call's)")
        return code
    except UsageError as e:
        print(f"ml1m_repro: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
