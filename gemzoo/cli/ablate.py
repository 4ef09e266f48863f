"""``gemzoo ablate F.toml``: train one config under several plugin sets and compare them.

    gemzoo ablate configs/ablations/gem-tiny.toml --steps 30 --out runs/ablations/gem-tiny

Every plugin set of the ablation file trains in its own process (``gemzoo.cli.ablate_run``), into its own run
folder ``DIR/runs/NN-<plugins>/`` (what ``gemzoo train`` writes there: ``metrics.jsonl``), with the process's
output and its summary beside it (``NN-<plugins>.log``, ``NN-<plugins>.json``), so each run's peak memory is
its own (CUDA ``max_memory_allocated``; on CPU the peak RSS of that run's process, its VmHWM) and
a crash or an out-of-memory in one set leaves the others running. The ablation folder ``DIR`` then gets
(``gemzoo.cli.ablate_report``):

    ablation.json  ablation.csv       one row per plugin set (medians after the warm-up steps)
    throughput.png memory.png loss.png eval.png
    report.md                         the table and the plots, the machine, versions and the exact command

A failing set keeps its row, with the error and the tail of its log.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemzoo.cli.ablate_report import OUTPUTS, label, machine_info, markdown_table, summary_line, versions, write_report
from gemzoo.config import AblationRun, load_ablation, load_config
from gemzoo.errors import ConfigError, GemzooError
from gemzoo.train.trainer import build_on_meta


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


def make_plan(path: str, *, steps: int | None = None, warmup: int | None = None, out: str | None = None,
              overrides: list[str] | None = None, runs: list[str] | None = None, command: str = "",
              timeout_s: float | None = None) -> AblationPlan:
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
    overrides = [*ab.set, *(overrides or [])]
    check_runs(ab.config, chosen, overrides, where=str(path), indices=[ab.runs.index(r) for r in chosen])
    return AblationPlan(str(path), str(Path(ab.config).resolve()), chosen, steps, warmup, overrides, out_dir,
                        command, timeout_s)


def check_runs(config: str, runs: list, overrides: list[str], *, where: str, indices: list[int] | None = None) -> None:
    """Check every run entry as ``gemzoo config validate`` does (its plugin names and ``set`` overrides, the
    dataset, the model on meta, each site's kernel, the precision policy) before the first one trains; the
    error names the entry that fails (``runs[i]`` and its name)."""
    for i, run in zip(indices or range(len(runs)), runs, strict=True):
        try:
            build_on_meta(load_config(config, overrides=[*overrides, *run.set], plugins=run.plugins))
        except GemzooError as exc:
            raise ConfigError(f"{where}: runs[{i}] ({run.name!r}) would fail, so nothing was trained: {exc}") from None


def plan_from_config(config: str, runs: list[str], *, steps: int = 50, warmup: int = 5, out: str | None = None,
                     overrides: list[str] | None = None, command: str = "", timeout_s: float | None = None
                     ) -> AblationPlan:
    """A plan without an ablation file: ``config`` under each plugin set of ``runs`` (bench/e2e.py's form)."""
    if not runs:
        raise ConfigError("no plugin sets given; list some, e.g. jfa,bf16 cpu,fp32")
    entries = [AblationRun(r) for r in runs]
    check_runs(config, entries, list(overrides or []), where=str(config))
    out_dir = Path(out) if out else Path("runs") / "ablations" / Path(config).stem
    return AblationPlan(str(config), str(Path(config).resolve()), entries, steps, warmup, list(overrides or []),
                        out_dir, command, timeout_s)


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
def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the gemzoo package
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
        proc = subprocess.Popen([sys.executable, "-m", "gemzoo.cli.ablate_run", str(spec_path)],
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


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def write_json(plan: AblationPlan, rows: list[dict], started: float) -> dict:
    data = {"ablation": plan.ablation, "config": plan.config, "steps": plan.steps, "warmup": plan.warmup,
            "overrides": plan.overrides, "command": plan.command, "started": started,
            "machine": machine_info(rows), "versions": versions(), "rows": rows}
    tmp = plan.out / "ablation.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, plan.out / "ablation.json")
    return data


# --------------------------------------------------------------------------------------------- CLI
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


