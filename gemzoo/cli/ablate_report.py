"""What ``gemzoo ablate`` writes from its rows: ablation.csv, the PNG plots, report.md, the table, the machine
and the versions."""

from __future__ import annotations

import csv
import os
import platform
import time
from importlib import metadata
from pathlib import Path

from gemzoo import registry
from gemzoo.cli import plot
from gemzoo.errors import ConfigError

OUTPUTS = ("ablation.json", "ablation.csv", "report.md", "throughput.png", "memory.png", "loss.png", "eval.png")
CSV_COLUMNS = ("name", "plugins", "status", "mean_samples_per_s", "mean_mfu", "mean_step_s", "max_step_s",
               "samples_per_s", "tokens_per_s", "tflops", "mfu", "mfu_peak", "peak_mem_gib", "peak_mem_source", "final_loss",
               "step_s", "median_step_s", "compiles_after_warmup", "wall_s", "steps", "run_dir", "error")


def label(row: dict) -> str:
    """What tables and plots call a run: its name (the plugins, plus its own overrides if any)."""
    return row.get("name") or row["plugins"]


def write_report(data: dict, out: Path, echo=print) -> list[Path]:
    """ablation.csv, the PNGs and report.md from ``data`` (ablation.json). Without matplotlib the report
    says so and has no plots; ``gemzoo ablate --report DIR`` draws them later, on another machine."""
    write_csv(out / "ablation.csv", data["rows"])
    try:
        plots = plot.ablation_plots(data, out)
        data.pop("plots_skipped", None)
    except ConfigError as exc:  # matplotlib missing
        plots, data["plots_skipped"] = [], str(exc)
        echo(f"no plots: {exc}; draw them later with: gemzoo ablate --report {out}")
    (out / "report.md").write_text(render_report(data, plots))
    echo(f"wrote {out}/: ablation.json, ablation.csv, report.md" + "".join(f", {p.name}" for p in plots))
    return plots


def summary_line(row: dict) -> str:
    if row.get("status") != "ok":
        return f"FAILED: {row.get('error', '')}"
    ev = " ".join(f"{k}={v:.4g}" for k, v in row.get("eval", {}).items())
    mean = (f"mean {row['mean_samples_per_s']:.4g} samples/s, mean MFU {_pct(row['mean_mfu'])}, slowest step "
            f"{row['max_step_s']:.3g} s; median " if "mean_samples_per_s" in row else "")
    return (f"{mean}{row['samples_per_s']:.4g} samples/s, {_fmt_tflops(row['tflops'])} TFLOP/s, MFU "
            f"{_pct(row['mfu'])}, peak {row.get('peak_mem_gib', float('nan')):.3g} GiB, loss {row['final_loss']:.4f} "
            f"{ev}").strip()


def eval_keys(rows: list[dict]) -> list[str]:
    keys = []
    for r in rows:
        for k in r.get("eval", {}):
            if k not in keys:
                keys.append(k)
    return keys


def write_csv(path: Path, rows: list[dict]) -> None:
    evals = eval_keys(rows)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*CSV_COLUMNS, *evals])
        for r in rows:
            w.writerow([r.get(c, "") for c in CSV_COLUMNS] + [r.get("eval", {}).get(k, "") for k in evals])


def machine_info(rows: list[dict] | None = None) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "memory_gib": _mem_total_gib()}
    for r in rows or []:
        if r.get("status") == "ok" and r.get("device", "cpu") != "cpu":
            info["gpu"] = r["device"]
            info["gpu_memory_gib"] = round(r.get("device_memory_gib", 0.0), 1)
            break
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def versions() -> dict:
    """gemzoo, torch and friends, and every installed plugin distribution."""
    out = {}
    for dist in ("gemzoo", "torch", "triton", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        for info in registry.host().infos.values():
            if info.distribution not in out and info.distribution:
                out[info.distribution] = info.version
    except Exception:  # noqa: BLE001 - versions are informative; never fail the report for them
        pass
    return out


# --------------------------------------------------------------------------------------------- report
def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.3g}%"


def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _pct_or_blank(x) -> str:
    return "" if x is None else _pct(x)


