"""PNG plots of run folders and ablations (matplotlib, no display needed).

    gemzoo plot runs/a runs/b --out curves.png     # loss, throughput and eval curves of run folders

Honest axes: each eval metric family (AUC, logloss, HR@k, ...) gets its own panel, and a y-range is the data's
widened to at least ``MIN_SPAN`` (a metric in [0, 1]) or ``MIN_REL_SPAN`` of its size, so noise in the third
digit is not drawn as a trend. The loss is drawn per step (faint) with its smoothed trend (an EMA) on top.

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


MIN_SPAN = 0.05  # the least y-span of a panel whose values lie in [0, 1] (AUC, HR@k, ...)
MIN_REL_SPAN = 0.1  # otherwise, the least y-span as a share of the values' size (loss, logloss, samples/s)


def y_range(values: list[float], *, unit_interval: bool | None = None) -> tuple[float, float] | None:
    """The y-limits for ``values``: their range with 10% margins, widened about its middle to a span of at
    least ``MIN_SPAN`` (values in [0, 1]) or ``MIN_REL_SPAN`` times their largest magnitude; None for no values."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    lo, hi = min(values), max(values)
    if unit_interval is None:
        unit_interval = 0.0 <= lo and hi <= 1.0
    floor = MIN_SPAN if unit_interval else MIN_REL_SPAN * max(abs(lo), abs(hi), 1e-12)
    span = max((hi - lo) * 1.2, floor)
    mid = (lo + hi) / 2
    lo, hi = mid - span / 2, mid + span / 2
    if unit_interval:  # stay inside [0, 1] where the span allows
        lo, hi = (0.0, span) if lo < 0 else (lo, hi)
        lo, hi = (1.0 - span, 1.0) if hi > 1 else (lo, hi)
    elif min(values) >= 0 > lo:
        lo, hi = 0.0, hi - lo
    return lo, hi


def metric_family(key: str) -> str:
    """``eval/auc_click`` -> ``auc``; ``eval/logloss_conversion`` -> ``logloss``; ``eval/hr@10`` -> ``hr@10``."""
    return key.removeprefix("eval/").split("_")[0]


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, labels: list[str] | None = None) -> Path:
    """Loss (per step and its trend), samples/s, and one panel per eval metric family (AUC apart from logloss)
    of one or more run folders, in one PNG."""
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    labels = labels or [_label(d, recs) for d, recs in runs]
    eval_keys = sorted({k for _, recs in runs for r in recs for k in r if k.startswith("eval/")})
    families: dict[str, list[str]] = {}
    for key in eval_keys:
        families.setdefault(metric_family(key), []).append(key)
    panels = 2 + max(len(families), 1)
    fig = _figure(5 * panels, 4.2)
    ax_loss, ax_tput, *ax_evals = fig.subplots(1, panels)
    values: dict[object, list[float]] = {ax: [] for ax in (ax_loss, ax_tput, *ax_evals)}
    for i, ((_, recs), label) in enumerate(zip(runs, labels, strict=True)):
        c = COLORS[i % len(COLORS)]
        xs, ys = _series(recs, "loss")
        if len(xs) > 2:  # the per-step loss is noisy: faint, with its smoothed trend on top
            ax_loss.plot(xs, ys, color=c, lw=0.8, alpha=0.3)
            ax_loss.plot(xs, ema(ys), color=c, label=f"{label} (EMA {EMA_BETA:g})", lw=1.6)
        else:
            ax_loss.plot(xs, ys, color=c, label=label, lw=1.2, marker="o")
        values[ax_loss] += ys
        xs, ys = _series(recs, "samples_per_s")
        ax_tput.plot(xs, ys, color=c, label=label, lw=1.2)
        values[ax_tput] += ys
        for ax, keys in zip(ax_evals, families.values(), strict=False):
            for j, key in enumerate(keys):
                xs, ys = _series(recs, key)
                ax.plot(xs, ys, color=c, marker="os^vD*"[j % 6], ls=("-", "--", ":", "-.")[j % 4],
                        label=f"{label} {key.removeprefix('eval/')}")
                values[ax] += ys
    ax_loss.set(title="Training loss (faint: per step)", xlabel="step", ylabel="loss")
    ax_tput.set(title="Throughput", xlabel="step", ylabel="samples/s")
    for ax, family in zip(ax_evals, families, strict=False):
        ax.set(title=f"Eval: {family}", xlabel="step", ylabel=family)
    if not families:
        ax_evals[0].set(title="Eval metrics", xlabel="step")
        ax_evals[0].text(0.5, 0.5, "no eval metrics logged", ha="center", va="center",
                         transform=ax_evals[0].transAxes)
    for ax, ys in values.items():
        limits = y_range(ys)
        if limits is not None:
            ax.set_ylim(*limits)
    for ax in (ax_loss, ax_tput, *ax_evals):
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
            limits = y_range([r["_v"] for r in scored if r.get("status") == "ok"])
            if limits is not None:  # the spread, but never narrower than the floor: noise stays small
                fig.suptitle(f"Eval metrics per run (held-out batches; y-span at least {MIN_SPAN:g} for metrics "
                             f"in [0, 1], {MIN_REL_SPAN:.0%} of the value otherwise)")
                ax.set_ylim(*limits)
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
