"""FP8 at LLM scale: configs/gem-1b.toml trained under each precision, compiled, in one run on any CUDA machine.

    python3 bench/fp8_gem1b.py --out DIR [--config configs/gem-1b.toml] [--steps 300] [--warmup 20]
                               [--budget-s S] [--rows bf16,fp8-rowwise,fp8-tensorwise,mxfp8] [--profile 3]
                               [--set KEY=VALUE ...] [--smoke]

Each row is the config with ``--plugins jfa,<precision>`` (its memory plugins kept: gem-1b's auto-ac), compiled
(``run.compile = true``), trained in this process for warmup + steps steps. Recorded per row:
- mean wall-clock samples/s and mean MFU over the steps after the warm-up (the trainer's own ``Throughput``:
  every step timed from the end of the one before, so loading, stalls and recompiles count), the slowest step
  and the peak memory (``torch.cuda.max_memory_allocated``);
- the final loss, every loss finite (no NaN), and the final loss against bf16's: every row trains the same
  batches from the same seed, so the last step's loss is comparable; within 1% passes;
- samples/s against the bf16 row of the same run;
- a torch.profiler profile of ``--profile`` further steps, its kernel time per step split into GEMMs (cuBLAS /
  cuBLASLt, fp8 ``_scaled_mm`` included, and the MX GEMM kernels), casts and amax (kernels whose names carry
  amax, clamp, reciprocal, fp8/e4m3/e5m2, quantize or the MX casts: what the fp8 policies add, plus any other
  dtype casts Inductor fused there), attention, and the rest. A fused kernel counts where its name puts it.
  The profiled steps are queued and waited for once, as training runs them; on CUDA the profile also gives the
  GPU's idle time per step and what the host was doing in those gaps (``gemzoo.profiling.gpu_idle``). The
  profiled steps' tokens and model TFLOP/s are recorded too: they are other batches than the measured steps
  (gem-lognormal's token count varies from batch to batch), so their TFLOP/s, not their step time, compares
  with the row's mean.

Writes DIR/fp8_gem1b.json after every row and DIR/fp8_gem1b.md (the table) at the end; exits 1 when a row
failed or a loss was not finite. Rows start only while --budget-s seconds are left, so a time-limited job ends
in time; rows not started are listed as such.

``--smoke`` runs a tiny GEM (3 blocks of width 32, 8 users a batch) eagerly on the CPU in seconds, without the
memory plugins (auto-ac needs torch.compile): the same code path, for tests and a first look; its profile
splits CPU operator time (aten::mm, aten::_scaled_mm, aten::amax, aten::_to_copy, ...) the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROWS = ("bf16", "fp8-rowwise", "fp8-tensorwise", "mxfp8")
SMOKE = [  # a tiny gem on the CPU; every width a multiple of 32 (MX blocks) except the 16-wide embeddings
    "run.device='cpu'", "run.compile=false", "model.d_model=32", "model.num_layers=3", "model.num_heads=2",
    "model.head_dim=16", "model.embedding_dim=16", "model.mlp_dims=[32]", "data.batch_size=8", "data.max_len=64",
    "data.median_len=16", "data.min_len=2", "data.min_candidates=2", "data.max_candidates=4", "data.num_items=200",
    "data.num_clusters=4", "data.num_sparse_tables=2", "data.sparse_table_size=100", "optim.warmup_steps=0",
]
GROUPS = (  # first match wins: CUDA kernel names as the profiler reports them, or CPU operator names (--smoke)
    ("attention", re.compile(r"attn|attention|_fwd_kernel|_bwd_|jfa|flash|jagged", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|wgmma|matmul|^aten::(mm|addmm|bmm|_scaled_mm|linear)$", re.I)),
    ("cast / amax", re.compile(r"amax|clamp|reciprocal|float8|fp8|e4m3|e5m2|quant|mx_cast|_cast|"
                               r"^aten::(_to_copy|abs|max|exp2|log2)$", re.I)),
)
GIB = 2**30


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def _compiler_configs():
    return {m: m.get_config_copy() for m in (torch._dynamo.config, torch._functorch.config)}


def _restore(saved) -> None:  # auto-ac sets torch's process-wide compiler settings: each row starts from the same
    with warnings.catch_warnings():  # reading a deprecated setting warns
        warnings.simplefilter("ignore", FutureWarning)
        for module, values in saved.items():
            for k, v in values.items():
                if getattr(module, k) is not v:
                    setattr(module, k, v)


def profile_steps(tr, first: int, count: int) -> dict:
    """Kernel (CUDA) or operator (CPU) time per step over ``count`` more steps after ``first``, grouped, and on
    CUDA where the GPU waits (``gemzoo.profiling.gpu_idle``: each idle gap charged to what the host was doing).

    The steps are queued and waited for once, as ``fit`` runs them with ``run.sync = "log"``, so the idle time is
    training's own, not a sync per step. The run's last step prefetched nothing, so the steps go on as in
    ``fit``: the run's length is raised to cover them, and one step before the profiled ones loads its batch and
    starts the host thread that builds the next."""
    from gemzoo.testing import gpu_idle, kernel_ms

    cuda = tr.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    tr.cfg.run.steps = first + 1 + count + 1  # launch_step prefetches step + 1 while it is below run.steps
    tr.train_step(first)
    try:
        with torch.profiler.profile(activities=acts) as prof:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            queued = [tr.launch_step(step) for step in range(first + 1, first + 1 + count)]
            if cuda:
                torch.cuda.synchronize()
            wall_s = (time.perf_counter() - t0) / count
            metrics = tr.finish_steps(queued, wall_s)
    finally:
        tr.lookahead.close()
    events = prof.key_averages()
    if cuda:
        times = kernel_ms(events, count)  # each kernel once: record_function spans are not kernels
    else:
        times = {e.key: e.self_cpu_time_total / count / 1e3 for e in events  # operators (aten, custom ops)
                 if e.device_type == torch.autograd.DeviceType.CPU and "::" in e.key
                 and not e.key.startswith(("autograd::", "Optimizer."))}
    groups = {g: 0.0 for g in ("gemm", "cast / amax", "attention", "other")}
    for name, ms in times.items():
        groups[group_of(name)] += ms
    top = sorted(times.items(), key=lambda kv: -kv[1])[:20]
    idle = {}
    if cuda:  # the chrome trace holds each kernel's and each host call's span
        with tempfile.TemporaryDirectory(prefix="fp8-gem1b-trace-") as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            idle = gpu_idle(json.loads(path.read_text()), steps=count, top=8)
    return {"what": "CUDA kernel ms per step" if cuda else "CPU operator self ms per step", "steps": count,
            "step_ms": 1e3 * wall_s, "tokens": sum(s.sums["tokens"] for s in queued) / count,
            "tflops": sum(m["tflops"] for m in metrics) / count,
            "groups_ms": groups, "total_ms": sum(times.values()), "idle": idle,
            "top": [[name[:160], round(ms, 4)] for name, ms in top]}


def run_row(config: str, precision: str, overrides: list[str], steps: int, warmup: int, profiled: int,
            smoke: bool) -> dict:
    from gemzoo.api import Trainer, load_config

    plugins = f"jfa,{precision}" + (",no:auto-ac" if smoke else "")
    compile_on = [] if smoke else ["run.compile=true"]
    cfg = load_config(config, plugins=plugins, overrides=[
        f"run.steps={warmup + steps}", f"run.warmup={warmup}", "eval.every=0", "checkpoint.every=0",
        *compile_on, *overrides])
    cuda = torch.cuda.is_available() and not smoke
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fp8-gem1b-") as tmp:
        tr = Trainer(cfg, out_dir=tmp, progress=False).assemble()
        result = tr.fit()
        fit_s = time.perf_counter() - t0
        profile = profile_steps(tr, warmup + steps, profiled) if profiled > 0 else {}
        memory = tr.memory_reports()
        del tr
    losses = [r["loss"] for r in result.history]
    tp = result.throughput
    tail = losses[-max(1, len(losses) // 10):]
    return {"precision": precision, "plugins": plugins, "status": "ok", "steps": steps, "warmup": warmup,
            "fit_s": fit_s, "wall_s": time.perf_counter() - t0,
            "mean_samples_per_s": tp.get("mean_samples_per_s", math.nan), "mean_mfu": tp.get("mean_mfu", math.nan),
            "mean_tflops": tp.get("mean_tflops", math.nan), "median_step_s": tp.get("median_step_s", math.nan),
            "max_step_s": tp.get("max_step_s", math.nan), "compiles_after_warmup": tp.get("compiles_after_warmup"),
            "peak_mem_gib": max((r.get("peak_mem_gib", 0.0) for r in result.history), default=math.nan),
            "final_loss": result.final_loss, "loss_tail_mean": statistics.fmean(tail) if tail else math.nan,
            "finite": bool(losses) and all(math.isfinite(v) for v in losses), "losses": losses,
            "profile": profile, "memory": memory}


def compare(rows: list[dict]) -> None:
    """Each ok row against the bf16 row of this run: samples/s ratio, final loss relative difference."""
    base = next((r for r in rows if r["precision"] == "bf16" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok" or base is None:
            continue
        r["vs_bf16"] = r["mean_samples_per_s"] / base["mean_samples_per_s"]
        r["loss_vs_bf16"] = (r["final_loss"] - base["final_loss"]) / abs(base["final_loss"])
        r["loss_within_1pct"] = r["finite"] and abs(r["loss_vs_bf16"]) <= 0.01


def markdown(data: dict) -> str:
    head = (f"`{data['config']}` on {data['device']}, torch {data['torch']}, {'eager (--smoke)' if data['smoke'] else 'compiled'}, "
            f"{data['steps']} steps after {data['warmup']} warm-up; profile: {data['profile_what']}.\n\n"
            f"Command: `{data['command']}`\n\n")
    cols = ("| precision | samples/s | vs bf16 | MFU | max step s | peak GiB | final loss | vs bf16 loss | "
            "GEMM ms | cast/amax ms | attention ms | other ms | GPU idle ms | profiled TFLOP/s |")
    lines = [cols, "|---|" + "---:|" * 13]
    for r in data["rows"]:
        if r["status"] != "ok":
            lines.append(f"| `{r['precision']}` | {r['status']}: {str(r.get('error', ''))[:140]} |" + " |" * 12)
            continue
        g = (r.get("profile") or {}).get("groups_ms", {})
        idle = (r.get("profile") or {}).get("idle") or {}
        vs = f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "n/a"
        dl = (f"{100 * r['loss_vs_bf16']:+.2f}%" + ("" if r["loss_within_1pct"] else " (over 1%)")
              if "loss_vs_bf16" in r else "n/a")
        loss = f"{r['final_loss']:.4f}" + ("" if r["finite"] else " (NaN/inf seen)")
        lines.append(f"| `{r['precision']}` | {r['mean_samples_per_s']:.1f} | {vs} | {100 * r['mean_mfu']:.1f}% | "
                     f"{r['max_step_s']:.3f} | {r['peak_mem_gib']:.1f} | {loss} | {dl} | "
                     + " | ".join(f"{g.get(k, math.nan):.2f}" for k in ("gemm", "cast / amax", "attention", "other"))
                     + (f" | {idle['idle_ms']:.1f}" if "idle_ms" in idle else " | n/a")
                     + (f" | {r['profile']['tflops']:.1f} |" if r.get("profile") else " | n/a |"))
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for fp8_gem1b.json and fp8_gem1b.md (made if missing)")
    p.add_argument("--config", default="configs/gem-1b.toml")
    p.add_argument("--steps", type=int, help="measured steps per row (default 300; --smoke 6)")
    p.add_argument("--warmup", type=int, help="steps before the measured ones: compiles (default 20; --smoke 2)")
    p.add_argument("--budget-s", type=float, default=math.inf, help="start no row after this many seconds")
    p.add_argument("--rows", default=",".join(ROWS), help=f"precisions, comma-separated (default {','.join(ROWS)})")
    p.add_argument("--profile", type=int, default=3, help="profiled steps per row after the measured ones (0: none)")
    p.add_argument("--set", action="append", default=[], help="extra config override for every row")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, eager, in seconds")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (6 if args.smoke else 300)
    warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 20)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if steps < 1 or warmup < 0 or args.profile < 0:
        p.error(f"--steps must be >= 1 and --warmup, --profile >= 0; got {steps}, {warmup}, {args.profile}")
    from gemzoo.api import registry

    unknown = [r for r in rows if r not in registry.names("precision")]
    if unknown or not rows:
        p.error(f"--rows: {', '.join(unknown) or '(none)'} not registered precisions; registered: "
                f"{', '.join(registry.names('precision'))}")
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device: this benchmark trains gem-1b on a GPU; --smoke runs a tiny model on the CPU")
    overrides = [*(SMOKE if args.smoke else []), *args.set]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else torch.cuda.get_device_name()
    data = {"config": args.config, "device": device, "torch": torch.__version__, "smoke": args.smoke,
            "steps": steps, "warmup": warmup, "set": overrides,
            "profile_what": "CPU operator self ms per step" if args.smoke else "CUDA kernel ms per step",
            "command": shlex.join(["python3", "bench/fp8_gem1b.py", *(sys.argv[1:] if argv is None else argv)]),
            "rows": []}
    saved = _compiler_configs()
    t_start = time.perf_counter()
    for precision in rows:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            data["rows"].append({"precision": precision, "status": "not run",
                                 "error": f"{elapsed:.0f} s spent of --budget-s {args.budget_s:g}"})
            continue
        print(f"== {precision} ({elapsed:.0f} s)", flush=True)
        try:
            row = run_row(args.config, precision, overrides, steps, warmup, args.profile, args.smoke)
        except Exception as exc:  # out of memory, a non-finite loss: keep measuring the other rows
            row = {"precision": precision, "status": "failed", "error": f"{type(exc).__name__}: {exc}"[:600]}
        data["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "profile", "memory")}), flush=True)
        _restore(saved)
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        compare(data["rows"])
        (out / "fp8_gem1b.json").write_text(json.dumps(data, indent=1))
    table = markdown(data)
    (out / "fp8_gem1b.md").write_text(table)
    print("\n" + table, flush=True)
    bad = [r["precision"] for r in data["rows"] if r["status"] == "failed" or not r.get("finite", True)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
