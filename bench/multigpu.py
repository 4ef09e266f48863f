#!/usr/bin/env python3
"""Multi-GPU runs of gem-bench: every table in one command, each run a ``torchrun`` of ``gemzoo train``.

Rows (``--rows``, in this order):
  scaling   weak scaling, ``jfa,bf16``, the per-GPU batch fixed (``data.batch_size`` = per-GPU x N), on each of
            ``--gpus``: samples/s, honest MFU, efficiency against N x the 1-GPU rate (target >= 90% a doubling)
  sharding  on the most GPUs: torchrec's 1D planner against ``sharding-2d`` (groups of 2 and 4, both strategies):
            step time, peak memory, and ``gemzoo plan``'s prediction for each layout beside it
  dense     FSDP2 (shard = N), HSDP (replicate 2) and TP = 2 on the same global batch: step time, memory, and the
            per-step losses of every layout against FSDP2's (max relative difference over the steps)
  comms     ``ncclx`` against ``torch`` (NCCL): step time with FSDP2's all-gathers beside the GEMMs
  shuffle   ``base-batch-shuffle`` against ``none``: step time (gem-lognormal histories)

Per run: the median of ``step_s``, samples/s and MFU over the steps after ``--warmup``, peak memory, losses.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
JSON after every run (``--out``), a markdown table per row at the end.

    python3 bench/multigpu.py --gpus 1,2,4,8 --out runs/multigpu     # on a machine with that many GPUs
    .venv/bin/python bench/multigpu.py --dry-run --out /tmp/mg       # CPU: gem-tiny, gloo, 1 and 2 processes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROWS = ("scaling", "sharding", "dense", "comms", "shuffle")


@dataclass
class Run:
    row: str
    name: str
    gpus: int
    plugins: str
    sets: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)


def plan_runs(rows, gpus: list[int], per_gpu_batch: int, dense_plugins: str) -> list[Run]:
    """Every run of the chosen rows (the multi-GPU ones on the most GPUs given, skipped below 2)."""
    most = max(gpus)
    runs = []
    if "scaling" in rows:
        runs += [Run("scaling", f"{n} GPU", n, dense_plugins, [f"data.batch_size={per_gpu_batch * n}"]) for n in gpus]
    if most < 2:
        return runs
    batch = [f"data.batch_size={per_gpu_batch * most}"]
    if "sharding" in rows:
        runs.append(Run("sharding", "torchrec 1D", most, dense_plugins, batch))
        for g in (2, 4):
            if g <= most and most % g == 0:
                for strategy in ("replicated", "fully_sharded"):
                    runs.append(Run("sharding", f"sharding-2d G={g} {strategy}", most, dense_plugins + ",sharding-2d",
                                    batch + [f"plugins.options.sharding-2d.group_size={g}",
                                             f"plugins.options.sharding-2d.strategy='{strategy}'"]))
    if "dense" in rows:
        layouts = {"FSDP2": f"{{shard={most}}}", "HSDP": f"{{replicate=2,shard={most // 2}}}",
                   "TP=2": f"{{tp=2,shard={most // 2}}}"}
        runs += [Run("dense", name, most, dense_plugins, batch + [f"run.mesh={mesh}"])
                 for name, mesh in layouts.items()]
    if "comms" in rows:
        runs += [Run("comms", name, most, dense_plugins + extra, batch + [f"run.mesh={{shard={most}}}"])
                 for name, extra in (("torch (NCCL)", ""), ("ncclx", ",ncclx"))]
    if "shuffle" in rows:
        runs += [Run("shuffle", name, most, dense_plugins + extra, batch)
                 for name, extra in (("none", ""), ("base-batch-shuffle", ",base-batch-shuffle"))]
    return runs


def command(run: Run, config: str, steps: int, out: Path, extra_sets: list[str]) -> list[str]:
    sets = ["eval.every=0", "checkpoint.every=0", *extra_sets, *run.sets]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.gpus}",
            "-m", "gemzoo.cli", "train", "--config", config, "--plugins", run.plugins, "--steps", str(steps),
            "--out", str(out), "--quiet"] + [a for s in sets for a in ("--set", s)]


def launch(cmd: list[str], folder: Path, env: dict, timeout_s: float, warmup: int) -> dict:
    """One torchrun of ``gemzoo train``: its summary, or the error it ended with."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        text = proc.stderr or proc.stdout
        # The workers' own messages come first; torchrun's traceback of the launcher follows them.
        return {"error": text if len(text) <= 3000 else text[:2000] + "\n...\n" + text[-1000:], "rc": proc.returncode}
    return summarise(folder / "metrics.jsonl", warmup)


