#!/usr/bin/env python3
"""Where a short attention call spends its time: torch.profiler over fwd+bwd of block-attention (block 64,
one sequence of L tokens) and of gdpa's cross path (64 candidates per user over gem_lognormal histories; split-K,
unsplit, and compiled FlexAttention, the bench's baseline, on the same tensors),
GPU kernel time beside the host's wall time per call. A call whose wall time is well above its kernels'
time is host-bound (launch overhead), not kernel-bound.

    python3 plugins/gemzoo-block-attention/bench/profile_host.py --out results/
    python3 plugins/gemzoo-block-attention/bench/profile_host.py --cprofile 25 --out results/   # + Python's top 25
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
from bench_jfa import gem_lognormal  # noqa: E402

from gemzoo.api import lengths_to_offsets  # noqa: E402

H, D = 4, 128


def leaves(tq, tk, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda t: torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()  # noqa: E731
    return mk(tq), mk(tk), mk(tk), torch.randn(tq, H, D, device="cuda", dtype=torch.bfloat16, generator=g)


def cases():
    from gemzoo_block_attention import block_attention_triton

    L = 8192
    off = lengths_to_offsets(torch.tensor([L])).cuda()
    q, k, v, g = leaves(L, L)
    yield "block64_L8192", lambda: block_attention_triton(q, k, v, off, block_size=64), (q, k, v), g
    try:
        from gemzoo_gdpa import gdpa_triton
    except ImportError:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gemzoo-gdpa" / "bench"))
    from bench_gdpa import flex_cross  # the cross rows' baseline, as bench_gdpa times it
    hist = gem_lognormal()
    q_off = lengths_to_offsets(torch.full((hist.numel(),), 64)).cuda()
    k_off = lengths_to_offsets(hist).cuda()
    q2, k2, v2, g2 = leaves(int(q_off[-1]), int(k_off[-1]), 1)
    norm = float(hist.max())
    cross = lambda: gdpa_triton(q2, k2, v2, q_off, k_off, causal=False, activation="silu", norm=norm)  # noqa: E731
    yield "gdpa_cross64", cross, (q2, k2, v2), g2

    from gemzoo_jfa.family import KernelOptions

    unsplit = KernelOptions(split=0)  # forward and backward unsplit
    yield "gdpa_cross64_unsplit", lambda: gdpa_triton(q2, k2, v2, q_off, k_off, causal=False, activation="silu",
                                                      norm=norm, options=unsplit), (q2, k2, v2), g2
    yield "flex_cross64", flex_cross(q2, k2, v2, q_off, k_off), (q2, k2, v2), g2  # the bench's baseline


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also the N Python functions with the most own time per call (cProfile), per case")
    args = ap.parse_args()
    report = {}
    for name, fn, ls, grad in cases():
        report[name] = profile_case(name, fn, ls, grad, args.iters)
        if args.cprofile:
            report[name]["python_top"] = python_top(fn, ls, grad, args.iters, args.cprofile)
    if args.out:
        with open(os.path.join(args.out, "profile_host.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _fwd_bwd(fn, ls, grad) -> None:
    fn().backward(grad)
    for t in ls:
        t.grad = None


def python_top(fn, ls, grad, iters: int, n: int) -> list[dict]:
    """Where the host's time per fwd+bwd goes in Python: cProfile over ``iters`` calls, the ``n`` functions with
    the most own time (ms per call); the final synchronize is its own row, so the GPU's share stays apart."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        _fwd_bwd(fn, ls, grad)
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    top = [{"function": f"{Path(f).name}:{line}({func})", "own_ms": round(tt / iters * 1e3, 4),
            "cumulative_ms": round(ct / iters * 1e3, 4), "calls": nc // iters}
           for (f, line, func), (_cc, nc, tt, ct, _callers) in rows]
    for r in top:
        print(f"   {r['own_ms']:8.4f} ms own {r['cumulative_ms']:8.4f} cum  x{r['calls']:<4d} {r['function'][:90]}")
    return top


def profile_case(name, fn, ls, grad, iters: int) -> dict:
    """Wall time per fwd+bwd of ``fn`` against the GPU time of its kernels (torch.profiler), top kernels."""
    from torch.profiler import ProfilerActivity, profile

    step = lambda: _fwd_bwd(fn, ls, grad)  # noqa: E731
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / iters * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    from gemzoo.testing import kernel_ms

    events = prof.key_averages()
    per_call = kernel_ms(events, iters)
    gpu_ms = sum(per_call.values())
    launches = {e.key: e.count // iters for e in events if e.key in per_call}
    kernels = sorted(((n, ms, launches[n]) for n, ms in per_call.items()), key=lambda r: -r[1])
    print(f"== {name}: wall {wall_ms:.3f} ms per fwd+bwd, GPU busy {gpu_ms:.3f} ms "
          f"({'host-bound' if wall_ms > 1.5 * gpu_ms else 'GPU-bound'})")
    for n, ms, c in kernels[:15]:
        print(f"   {ms:8.4f} ms  x{c:<3d} {n[:100]}")
    return {"wall_ms_per_fwd_bwd": wall_ms, "gpu_ms_per_fwd_bwd": gpu_ms,
            "kernels": [{"name": n[:90], "ms": round(ms, 4), "launches": c} for n, ms, c in kernels[:15]]}


if __name__ == "__main__":
    sys.exit(main())
