"""``gemzoo runs [DIR]``: the run folders at or under DIR, each with its status, step, final metrics and plugins.

A run folder is any folder holding ``metrics.jsonl``. Its status comes from the last event there: ``finished``
(an ``end`` event), ``interrupted`` (SIGTERM or Ctrl-C; it resumes with ``--resume``), ``failed`` (its
``train.log`` ends with gemzoo's error, e.g. a loss that diverged), else ``unfinished`` (still training, or
killed). Plugins and ``run.steps`` come from
``config.toml``, the start time and commit from ``provenance.json``. Reads files only: no torch, no plugin.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomllib

from gemzoo.cli.info import plain_table
from gemzoo.errors import ConfigError

METRICS = "metrics.jsonl"  # gemzoo.train.run_folder.METRICS, named here so that this command imports no torch
CONFIG = "config.toml"
PROVENANCE = "provenance.json"
LOG = "train.log"


def find_runs(root: Path) -> list[Path]:
    """``root`` if it is a run folder, else every run folder under it, sorted."""
    if (root / METRICS).is_file():
        return [root]
    return sorted(p.parent for p in root.rglob(METRICS) if "checkpoints" not in p.parent.parts)


def _records(path: Path) -> list[dict]:
    out = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line a kill cut short
        if isinstance(record, dict):
            out.append(record)
    return out


def describe_run(folder: Path) -> dict[str, Any]:
    """One run's summary: status, step, steps, loss, eval metrics, plugins, started, commit."""
    records = _records(folder / METRICS)
    events = [r for r in records if "event" in r]
    rows = [r for r in records if "event" not in r and isinstance(r.get("step"), int)]
    last_event = events[-1]["event"] if events else None
    status = {"end": "finished", "interrupted": "interrupted"}.get(last_event, "unfinished")
    error = _last_error(folder / LOG) if status == "unfinished" else None
    if error:
        status = "failed"
    step = max([r["step"] for r in rows] + [e.get("step", 0) for e in events if isinstance(e.get("step"), int)],
               default=0)
    evals: dict[str, float] = {}
    for r in rows:
        evals.update({k: v for k, v in r.items() if k.startswith("eval/")})
    try:
        config = tomllib.loads((folder / CONFIG).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        config = {}
    plugins = config.get("plugins", {})
    chosen = [plugins.get(k) for k in ("attention", "precision", "planner", "comms", "batching")]
    chosen += list(plugins.get("memory", []))
    try:
        provenance = json.loads((folder / PROVENANCE).read_text()).get("runs", [])
    except (OSError, json.JSONDecodeError, AttributeError):
        provenance = []
    first = provenance[0] if provenance and isinstance(provenance[0], dict) else {}
    git = first.get("git") or {}
    return {"run": str(folder), "status": status, "step": step, "steps": config.get("run", {}).get("steps"),
            "loss": rows[-1].get("loss") if rows else None, "eval": evals,
            "plugins": [p for p in chosen if isinstance(p, str)], "started": first.get("time"),
            "commit": (git.get("commit", "")[:10] + ("+dirty" if git.get("dirty") else "")) if git else None,
            "error": error}


def _last_error(log: Path) -> str | None:
    """The error a failed run's ``train.log`` ends with; None when it does not end with one."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return None
    last = lines[-1] if lines else ""
    return last.removeprefix("gemzoo: error: ") if last.startswith("gemzoo: error: ") else None


def cmd_runs(args) -> int:
    root = Path(args.dir)
    if not root.exists():
        raise ConfigError(f"{root} does not exist; give a run folder or a folder of run folders "
                          "(gemzoo runs runs/, the default out_dir's parent)")
    runs = [describe_run(f) for f in find_runs(root)]
    if args.json:
        print(json.dumps(runs, indent=1))
        return 0
    if not runs:
        print(f"no run folders (folders with {METRICS}) under {root}")
        return 0
    table = []
    for r in runs:
        steps = f"{r['step']}/{r['steps']}" if r["steps"] else str(r["step"])
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        evals = " ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in r["eval"].items()) or "-"
        table.append((r["run"], r["status"], steps, loss, evals, ",".join(r["plugins"]) or "-",
                      (r["started"] or "-")[:16].replace("T", " ")))
    print(plain_table(("run", "status", "step", "loss", "final eval", "plugins", "started"), table))
    return 0