def summarise(metrics: Path, warmup: int) -> dict:
    """Medians after ``warmup`` steps, the losses of every step, the largest peak memory."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "step_s" in r]
    timed = [r for r in steps if r["step"] > warmup] or steps
    med = {k: statistics.median(r[k] for r in timed) for k in ("step_s", "samples_per_s", "mfu")}
    start = next((r for r in rows if r.get("event") == "start"), {})
    return {**med, "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in steps),
            "losses": [r["loss"] for r in steps], "steps_timed": len(timed), "world_size": start.get("world_size"),
            "mesh": start.get("mesh"), "mfu_peak": steps[-1].get("mfu_peak") if steps else None}


def analyse(runs: list[Run]) -> dict:
    """Per row: scaling efficiency, loss agreement of the dense layouts, ratios against each row's first run."""
    out: dict = {}
    ok = [r for r in runs if "step_s" in r.result]
    one = next((r for r in ok if r.row == "scaling" and r.gpus == 1), None)
    for r in ok:
        if r.row == "scaling" and one is not None:
            r.result["efficiency"] = r.result["samples_per_s"] / (r.gpus * one.result["samples_per_s"])
    for row in ROWS:
        mine = [r for r in ok if r.row == row]
        if not mine:
            continue
        first = mine[0]
        for r in mine:
            r.result["step_vs_first"] = r.result["step_s"] / first.result["step_s"]
        if row == "dense":
            ref = first.result["losses"]
            for r in mine:
                diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.result["losses"], ref, strict=False)]
                r.result["max_rel_loss_diff_vs_first"] = max(diffs) if diffs else None
        out[row] = {r.name: r.result for r in mine}
    return out


