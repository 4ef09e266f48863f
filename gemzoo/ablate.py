"""``gemzoo ablate F.toml``: train one config under several plugin sets and compare them.

    gemzoo ablate configs/ablations/gem-tiny.toml --steps 30 --out runs/ablations/gem-tiny

Every plugin set of the ablation file trains in its own process, into its own run folder
``DIR/runs/NN-<plugins>/`` (what ``gemzoo train`` writes there: ``metrics.jsonl``), with the process's output and
its summary beside it (``NN-<plugins>.log``, ``NN-<plugins>.json``), so each run's peak memory is
its own (CUDA ``max_memory_allocated``; on CPU the peak RSS of that run's process, its VmHWM) and
a crash or an out-of-memory in one set leaves the others running. The ablation folder ``DIR`` then gets:

    ablation.json  ablation.csv       one row per plugin set (medians after the warm-up steps)
    throughput.png memory.png loss.png eval.png
    report.md                         the table and the plots, the machine, versions and the exact command

A failing set keeps its row, with the error and the tail of its log.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemzoo.errors import ConfigError

MEDIAN_KEYS = ("samples_per_s", "tokens_per_s", "tflops", "mfu", "step_s")
OUTPUTS = ("ablation.json", "ablation.csv", "report.md", "throughput.png", "memory.png", "loss.png", "eval.png")
CSV_COLUMNS = ("name", "plugins", "status", "samples_per_s", "tokens_per_s", "tflops", "mfu", "mfu_peak", "peak_mem_gib",
               "peak_mem_source", "final_loss", "step_s", "wall_s", "steps", "run_dir", "error")


@dataclass
class AblationPlan:
    """What ``gemzoo ablate`` runs: resolved from the ablation file and the command line."""

    ablation: str
    config: str
    runs: list  # of gemzoo.config.AblationRun
    steps: int
    warmup: int
    overrides: list[str] = field(default_factory=list)
    out: Path = Path("runs/ablations/ablation")
    command: str = ""
    timeout_s: float | None = None


def slug(index: int, name: str) -> str:
    """``2, "jfa,bf16"`` -> ``02-jfa-bf16``: a run folder name that sorts in ablation order."""
    return f"{index:02d}-" + (re.sub(r"[^A-Za-z0-9_.]+", "-", name).strip("-")[:80] or "default")


def label(row: dict) -> str:
    """What tables and plots call a run: its name (the plugins, plus its own overrides if any)."""
    return row.get("name") or row["plugins"]


def make_plan(path: str, *, steps: int | None = None, warmup: int | None = None, out: str | None = None,
              overrides: list[str] | None = None, runs: list[str] | None = None, command: str = "",
              timeout_s: float | None = None) -> AblationPlan:
    from gemzoo.config import load_ablation

    ab = load_ablation(path)
    chosen = ab.runs
    if runs:
        by_name = {r.name: r for r in ab.runs}
        unknown = [r for r in runs if r not in by_name]
        if unknown:
            raise ConfigError(f"--runs {', '.join(unknown)}: not in {path}, whose runs are "
                              f"{', '.join(repr(r.name) for r in ab.runs)}")
        chosen = [by_name[r] for r in runs]
    steps = ab.steps if steps is None else steps
    warmup = ab.warmup if warmup is None else warmup
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    if warmup < 0:
        raise ConfigError(f"--warmup must be 0 or more, got {warmup}")
    out_dir = Path(out) if out else Path("runs") / "ablations" / Path(path).stem
    return AblationPlan(str(path), str(Path(ab.config).resolve()), chosen, steps, warmup,
                        [*ab.set, *(overrides or [])], out_dir, command, timeout_s)


def plan_from_config(config: str, runs: list[str], *, steps: int = 50, warmup: int = 5, out: str | None = None,
                     overrides: list[str] | None = None, command: str = "", timeout_s: float | None = None
                     ) -> AblationPlan:
    """A plan without an ablation file: ``config`` under each plugin set of ``runs`` (bench/e2e.py's form)."""
    from gemzoo.config import AblationRun, load_config
    from gemzoo.errors import PluginError

    if not runs:
        raise ConfigError("no plugin sets given; list some, e.g. jfa,bf16 cpu,fp32")
    for run in runs:
        try:
            load_config(config, overrides=overrides or [], plugins=run)
        except (ConfigError, PluginError) as exc:
            raise ConfigError(f"run {run!r}: {exc}") from None
    out_dir = Path(out) if out else Path("runs") / "ablations" / Path(config).stem
    return AblationPlan(str(config), str(Path(config).resolve()), [AblationRun(r) for r in runs], steps, warmup,
                        list(overrides or []), out_dir, command, timeout_s)


def prepare_out(out: Path, overwrite: bool) -> None:
    """Create the ablation folder. One that holds anything refuses, unless ``overwrite``: then only what
    ``gemzoo ablate`` writes (its files and ``runs/``) is removed."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"--out {out} is not empty; pass --overwrite to replace an earlier ablation there, "
                              "or choose another folder")
        shutil.rmtree(out / "runs", ignore_errors=True)
        for name in OUTPUTS:
            (out / name).unlink(missing_ok=True)
    (out / "runs").mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------------------------- one run
def child_main(spec_path: str) -> int:
    """Train one plugin set (run in its own process by ``run_one``) and write ``result.json``."""
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"plugins": spec["plugins"]}
    try:
        result.update(_train_and_summarise(spec))
    except BaseException as exc:  # noqa: BLE001 - the row must say what failed, whatever it was
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    cuda = sys.modules.get("torch") is not None and sys.modules["torch"].cuda.is_initialized()
    if "peak_mem_source" not in result and cuda:  # a GPU run that failed: how far it got before failing
        result["peak_mem_gib"] = sys.modules["torch"].cuda.max_memory_allocated() / 2**30
        result["peak_mem_source"] = "torch.cuda.max_memory_allocated"
    peak = peak_rss_bytes()
    if "peak_mem_source" not in result and peak is not None:  # CPU: this process's own high-water mark
        result["peak_mem_gib"] = peak / 2**30
        result["peak_mem_source"] = "peak RSS of the run's process"
    Path(spec["result"]).write_text(json.dumps(result, indent=1, default=str))
    return 0 if "error" not in result else 1


def peak_rss_bytes() -> int | None:
    """This process's peak resident set since its exec: VmHWM of /proc/self/status (Linux).

    Not ``getrusage().ru_maxrss``: on Linux that keeps the high-water mark of the address space the process
    replaced at exec, i.e. the parent's resident set at fork, so every run would report at least the
    ablation process's own size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if sys.platform == "darwin":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, and exec resets it there
    return None


def _train_and_summarise(spec: dict) -> dict:
    import torch

    from gemzoo import __version__
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    steps, warmup = spec["steps"], spec["warmup"]
    overrides = [*spec["overrides"], f"run.steps={steps}", "checkpoint.every=0",
                 f"run.out_dir={json.dumps(spec['run_dir'])}"]
    cfg = load_config(spec["config"], overrides=overrides, plugins=spec["plugins"])
    # a row per step; with run.sync = "log" a row (and a wait for the device) per warm-up's worth of steps, so the
    # first stretch is exactly the warm-up and the medians see whole stretches (result.history has every step)
    cfg.run.log_every = 1 if cfg.run.sync == "step" else max(1, warmup)
    if cfg.eval.every > 0:  # evaluate once, after the last step: timings stay clean
        cfg.eval.every = steps
    cuda = torch.cuda.is_available() and not cfg.run.device.startswith("cpu")
    if cuda:  # not on a CPU run: that would start CUDA, and the row would report CUDA's peak, not the RSS
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train(cfg, progress=False)
    wall = time.perf_counter() - t0
    history = result.history
    kept = history[warmup:] if len(history) > warmup else history
    out = {"status": "ok", "steps": len(history), "wall_s": wall, "final_loss": result.final_loss,
           "mfu_peak": history[-1]["mfu_peak"], "eval": dict(result.eval), "gemzoo": __version__,
           **{k: statistics.median(r[k] for r in kept) for k in MEDIAN_KEYS}}
    if cuda:
        out["peak_mem_gib"] = max(r["peak_mem_gib"] for r in history)
        out["peak_mem_source"] = "torch.cuda.max_memory_allocated"
        out["device"] = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        out["device_memory_gib"] = props.total_memory / 2**30
    else:
        out["device"] = "cpu"
    return out


def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_one(plan: AblationPlan, index: int, run) -> dict:
    """Train one :class:`~gemzoo.config.AblationRun` in a child process; return its row (with the error
    when it failed)."""
    plugins = run.plugins
    name = slug(index, run.name)
    runs = (plan.out / "runs").resolve()
    run_dir, log_path, result_path = runs / name, runs / f"{name}.log", runs / f"{name}.json"
    spec = {"config": plan.config, "plugins": plugins, "steps": plan.steps, "warmup": plan.warmup,
            "overrides": [*plan.overrides, *run.set], "run_dir": str(run_dir), "result": str(result_path)}
    spec_path = runs / f".{name}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gemzoo.ablate", "--child", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=_child_env())
        rc, rusage = _wait(proc, plan.timeout_s)
    spec_path.unlink()
    row = {"plugins": plugins, "name": run.name, "set": list(run.set),
           "run_dir": str(run_dir.relative_to(plan.out.resolve())),
           "log": str(log_path.relative_to(plan.out.resolve()))}
    if result_path.is_file():
        row.update(json.loads(result_path.read_text()))
    if "status" not in row:  # the child failed, or died before writing its result
        row["status"] = "failed"
        if "error" not in row:
            what = "timed out" if rc == "timeout" else f"exited with {_describe_rc(rc)}"
            row["error"] = f"the run's process {what}"
        row["log_tail"] = _tail(log_path)
        row.setdefault("wall_s", time.perf_counter() - t0)
    if row.get("peak_mem_source") is None and rusage is not None:
        # The run's process died before reporting: wait4's figure, an upper bound (see peak_rss_bytes).
        row["peak_mem_gib"] = rusage.ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 2**30
        row["peak_mem_source"] = "max RSS from wait4 (upper bound: includes the parent's size at fork)"
    row["run_seconds"] = time.perf_counter() - t0
    return row


