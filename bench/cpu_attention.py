"""Benchmark: the ``cpu`` attention kernel (gemzoo._C) against ``reference`` and ``sdpa-padded`` on CPU.

Workload "brief" (small gem-like shapes): B=32 sequences, gem-lognormal lengths (median 64, sigma 1,
clamped to [32, 256]), H=2, D=64, fp32, causal softmax and HSTU-style silu. Workload "gem-tiny": the shapes of
configs/gem-tiny.toml (B=64, median 16 in [2, 64], H=2, D=32), causal softmax. Forward and forward+backward: median wall time of --reps runs,
the kernels taking turns in each run (triton's do_bench needs a GPU). Prints a table, and writes JSON
when --json names a file.

    .venv/bin/python bench/cpu_attention.py [--reps 20] [--threads N] [--json path]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import gemzoo
from gemzoo import ops
from gemzoo.jagged import lengths_to_offsets


def gem_lognormal(B=64, median=1024, sigma=1.0, lo=32, hi=16384, seed=1):
    z = torch.randn(B, generator=torch.Generator().manual_seed(seed))
    return (median * torch.exp(sigma * z)).round().clamp(lo, hi).long()


# (name, lengths, H, D, activations). "brief": small gem-like shapes; "gem-tiny": configs/gem-tiny.toml
# (d_model 64 over 2 heads, batch 64, median length 16 in [2, 64]).
WORKLOADS = (
    ("brief", gem_lognormal(B=32, median=64, hi=256), 2, 64, ("softmax", "silu")),
    ("gem-tiny", gem_lognormal(B=64, median=16, lo=2, hi=64, seed=3), 2, 32, ("softmax",)),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    kernels = ("reference", "sdpa-padded", "cpu")
    rows = []
    for workload, lengths, H, D, activations in WORKLOADS:
        torch.manual_seed(0)
        offsets = lengths_to_offsets(lengths)
        T = int(lengths.sum())
        q, k, v = (torch.randn(T, H, D) for _ in range(3))
        grad = torch.randn(T, H, D)
        sum_l2 = int((lengths.double() ** 2).sum())
        flops_fwd, flops_fb = 2 * H * D * sum_l2, 7 * H * D * sum_l2  # causal, real tokens only
        for activation in activations:
            norm = None if activation == "softmax" else float(lengths.max())
            kw = dict(causal=True, activation=activation, norm=norm)
            ref_out = gemzoo.registry.get("attention", "reference")(q, k, v, offsets, **kw)
            fns, errs = {}, {}
            for name in kernels:
                kernel = gemzoo.registry.get("attention", name)
                out = kernel(q, k, v, offsets, **kw)
                errs[name] = float((out - ref_out).norm() / ref_out.norm())
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

                def fwd(kernel=kernel, inputs=(q, k, v, offsets), kw=kw):
                    with torch.no_grad():
                        kernel(*inputs, **kw)

                def fwd_bwd(kernel=kernel, leaves=leaves, offsets=offsets, kw=kw, grad=grad):
                    for t in leaves:
                        t.grad = None
                    kernel(*leaves, offsets, **kw).backward(grad)

                fns[name] = (fwd, fwd_bwd)
            # kernels take turns inside every repetition, so load from other processes hits them alike
            times = {name: ([], []) for name in kernels}
            for rep in range(args.reps + 3):
                for name in kernels:
                    for mode in (0, 1):
                        t0 = time.perf_counter()
                        fns[name][mode]()
                        if rep >= 3:
                            times[name][mode].append((time.perf_counter() - t0) * 1e3)
            for name in kernels:
                t_f, t_fb = (statistics.median(times[name][m]) for m in (0, 1))
                rows.append(dict(workload=workload, activation=activation, kernel=name, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                                 fwd_min_ms=min(times[name][0]), fwd_bwd_min_ms=min(times[name][1]),
                                 rel_err=errs[name], fwd_gflops=flops_fwd / t_f / 1e6,
                                 fwd_bwd_gflops=flops_fb / t_fb / 1e6))
            mine = [r for r in rows if r["workload"] == workload and r["activation"] == activation]
            base = next(r for r in mine if r["kernel"] == "reference")
            for r in mine:
                r["fwd_speedup_vs_reference"] = base["fwd_ms"] / r["fwd_ms"]
                r["fwd_bwd_speedup_vs_reference"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]

    info = dict(dtype="float32", causal=True, threads=torch.get_num_threads(), torch=torch.__version__,
                extension=ops.extension_info()["loaded"], reps=args.reps,
                workloads={w: dict(B=len(L), T=int(L.sum()), max_len=int(L.max()), H=H, D=D)
                           for w, L, H, D, _ in WORKLOADS})
    print(f"# {info}")
    print(f"{'workload':10} {'act':8} {'kernel':12} {'fwd ms':>8} {'x ref':>6} {'fwd+bwd ms':>11} {'x ref':>6} {'GF/s f+b':>8} {'rel err':>8}")
    for r in rows:
        print(f"{r['workload']:10} {r['activation']:8} {r['kernel']:12} {r['fwd_ms']:8.2f} {r['fwd_speedup_vs_reference']:6.1f} "
              f"{r['fwd_bwd_ms']:11.2f} {r['fwd_bwd_speedup_vs_reference']:6.1f} {r['fwd_bwd_gflops']:8.1f} "
              f"{r['rel_err']:8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