def first_error_line(text: str) -> str:
    """The line of a failed run's output that names its error (the workers' own, before torchrun's traceback)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "?").replace("|", "/")


def table(runs: list[Run]) -> str:
    lines = []
    for row in ROWS:
        mine = [r for r in runs if r.row == row]
        if not mine:
            continue
        lines += ["", f"### {row}", "", "| run | GPUs | step ms | samples/s | MFU | peak GiB | vs first | extra |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in mine:
            x = r.result
            if "step_s" not in x:
                lines.append(f"| {r.name} | {r.gpus} | failed: {first_error_line(x['error'])[:120]} | | | | | |")
                continue
            extra = (f"efficiency {x['efficiency']:.1%}" if "efficiency" in x else
                     f"loss diff {x['max_rel_loss_diff_vs_first']:.1e}" if x.get("max_rel_loss_diff_vs_first")
                     is not None else "")
            lines.append(f"| {r.name} | {r.gpus} | {1e3 * x['step_s']:.1f} | {x['samples_per_s']:.1f} | "
                         f"{x['mfu']:.1%} | {x['peak_mem_gib']:.1f} | {x['step_vs_first']:.3f} | {extra} |")
    return "\n".join(lines)


def plan_prediction(run: Run, config: str, per_gpu: int) -> dict:
    """``gemzoo plan --json`` for a sharding run's layout (G = the run's group, 1D: G = the world), for the measured
    step and memory to stand beside."""
    opts = dict(s.split("=", 1) for s in run.sets if s.startswith("plugins.options.sharding-2d."))
    group = opts.get("plugins.options.sharding-2d.group_size", str(run.gpus))
    strategy = opts.get("plugins.options.sharding-2d.strategy", "'replicated'").strip("'")
    cmd = [sys.executable, "-m", "gemzoo.cli", "plan", "--config", config, "--world", str(run.gpus), "--group", group,
           "--strategy", strategy, "--batch-per-rank", str(per_gpu), "--gpus-per-node", str(run.gpus), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-600:]}
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": "not JSON: " + proc.stdout[-300:]}


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="1,2,4,8", help="GPU counts for the scaling row (those present are kept)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--config", default=str(ROOT / "configs" / "gem-bench.toml"))
    ap.add_argument("--plugins", default="jfa,bf16", help="the dense plugin set every run starts from")
    ap.add_argument("--per-gpu-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--log-every", type=int, default=5,
                    help="rows every N steps (gem-bench's run.sync = 'log' waits for the GPUs only there; 1 in a dry run)")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    ap.add_argument("--timeout-s", type=float, default=900, help="per run")
    ap.add_argument("--no-retry", dest="retry", action="store_false", help="do not relaunch a run that failed")
    ap.add_argument("--out", default=str(ROOT / "runs" / "multigpu"), help="output folder for JSON and tables")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: gem-tiny over gloo on 1 and 2 processes, 4 steps, per-GPU batch 8")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sets = list(args.set)
    if args.dry_run:
        gpus, config, steps, warmup, per_gpu = [1, 2], str(ROOT / "configs" / "gem-tiny.toml"), 4, 1, 8
        sets = ["run.log_every=1", *sets, "run.device='cpu'"]
    else:
        have = gpu_count()
        gpus = [n for n in map(int, args.gpus.split(",")) if n <= have]
        if not gpus:
            sys.exit(f"multigpu: no GPU count of --gpus {args.gpus} fits the {have} GPU(s) here")
        config, steps, warmup, per_gpu = args.config, args.steps, args.warmup, args.per_gpu_batch
        sets = [f"run.log_every={args.log_every}", *sets]  # before the user's --set, which may change it
    runs = plan_runs(args.rows.split(","), gpus, per_gpu, args.plugins)
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    record = {"command": " ".join(sys.argv), "gpus": gpus, "config": config, "steps": steps, "warmup": warmup,
              "per_gpu_batch": per_gpu, "env": NO_MULTICAST, "runs": []}
    for i, run in enumerate(runs):
        folder = out / f"{i:02d}-{run.row}"
        t0 = time.time()
        run.result = launch(command(run, config, steps, folder, sets), folder, env, args.timeout_s, warmup)
        if "error" in run.result and args.retry:
            # One more try in a fresh folder: a torchrun launch can fail for reasons of the host (a port taken
            # between its choice and its bind). The first error stays in the record beside the retry's result.
            first = run.result
            folder = out / f"{i:02d}-{run.row}-retry"
            run.result = {**launch(command(run, config, steps, folder, sets), folder, env, args.timeout_s, warmup),
                          "first_error": first["error"][-600:]}
        cmd = command(run, config, steps, folder, sets)
        run.result["wall_s"] = time.time() - t0
        if run.row == "sharding":
            run.result["plan"] = plan_prediction(run, config, per_gpu)
        print(f"[{run.row}] {run.name}: " + json.dumps({k: v for k, v in run.result.items()
                                                        if k not in ("losses", "plan")})[:400], flush=True)
        record["runs"].append({"row": run.row, "name": run.name, "gpus": run.gpus, "plugins": run.plugins,
                               "sets": run.sets, "cmd": cmd, "result": run.result})
        (out / "multigpu.json").write_text(json.dumps(record, indent=1))
    record["analysis"] = analyse(runs)
    (out / "multigpu.json").write_text(json.dumps(record, indent=1))
    text = table(runs)
    (out / "multigpu.md").write_text(text + "\n")
    print(text, flush=True)
    failed = [f"{r.row} {r.name}" for r in runs if "error" in r.result]
    if failed:
        sys.exit(f"multigpu: {len(failed)} run(s) failed: {', '.join(failed)} (errors in {out / 'multigpu.json'})")


if __name__ == "__main__":
    main()