def _wait(proc: subprocess.Popen, timeout_s: float | None):
    """Wait for ``proc``; return (exit code or "timeout", its own resource usage). If the wait itself is
    interrupted (Ctrl-C, SIGTERM), the run's process is killed first, so no orphan keeps training."""
    try:
        return _wait_for(proc, timeout_s)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            os.waitpid(proc.pid, 0)
            proc.returncode = -9
        raise


def _wait_for(proc: subprocess.Popen, timeout_s: float | None):
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG if deadline else 0)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, rusage
        if deadline and time.monotonic() > deadline:
            proc.kill()
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            return "timeout", rusage
        time.sleep(0.2)


def _describe_rc(rc) -> str:
    if isinstance(rc, int) and rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        hint = " (killed: out of memory?)" if -rc == signal.SIGKILL else ""
        return f"signal {name}{hint}"
    return f"code {rc}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------- the whole
def run_ablation(plan: AblationPlan, *, overwrite: bool = False, echo=print) -> dict:
    """Run every plugin set of ``plan``; write ablation.json/.csv, the plots and report.md into ``plan.out``."""
    prepare_out(plan.out, overwrite)
    started = time.time()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main else None  # SIGTERM stops it like Ctrl-C
    rows = []
    try:
        for i, run in enumerate(plan.runs, 1):
            echo(f"== [{i}/{len(plan.runs)}] {run.name}")
            row = run_one(plan, i, run)
            rows.append(row)
            echo("   " + summary_line(row))
            write_json(plan, rows, started)  # after every run, so a killed ablation keeps what it measured
    finally:
        if main:  # the caller's handler back (a script or test calling run_ablation keeps its own)
            signal.signal(signal.SIGTERM, previous)
    data = write_json(plan, rows, started)
    write_report(data, plan.out, echo)
    return data


