#!/usr/bin/env python3
"""Benchmark HSTU's relative attention bias fused into gdpa's kernels against its baselines (needs CUDA).

Rows per workload, fwd and fwd+bwd (the bias tables' gradients included):
  * gdpa            : gdpa silu, no bias (the floor);
  * gdpa+pos        : gdpa with the positions table only, computed in the tiles;
  * gdpa+pos+time   : gdpa with positions and time buckets (HSTU's bias), computed in the tiles;
  * sdpa-padded+bias: the ``sdpa-padded`` kernel with the bias given as a padded [B, 1, L, L] tensor that
                      ``materialize_relative_bias`` builds inside the timed region (what a model without a
                      fused kernel does every step); skipped where that tensor would not fit.
Workloads: hstu_ml1m (B=128, lengths up to 200 with MovieLens-1M's spread, H=1, D=50, silu, norm 211,
positions 211, 128 time buckets) and gem_lognormal (B=64, median 1,024, H=2, D=64, norm = longest).
Median of triton.testing.do_bench(warmup=25, rep=100). Correctness first: gdpa+pos+time against the
reference on a slice of every workload it is timed on.

    PYTHONPATH=.:plugins/gemzoo-jfa:plugins/gemzoo-gdpa python3 plugins/gemzoo-gdpa/bench/bench_relative_bias.py \\
        OUT_DIR [--dtype bf16|fp32] [--only hstu_ml1m]

Prints a table and writes OUT_DIR/bench_relative_bias.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gemzoo-jfa" / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_jfa import gem_lognormal, rel  # noqa: E402
from gemzoo_gdpa import gdpa_triton  # noqa: E402
from rb_cases import timestamps  # noqa: E402

from gemzoo.api import (  # noqa: E402
    RelativeAttentionBias,
    lengths_to_offsets,
    materialize_relative_bias,
    reference_attention,
    registry,
)

PADDED_BUDGET = 16e9  # bytes of padded [B, 1, L, L] bias (and its SDPA score tensors) the baseline may take


def hstu_ml1m_lengths(batch=128, seed=3):
    """MovieLens-1M's spread of history lengths (users with at least 20 ratings, median about 96), cut at 200."""
    z = torch.randn(batch, generator=torch.Generator().manual_seed(seed))
    return (96 * torch.exp(1.0 * z)).round().clamp(20, 200).long()


WORKLOADS = {
    # name: (lengths, heads, head dim, norm, positions, time buckets)
    "hstu_ml1m": (hstu_ml1m_lengths, 1, 50, 211.0, 211, 128),
    "gem_lognormal": (gem_lognormal, 2, 64, None, None, 128),
}


def make(name, dtype):
    lens_fn, heads, d, norm, n_pos, n_buckets = WORKLOADS[name]
    lens = lens_fn()
    gen = torch.Generator().manual_seed(0)
    lmax = int(lens.max())
    norm = float(lmax) if norm is None else norm
    n_pos = lmax + 1 if n_pos is None else n_pos
    tq = int(lens.sum())
    off = lengths_to_offsets(lens).cuda()
    q, k, v, grad = (torch.randn(tq, heads, d, generator=gen).to("cuda", dtype) * 0.5 for _ in range(4))
    times = timestamps(gen, tq).cuda()
    next_times = torch.cat([times[1:], times[-1:] + 60])  # HSTU: each query at the time of the next item
    pos = (torch.randn(n_pos, generator=gen) * 0.1).cuda().requires_grad_()
    tw = (torch.randn(n_buckets + 1, generator=gen) * 0.1).cuda().requires_grad_()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    return dict(lens=lens, off=off, leaves=leaves, grad=grad, pos=pos, tw=tw, q_times=next_times, k_times=times,
                norm=norm, heads=heads, d=d, lmax=lmax)


def rows_for(w):
    off, (q, k, v), norm = w["off"], w["leaves"], w["norm"]
    pos, tw = w["pos"], w["tw"]
    full = RelativeAttentionBias(pos, tw, w["q_times"], w["k_times"])
    sdpa = registry.get("attention", "sdpa-padded")
    rows = {
        "gdpa": (lambda: gdpa_triton(q, k, v, off, activation="silu", norm=norm), [q, k, v]),
        "gdpa+pos": (lambda: gdpa_triton(q, k, v, off, activation="silu", norm=norm,
                                         relative_bias=RelativeAttentionBias(pos)), [q, k, v, pos]),
        "gdpa+pos+time": (lambda: gdpa_triton(q, k, v, off, activation="silu", norm=norm, relative_bias=full),
                          [q, k, v, pos, tw]),
    }
    padded = w["lens"].numel() * w["lmax"] ** 2 * 4 * (2 + 3 * w["heads"])
    if padded <= PADDED_BUDGET:
        def baseline():
            bias = materialize_relative_bias(full, off, off, w["lmax"], w["lmax"])
            return sdpa(q, k, v, off, activation="silu", norm=norm, bias=bias)

        rows["sdpa-padded+bias"] = (baseline, [q, k, v, pos, tw])
    return rows


def check(w):
    """gdpa+pos+time against the reference on the first 8 sequences: out and every gradient."""
    n = 8
    end = int(w["off"][n])
    off = w["off"][: n + 1]
    leaves = [t.detach()[:end].clone().requires_grad_() for t in w["leaves"]]
    tables = [w["pos"].detach().clone().requires_grad_(), w["tw"].detach().clone().requires_grad_()]
    grad = w["grad"][:end]
    res = {}
    for tag, fn in (("gdpa", gdpa_triton), ("reference", reference_attention)):
        rb = RelativeAttentionBias(*tables, w["q_times"][:end], w["k_times"][:end])
        out = fn(*leaves, off, activation="silu", norm=w["norm"], relative_bias=rb)
        out.backward(grad)
        res[tag] = [out.detach()] + [t.grad.clone() for t in leaves + tables]
        for t in leaves + tables:
            t.grad = None
    return {name: rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv", "dpos", "dtw"), res["gdpa"],
                                                   res["reference"], strict=True)}


def bench(fn, leaves, grad):
    from triton.testing import do_bench

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(grad)

    t_f = do_bench(fwd, warmup=25, rep=100, return_mode="median")
    t_fb = do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    for t in leaves:
        t.grad = None
    return t_f, t_fb


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="folder for bench_relative_bias.json")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--only", choices=tuple(WORKLOADS), default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_relative_bias.py needs a CUDA device")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    results = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "workloads": {}}
    print(f"{'workload':<15} {'row':<18} {'fwd ms':>9} {'fwd+bwd ms':>11}", flush=True)
    for name in WORKLOADS if args.only is None else (args.only,):
        w = make(name, dtype)
        entry = {"B": w["lens"].numel(), "tokens": int(w["lens"].sum()), "max_len": w["lmax"], "H": w["heads"],
                 "D": w["d"], "norm": w["norm"], "check": check(w), "rows": {}}
        for row, (fn, leaves) in rows_for(w).items():
            t_f, t_fb = bench(fn, leaves, w["grad"])
            entry["rows"][row] = {"fwd_ms": t_f, "fwd_bwd_ms": t_fb}
            print(f"{name:<15} {row:<18} {t_f:>9.3f} {t_fb:>11.3f}", flush=True)
        print(f"{name:<15} check (relative error against the reference): "
              + ", ".join(f"{k} {v:.1e}" for k, v in entry["check"].items()), flush=True)
        results["workloads"][name] = entry
        del w
        torch.cuda.empty_cache()
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "bench_relative_bias.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