def _fmt_tflops(x) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def table_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    rows = data["rows"]
    evals = eval_keys(rows)
    base = next((r for r in rows if r.get("status") == "ok"), None)
    header = ["plugins", "mean samples/s", "mean MFU", "slowest step s", "median samples/s", "tokens/s",
              "TFLOP/s", "median MFU", "peak GiB", "final loss", *[k.removeprefix("eval/") for k in evals],
              "vs first"]
    body = []
    for r in rows:
        if r.get("status") != "ok":
            err = str(r.get("error", "failed")).replace("|", "\\|").replace("\n", " ")
            body.append([f"`{label(r)}`", f"FAILED: {err[:200]}"] + [""] * (len(header) - 2))
            continue
        mean_key = "mean_samples_per_s" if "mean_samples_per_s" in r and "mean_samples_per_s" in base else \
            "samples_per_s"
        body.append([f"`{label(r)}`", _num(r.get("mean_samples_per_s"), ",.1f"), _pct_or_blank(r.get("mean_mfu")),
                     _num(r.get("max_step_s"), ".3g"), f"{r['samples_per_s']:,.1f}", f"{r['tokens_per_s']:,.0f}",
                     _fmt_tflops(r["tflops"]), _pct(r["mfu"]), f"{r['peak_mem_gib']:.2f}", f"{r['final_loss']:.4f}",
                     *[f"{r['eval'][k]:.4f}" if k in r.get("eval", {}) else "" for k in evals],
                     f"{r[mean_key] / base[mean_key]:.2f}x"])
    return header, body


def markdown_table(data: dict) -> str:
    header, body = table_rows(data)
    right = [h != "plugins" for h in header]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (reports read better)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def render_report(data: dict, plots: list[Path]) -> str:
    m, rows = data["machine"], data["rows"]
    ok = [r for r in rows if r.get("status") == "ok"]
    peaks = sorted({r["mfu_peak"] for r in ok})
    mem = sorted({r.get("peak_mem_source", "") for r in ok} - {""})
    machine = f"{m['cpu']} ({m['cpu_count']} cores, {m['memory_gib']} GiB)"
    if "gpu" in m:
        machine = f"{m['gpu']} ({m['gpu_memory_gib']} GiB); host {machine}"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(data["started"]))
    lines = [
        f"# Ablation: {Path(data['ablation']).stem}",
        "",
        f"`{_shown(data['config'])}` under {len(rows)} plugin sets, {data['steps']} steps each. The mean figures "
        f"are the steps after {data['warmup']} warm-up steps over their wall-clock time (samples, and model FLOPs "
        "for MFU, divided by the summed step times: stalls and compiles count); the slowest step is the longest "
        "after warm-up; the median columns are medians of those steps. Each set trained in its own process and "
        "run folder (`runs/`).",
        "",
        "```bash",
        data["command"] or "gemzoo ablate " + data["ablation"],
        "```",
        "",
        markdown_table(data),
        "",
        f"MFU peak: {'; '.join(peaks) or 'n/a'}. Peak memory: {'; '.join(mem) or 'n/a'}."
        + (f" Config overrides: `{' '.join(data['overrides'])}`." if data["overrides"] else ""),
        "",
    ]
    titles = {"throughput": "Throughput and MFU", "memory": "Peak memory", "loss": "Training loss",
              "eval": "Eval metrics"}
    for p in plots:
        lines += [f"## {titles.get(p.stem, p.stem)}", "", f"![{p.stem}]({p.name})", ""]
    if data.get("plots_skipped"):
        lines += [f"No plots: {data['plots_skipped']}. Draw them with `gemzoo ablate --report DIR`.", ""]
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["## Failures", ""]
        for r in failed:
            lines += [f"**`{label(r)}`**: {r.get('error', '')}", ""]
            if r.get("log_tail"):
                lines += ["```", r["log_tail"], "```", ""]
    lines += ["## Machine and versions", "",
              f"- machine: {machine}", f"- platform: {m['platform']}, Python {m['python']}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()),
              f"- date: {when}", ""]
    return "\n".join(lines)


