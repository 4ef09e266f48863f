"""Where an act-quant step's time goes: torch.profiler over compiled training steps, with and without the policy.

    python plugins/gemzoo-act-quant/bench/profile_step.py --config configs/gem-bench.toml --out results/act_quant_profile.json

Each plugin set trains ``--steps`` compiled steps (``run.compile = true``); the last ``--profile`` steps run
under torch.profiler. Per set: step wall time, GPU kernel time grouped (GEMM, attention, the fp8 casts of
saved tensors, copies and elementwise, other), the top kernels, and the host time spent in the
saved-tensor hooks (``act_quant.pack`` / ``act_quant.unpack`` record_function ranges where present), and where
the GPU waits (``gemzoo.profiling.gpu_idle`` on the profiler's chrome trace: each idle gap charged to the host's
operator, CUDA call and record_function range at that moment). ``--trace DIR`` keeps each set's trace, gzipped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import torch

GROUPS = (  # first match wins; names of CUDA kernels as the profiler reports them
    ("fp8 cast (saved tensors)", re.compile(r"mx|quant|fp8|e4m3|_cast|scale", re.I)),
    ("attention", re.compile(r"attn|attention|_fwd_kernel|_bwd_|jfa|flash", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90_xmma|nvjet|matmul|wgmma", re.I)),
    ("copy / elementwise", re.compile(r"copy|elementwise|vectorized|fill|triton_poi|triton_red|triton_per|reduce", re.I)),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def profile_set(config: str, plugins: str, steps: int, profiled: int, sets: list[str], trace_dir: str = "") -> dict:
    from gemzoo.api import Trainer, load_config

    cfg = load_config(config, plugins=plugins, overrides=[
        f"run.steps={steps}", "run.log_every=1", "eval.every=0", "checkpoint.every=0", "run.compile=true", *sets])
    torch._dynamo.config.assume_static_by_default = False
    tr = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="aq-prof-"), progress=False).assemble()
    t0 = time.perf_counter()
    for step in range(steps - profiled):
        tr.train_step(step)
    warm_s = time.perf_counter() - t0
    walls = []
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        if cfg.run.sync == "log":  # as fit() runs them: queued, waited for once (each step the stretch's mean)
            torch.cuda.synchronize()
            t = time.perf_counter()
            queued = [tr.launch_step(step) for step in range(steps - profiled, steps)]
            torch.cuda.synchronize()
            walls = [(time.perf_counter() - t) / profiled] * profiled
            tr.finish_steps(queued, walls[0])
        else:
            for step in range(steps - profiled, steps):
                t = time.perf_counter()
                tr.train_step(step)
                walls.append(time.perf_counter() - t)
    from gemzoo.testing import annotations_ms, gpu_idle, kernel_ms

    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json"), "rb") as f:
            raw = f.read()
    idle = gpu_idle(json.loads(raw), steps=profiled)
    if trace_dir:
        name = re.sub(r"[^A-Za-z0-9]+", "_", plugins).strip("_") + ".trace.json.gz"
        with gzip.open(os.path.join(trace_dir, name), "wb", compresslevel=6) as f:
            f.write(raw)
    events = prof.key_averages()
    kernels = kernel_ms(events, profiled)  # each kernel once: record_function spans are not kernels
    host = {e.key: e.cpu_time_total / profiled / 1e3 for e in events
            if e.device_type == torch.autograd.DeviceType.CPU and ("act_quant" in e.key or "saved_tensors" in e.key)}
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    row = {"plugins": plugins, "set": sets, "sync": cfg.run.sync, "step_ms": 1e3 * statistics.median(walls),
           "warm_s": warm_s,
           "gpu_ms_per_step": sum(kernels.values()), "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
           "top_kernels_ms": top, "host_ranges_ms": host,
           "annotated_ranges_gpu_ms": annotations_ms(events, profiled), "gpu_idle": idle,
           "memory": tr.memory_reports() if hasattr(tr, "memory_reports") else {}}
    del tr, prof
    torch._dynamo.reset()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/gem-bench.toml")
    p.add_argument("--sets", default="jfa,bf16;jfa,bf16,act-quant", help="plugin sets, ';'-separated")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", type=int, default=3, help="last steps profiled")
    p.add_argument("--set", action="append", default=[], help="extra config overrides")
    p.add_argument("--out", default="act_quant_profile.json")
    p.add_argument("--trace", default="", help="folder for each set's gzipped chrome trace")
    args = p.parse_args()
    rows = []
    for plugins in args.sets.split(";"):
        try:
            row = profile_set(args.config, plugins, args.steps, args.profile, args.set, args.trace)
        except Exception as exc:  # keep the other set
            row = {"plugins": plugins, "error": f"{type(exc).__name__}: {exc}"[:600]}
        rows.append(row)
        brief = {k: v for k, v in row.items() if k not in ("top_kernels_ms", "memory", "gpu_idle")}
        print(json.dumps(brief), flush=True)
        print("gpu idle:", json.dumps(row.get("gpu_idle", {})), flush=True)
        for name, ms in row.get("top_kernels_ms", [])[:12]:
            print(f"    {ms:8.2f} ms  {name[:110]}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
