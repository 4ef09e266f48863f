"""PNG plots of run folders and ablations (matplotlib, no display needed).

    gemzoo plot runs/a runs/b --out curves.png     # loss, throughput and eval curves of run folders

``read_metrics`` is the one reader of ``metrics.jsonl``: a resumed run logs a ``start`` or ``resume`` event at
the step it resumed from, and the steps after that point that the earlier process had logged are superseded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gemzoo.errors import ConfigError

# One colour per run, in order (matplotlib's tab10, which reads well on white and in print).
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib (it is in requirements/cpu-lock.txt)") \
            from None
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The step records of ``run_dir/metrics.jsonl`` in step order, superseded ones (after a resume) dropped."""
    path = Path(run_dir) / "metrics.jsonl" if Path(run_dir).is_dir() else Path(run_dir)
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl; give a run folder (the run.out_dir of a training run)")
    by_step: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(path.read_text().splitlines()):
                continue  # a last line cut short by a crash
            raise ConfigError(f"{path}:{n} is not JSON; the file is corrupt") from None
        if rec.get("event") in ("start", "resume"):
            start = int(rec.get("step", 0))
            by_step = {s: r for s, r in by_step.items() if s <= start}
        elif "event" not in rec and "step" in rec:
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def _label(run_dir: Path, records: list[dict]) -> str:
    return run_dir.name if run_dir.name not in ("", ".") else str(run_dir)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, labels: list[str] | None = None) -> Path:
    """Loss, samples/s and eval curves of one or more run folders, one PNG with three panels."""
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    labels = labels or [_label(d, recs) for d, recs in runs]
    eval_keys = sorted({k for _, recs in runs for r in recs for k in r if k.startswith("eval/")})
    fig = _figure(15, 4.2)
    ax_loss, ax_tput, ax_eval = fig.subplots(1, 3)
    for i, ((_, recs), label) in enumerate(zip(runs, labels, strict=True)):
        c = COLORS[i % len(COLORS)]
        ax_loss.plot(*_series(recs, "loss"), color=c, label=label, lw=1.2)
        ax_tput.plot(*_series(recs, "samples_per_s"), color=c, label=label, lw=1.2)
        for j, key in enumerate(eval_keys):
            xs, ys = _series(recs, key)
            ax_eval.plot(xs, ys, color=c, marker="os^vD*"[j % 6], ls=("-", "--", ":", "-.")[j % 4],
                         label=f"{label} {key.removeprefix('eval/')}")
    ax_loss.set(title="Training loss", xlabel="step", ylabel="loss")
    ax_tput.set(title="Throughput", xlabel="step", ylabel="samples/s")
    ax_eval.set(title="Eval metrics", xlabel="step", ylabel="value")
    if not eval_keys:
        ax_eval.text(0.5, 0.5, "no eval metrics logged", ha="center", va="center", transform=ax_eval.transAxes)
    for ax in (ax_loss, ax_tput, ax_eval):
        ax.grid(alpha=0.3)
        entries = len(ax.get_legend_handles_labels()[0])
        if entries > 4:  # below the panel, so it never hides the curves
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        elif entries:
            ax.legend(fontsize=8)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


# --------------------------------------------------------------------------------------------- ablations
def _bars(ax, rows: list[dict], key: str, *, scale: float = 1.0, fmt: str = "{:.3g}", ylabel: str = "",
          title: str = ""):
    names = [r.get("name") or r["plugins"] for r in rows]  # a run's name: its plugins (+ its own overrides)
    xs = list(range(len(rows)))
    values = [r[key] * scale if r.get("status") == "ok" and key in r else 0.0 for r in rows]
    colors = [COLORS[i % len(COLORS)] for i in xs]
    bars = ax.bar(xs, values, color=colors)
    top = max(values, default=0.0) or 1.0
    failed = [r.get("status") != "ok" for r in rows]
    ax.bar_label(bars, labels=["" if f else fmt.format(v) for f, v in zip(failed, values, strict=True)], padding=2,
                 fontsize=8)
    for bar, f in zip(bars, failed, strict=True):
        if f:  # at the foot of the axes, whatever its y-limits
            ax.text(bar.get_x() + bar.get_width() / 2, 0.02, "failed", ha="center", va="bottom", fontsize=8,
                    color="#b00000", transform=ax.get_xaxis_transform())
    ax.set_xticks(xs, names, rotation=25, ha="right", fontsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)


SMOOTH_ABOVE = 20  # points; shorter curves are drawn as they are
EMA_BETA = 0.9