def write_report(data: dict, out: Path, echo=print) -> list[Path]:
    """ablation.csv, the PNGs and report.md from ``data`` (ablation.json). Without matplotlib the report
    says so and has no plots; ``gemzoo ablate --report DIR`` draws them later, on another machine."""
    from gemzoo import plotting

    write_csv(out / "ablation.csv", data["rows"])
    try:
        plots = plotting.ablation_plots(data, out)
        data.pop("plots_skipped", None)
    except ConfigError as exc:  # matplotlib missing
        plots, data["plots_skipped"] = [], str(exc)
        echo(f"no plots: {exc}; draw them later with: gemzoo ablate --report {out}")
    (out / "report.md").write_text(render_report(data, plots))
    echo(f"wrote {out}/: ablation.json, ablation.csv, report.md" + "".join(f", {p.name}" for p in plots))
    return plots


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def summary_line(row: dict) -> str:
    if row.get("status") != "ok":
        return f"FAILED: {row.get('error', '')}"
    ev = " ".join(f"{k}={v:.4g}" for k, v in row.get("eval", {}).items())
    return (f"{row['samples_per_s']:.4g} samples/s, {_fmt_tflops(row['tflops'])} TFLOP/s, MFU {_pct(row['mfu'])}, "
            f"peak {row.get('peak_mem_gib', float('nan')):.3g} GiB, loss {row['final_loss']:.4f} {ev}").strip()


def write_json(plan: AblationPlan, rows: list[dict], started: float) -> dict:
    data = {"ablation": plan.ablation, "config": plan.config, "steps": plan.steps, "warmup": plan.warmup,
            "overrides": plan.overrides, "command": plan.command, "started": started,
            "machine": machine_info(rows), "versions": versions(), "rows": rows}
    tmp = plan.out / "ablation.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, plan.out / "ablation.json")
    return data


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
    from importlib import metadata

    out = {}
    for dist in ("gemzoo", "torch", "triton", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        from gemzoo import registry

        for info in registry.host().infos.values():
            if info.distribution not in out and info.distribution:
                out[info.distribution] = info.version
    except Exception:  # noqa: BLE001 - versions are informative; never fail the report for them
        pass
    return out


# --------------------------------------------------------------------------------------------- report
def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.3g}%"


