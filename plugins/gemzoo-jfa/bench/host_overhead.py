#!/usr/bin/env python3
"""Host time of one attention call of this kernel family (jfa, gdpa, block-attention), kernels stubbed out:
the Python path alone (input check, schedule, split plan, autograd, launch arguments), eager autograd path
(gemzoo_jfa.family.run_attention) against calling the custom op, interleaved in one process. Runs on CPU
(no Triton kernel is launched), so it isolates what the H200 runs showed dominating short calls.

Cases (fwd+bwd; H=4, D=128 but for the cross case):
  jfa            softmax self-attention, one sequence of ``--length`` (fp32)
  gdpa           silu self-attention, the same sequence (fp32)
  gdpa-cross64   silu cross attention, 64 candidates per user over gem-lognormal histories (B=64, bf16, H=1,
                 D=16, see CROSS_H): the split-K path (short q over long k), with its fp32 accumulation buffers
  block-attention  softmax, block_size 64, the same sequence (fp32)

    python plugins/gemzoo-jfa/bench/host_overhead.py [--reps 15] [--length 512] [--cprofile 20] [--threads 1]

Each rep times 100 calls; the line gives the median and mean over reps of the ms per call (and the min).
``--cprofile N`` then prints, per case, the N functions with the most own time per call on the eager path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

KERNEL_NAMES = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "attn_bwd_preprocess")


class Stub:
    """``kernel[grid](...)`` does nothing: what is left is the host's path."""

    def __getitem__(self, grid):
        return lambda *a, **kw: None


def stub_kernels() -> None:
    import gemzoo_jfa.kernels as kernels

    for name in KERNEL_NAMES:
        setattr(kernels, name, Stub())


# The cross case's heads and head dim: small, because on CPU the split path's fp32 buffer (zeroed, then copied
# into the bf16 output, for out and for dq) is real memory work done in the call, where on a GPU it is two
# launches; at H=4, D=128 (8 MB a buffer) that work, not the Python path, would be the time measured.
CROSS_H, CROSS_D = 1, 16


def gem_lognormal(B=64, median=1024, sigma=1.0, lo=32, hi=16384, seed=1):
    """bench_jfa.gem_lognormal (that module needs CUDA at import)."""
    z = torch.randn(B, generator=torch.Generator().manual_seed(seed))
    return (median * torch.exp(sigma * z)).round().clamp(lo, hi).long()


def cases(length: int):
    """(name, call, leaves, grad, members): ``members`` are the modules whose entry calls run_attention."""
    import gemzoo_jfa.ops as ops

    from gemzoo.api import lengths_to_offsets

    off = lengths_to_offsets(torch.tensor([length]))
    q, k, v = (torch.randn(length, 4, 128, requires_grad=True) for _ in range(3))
    grad = torch.randn(length, 4, 128)
    yield "jfa", lambda: ops.jfa_triton(q, k, v, off), (q, k, v), grad, ops
    try:
        import gemzoo_gdpa.ops as gdpa_ops
    except ImportError:
        gdpa_ops = None
    if gdpa_ops is not None:
        yield ("gdpa", lambda: gdpa_ops.gdpa_triton(q, k, v, off, activation="silu"), (q, k, v), grad, gdpa_ops)
        hist = gem_lognormal()
        q_off = lengths_to_offsets(torch.full((hist.numel(),), 64))
        k_off = lengths_to_offsets(hist)
        tq, tk = int(q_off[-1]), int(k_off[-1])
        mk = lambda t: torch.empty(t, CROSS_H, CROSS_D, dtype=torch.bfloat16).normal_().requires_grad_()  # noqa: E731
        q2, k2, v2 = mk(tq), mk(tk), mk(tk)
        grad2 = torch.randn(tq, CROSS_H, CROSS_D).to(torch.bfloat16)
        norm = float(hist.max())
        cross = lambda: gdpa_ops.gdpa_triton(q2, k2, v2, q_off, k_off, causal=False, activation="silu",  # noqa: E731
                                             norm=norm)
        yield "gdpa-cross64", cross, (q2, k2, v2), grad2, gdpa_ops
    try:
        import gemzoo_block_attention.ops as block_ops
    except ImportError:
        return
    yield ("block-attention", lambda: block_ops.block_attention_triton(q, k, v, off, block_size=64), (q, k, v),
           grad, block_ops)


def step(call, leaves, grad) -> None:
    call().backward(grad)
    for t in leaves:  # the stubbed kernels leave gradients uninitialised: never accumulate them
        t.grad = None


def python_top(call, leaves, grad, iters: int, n: int) -> None:
    """cProfile over ``iters`` eager fwd+bwd calls: the ``n`` functions with the most own time, ms per call."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step(call, leaves, grad)
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(tt for (_c, _n, tt, _ct, _callers) in stats.values()) / iters * 1e3
    print(f"    cProfile: {total:.3f} ms own time per call in all; the top {n}:")
    for (f, line, func), (_cc, nc, tt, ct, _callers) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]:
        print(f"    {tt / iters * 1e3:7.4f} own {ct / iters * 1e3:7.4f} cum  x{nc // iters:<3d} "
              f"{Path(f).name}:{line}({func})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also print the N functions with the most own time per call (eager path, per case)")
    ap.add_argument("--only", default="", help="comma-separated case names (default: every case)")
    ap.add_argument("--json", default="", metavar="FILE",
                    help="also write every rep's ms per call, {case: {path: [ms, ...]}}, to FILE")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: the cross case's small buffer ops wait on no OpenMP wake-up)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import gemzoo_jfa.family as family

    stub_kernels()
    eager = family.run_attention

    def via_op(op, fwd, bwd, *a):
        return op(*a)

    only = {s for s in args.only.split(",") if s}
    report = {}
    print(f"host ms per fwd+bwd (kernels stubbed), {args.reps} reps of 100 calls: "
          "median / mean (min)")
    for name, call, leaves, grad, member in cases(args.length):
        if only and name not in only:
            continue
        times = {"custom op": [], "eager autograd": []}
        for _ in range(args.reps):
            for path, runner in (("custom op", via_op), ("eager autograd", eager)):
                member.run_attention = runner
                for _ in range(5):
                    step(call, leaves, grad)
                t0 = time.perf_counter()
                for _ in range(100):
                    step(call, leaves, grad)
                times[path].append((time.perf_counter() - t0) / 100 * 1e3)
        member.run_attention = eager
        report[name] = times
        a, b = times["custom op"], times["eager autograd"]
        print(f"  {name:16s} eager autograd {statistics.median(b):.3f} / {statistics.mean(b):.3f} ({min(b):.3f})   "
              f"custom op {statistics.median(a):.3f} / {statistics.mean(a):.3f} ({min(a):.3f})", flush=True)
        if args.cprofile:
            python_top(call, leaves, grad, 200, args.cprofile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