def ema(ys: list[float], beta: float = EMA_BETA) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing)."""
    out, m = [], 0.0
    for n, y in enumerate(ys, 1):
        m = beta * m + (1 - beta) * y
        out.append(m / (1 - beta**n))
    return out


def read_metrics_or_empty(out: Path, row: dict) -> list[dict]:
    try:
        return read_metrics(out / row["run_dir"]) if row.get("run_dir") else []
    except ConfigError:
        return []


def ablation_plots(data: dict, out: str | Path) -> list[Path]:
    """throughput.png, memory.png, loss.png and (when any run evaluated) eval.png of an ablation."""
    out = Path(out)
    rows = data["rows"]
    ok = [r for r in rows if r.get("status") == "ok"]
    peak = ok[0]["mfu_peak"] if ok else "n/a"
    width = max(7.0, 1.1 * len(rows) + 3)
    paths = []

    fig = _figure(2 * width, 4.5)
    a, b = fig.subplots(1, 2)
    _bars(a, rows, "samples_per_s", fmt="{:,.1f}", ylabel="samples/s", title="Throughput (median samples/s)")
    _bars(b, rows, "mfu", scale=100, fmt="{:.2f}%", ylabel="MFU %", title=f"MFU (peak: {peak})")
    fig.suptitle(f"{Path(data['ablation']).stem}: {data['steps']} steps, median after {data['warmup']} warm-up")
    paths.append(_save(fig, out / "throughput.png"))

    fig = _figure(width, 4.5)
    source = ok[0].get("peak_mem_source", "") if ok else ""
    _bars(fig.subplots(), rows, "peak_mem_gib", fmt="{:.2f}", ylabel="GiB",
          title=f"Peak memory per run ({source})" if source else "Peak memory per run")
    paths.append(_save(fig, out / "memory.png"))

    fig = _figure(9, 5)
    ax = fig.subplots()
    for i, r in enumerate(rows):
        records = read_metrics_or_empty(out, r)
        xs, ys = _series(records, "loss")
        style = "-" if r.get("status") == "ok" else ":"
        label = (r.get("name") or r["plugins"]) + ("" if r.get("status") == "ok" else " (failed)")
        color = COLORS[i % len(COLORS)]
        if len(xs) > SMOOTH_ABOVE:  # noisy per-step losses: faint raw curve, solid moving average on top
            ax.plot(xs, ys, ls=style, color=color, lw=0.8, alpha=0.25)
            ax.plot(xs, ema(ys), ls=style, color=color, label=label, lw=1.6)
        elif xs:
            ax.plot(xs, ys, ls=style, color=color, label=label, lw=1.2)
    smoothed = any(len(_series(read_metrics_or_empty(out, r), "loss")[0]) > SMOOTH_ABOVE for r in rows)
    ax.set(title="Training loss, all runs" + (f" (faint: per step; solid: EMA {EMA_BETA:g})" if smoothed else ""),
           xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "loss.png"))

    keys = []
    for r in ok:
        keys += [k for k in r.get("eval", {}) if k not in keys]
    if keys:
        ncols = min(len(keys), 2)
        nrows = -(-len(keys) // ncols)
        fig = _figure(width * ncols, 4.0 * nrows)
        axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
        for ax in axes[len(keys):]:
            ax.set_visible(False)
        for ax, key in zip(axes, keys, strict=False):
            scored = [dict(r, _v=r["eval"][key]) if r.get("status") == "ok" and key in r.get("eval", {})
                      else dict(r, status="failed") for r in rows]
            _bars(ax, scored, "_v", fmt="{:.4f}", ylabel=key.removeprefix("eval/"),
                  title=f"{key.removeprefix('eval/')} after {data['steps']} steps")
            vals = [r["_v"] for r in scored if r.get("status") == "ok"]
            if vals:  # zoom on the spread: eval metrics of an ablation differ in the 2nd or 3rd digit
                lo, hi = min(vals), max(vals)
                pad = max((hi - lo) * 0.6, 0.01 * max(abs(hi), 1e-6))
                fig.suptitle("Eval metrics per run (held-out batches; y-axes zoomed to the spread)")
                ax.set_ylim(max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad)
        paths.append(_save(fig, out / "eval.png"))
    return paths


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


# --------------------------------------------------------------------------------------------- CLI
def cmd_plot(args) -> int:
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.runs):
        raise ConfigError(f"--labels has {len(labels)} names for {len(args.runs)} runs; give one per run")
    out = args.out or (str(Path(args.runs[0]) / "curves.png") if len(args.runs) == 1 else "curves.png")
    print(plot_runs(args.runs, out, labels=labels))
    return 0