def _fmt_tflops(x) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def table_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    rows = data["rows"]
    evals = eval_keys(rows)
    base = next((r for r in rows if r.get("status") == "ok"), None)
    header = ["plugins", "samples/s", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "final loss",
              *[k.removeprefix("eval/") for k in evals], "vs first"]
    body = []
    for r in rows:
        if r.get("status") != "ok":
            err = str(r.get("error", "failed")).replace("|", "\\|").replace("\n", " ")
            body.append([f"`{label(r)}`", f"FAILED: {err[:200]}"] + [""] * (len(header) - 2))
            continue
        body.append([f"`{label(r)}`", f"{r['samples_per_s']:,.1f}", f"{r['tokens_per_s']:,.0f}",
                     _fmt_tflops(r["tflops"]), _pct(r["mfu"]), f"{r['peak_mem_gib']:.2f}", f"{r['final_loss']:.4f}",
                     *[f"{r['eval'][k]:.4f}" if k in r.get("eval", {}) else "" for k in evals],
                     f"{r['samples_per_s'] / base['samples_per_s']:.2f}x"])
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
        f"`{_shown(data['config'])}` under {len(rows)} plugin sets, {data['steps']} steps each; throughput figures are medians "
        f"after {data['warmup']} warm-up steps. Each set trained in its own process and run folder (`runs/`).",
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


# --------------------------------------------------------------------------------------------- CLI
def add_command(sub) -> None:
    a = sub.add_parser("ablate", help="train one config under several plugin sets; table, plots and report",
                       description="Train the config of an ablation file (configs/ablations/*.toml) under each of "
                       "its plugin sets, each in its own process and run folder, then write ablation.json, "
                       "ablation.csv, PNG plots and report.md into --out.")
    a.add_argument("ablation", metavar="F.toml", nargs="?", help="ablation file: config, runs, steps, warmup, set")
    a.add_argument("--steps", type=int, help="steps per run (default: the file's steps)")
    a.add_argument("--warmup", type=int, help="steps left out of the medians (default: the file's warmup)")
    a.add_argument("--out", help="ablation folder (default runs/ablations/<file stem>)")
    a.add_argument("--runs", nargs="+", metavar="PLUGINS", help="only these plugin sets of the file")
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    a.add_argument("--overwrite", action="store_true", help="replace an earlier ablation in --out")
    a.add_argument("--timeout", type=float, help="seconds one run may take before it is killed and marked failed")
    a.add_argument("--report", metavar="DIR", help="train nothing: redraw the plots and report.md of the ablation "
                   "folder DIR from its ablation.json and run folders (e.g. after copying it off a GPU machine)")
    a.set_defaults(func=cmd_ablate)


def command_line(args) -> str:
    """The canonical ``gemzoo ablate ...`` line for ``args`` (what report.md shows)."""
    parts = ["gemzoo", "ablate", args.ablation]
    for flag in ("steps", "warmup", "out", "timeout"):
        value = getattr(args, flag)
        if value is not None:
            parts += [f"--{flag}", str(value)]
    if args.runs:
        parts += ["--runs", *args.runs]
    for s in args.set or []:
        parts += ["--set", s]
    if args.overwrite:
        parts.append("--overwrite")
    return shlex.join(parts)


def cmd_ablate(args) -> int:
    if args.report:
        path = Path(args.report) / "ablation.json"
        if not path.is_file():
            raise ConfigError(f"--report {args.report}: no ablation.json there; give a folder gemzoo ablate wrote")
        data = json.loads(path.read_text())
        write_report(data, Path(args.report), echo=lambda s: print(s, flush=True))
        print(markdown_table(data))
        return 0
    if not args.ablation:
        raise ConfigError("gemzoo ablate needs an ablation file (configs/ablations/*.toml), or --report DIR")
    plan = make_plan(args.ablation, steps=args.steps, warmup=args.warmup, out=args.out, overrides=args.set,
                     runs=args.runs, command=command_line(args), timeout_s=args.timeout)
    data = run_ablation(plan, overwrite=args.overwrite, echo=lambda s: print(s, flush=True))
    print()
    print(markdown_table(data))
    failed = [label(r) for r in data["rows"] if r.get("status") != "ok"]
    if failed:
        print(f"\n{len(failed)} of {len(data['rows'])} plugin sets failed: {', '.join(failed)} (see report.md)")
    return 1 if len(failed) == len(data["rows"]) else 0  # some sets failing is a result, not an error


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--child":
        return child_main(argv[1])
    from gemzoo.cli import main as cli_main

    return cli_main(["ablate", *argv])


if __name__ == "__main__":
    sys.exit(main())
