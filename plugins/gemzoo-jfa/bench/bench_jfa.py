#!/usr/bin/env python3
"""Benchmark jfa against FlexAttention (document+causal mask, compiled), FlashAttention varlen
(torch.nn.attention.varlen.varlen_attn, causal), NJT+SDPA and padded SDPA.

Workloads of docs/benchmarks.md (H=4, D=128, bf16): gem_lognormal, uniform_8k and short (B=4096, lognormal median
48, sigma 0.7, clipped 1..1024: many short histories, where jfa's length buckets apply); forward and forward+backward;
median of triton.testing.do_bench(warmup=25, rep=100); TFLOP/s from useful FLOPs (fwd 2*H*D*sum L^2,
fwd+bwd 7*H*D*sum L^2); peak memory above the inputs. Correctness first: jfa against an fp64 reference
on mixed small shapes (outputs poisoned with NaN), and against Flex on the full workloads.

``--gqa HQ,HKV`` (default 32,8) runs grouped-query attention: q with HQ heads, k and v with HKV (the FLOPs count
q's heads); Flex runs with enable_gqa, padded SDPA and NJT+SDPA with enable_gqa, FlashAttention varlen with its
native grouped heads; the correctness cases use the same ratio (2 k/v heads). Results go to bench_jfa_gqa.json.
``--heads`` and ``--head-dim`` change H and D (a head_dim other than 128 adds ``_dD`` to the file names).
With ``--head-dim 256``, ``--sweep configs`` times D256_CANDIDATES (``sweep_d256``) instead of the D=128 tiles.

    PYTHONPATH=.:plugins/gemzoo-jfa python3 plugins/gemzoo-jfa/bench/bench_jfa.py [--sweep] [--gqa [HQ,HKV]] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from gemzoo_jfa import family
from gemzoo_jfa.family import (
    Bucket,
    Configs,
    KernelConfig,
    KernelOptions,
    default_configs,
    launch_bwd,
    launch_fwd,
    length_buckets,
    short_buckets,
)
from gemzoo_jfa.ops import jfa_triton
from gemzoo_jfa.schedule import build_schedule

from gemzoo.api import lengths_to_offsets, reference_attention

H, D, DTYPE = 4, 128, torch.bfloat16
HKV = H  # k/v heads: H (multi-head) unless --gqa
RESULTS: dict = {"device": None, "checks": [], "workloads": {}, "sweep": {}}
# The options every jfa call of this run starts from: pointer loads everywhere once the TMA check fails.
BASE = KernelOptions()


def opts(**changes) -> KernelOptions:
    """BASE with the given fields changed (a None value keeps BASE's)."""
    return dataclasses.replace(BASE, **{k: v for k, v in changes.items() if v is not None})


def gem_lognormal(B=64, median=1024, sigma=1.0, lo=32, hi=16384, seed=1):
    z = torch.randn(B, generator=torch.Generator().manual_seed(seed))
    return (median * torch.exp(sigma * z)).round().clamp(lo, hi).long()


def uniform_8k(B=64, seed=2):
    return torch.randint(1, 8192, (B,), generator=torch.Generator().manual_seed(seed))


def short_lengths(B=4096, seed=3):
    return gem_lognormal(B, median=48, sigma=0.7, lo=1, hi=1024, seed=seed)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def log(msg):
    print(msg, flush=True)


def save(out_dir):
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        name = ("bench_jfa" if HKV == H else "bench_jfa_gqa") + ("" if D == 128 else f"_d{D}")
        with open(os.path.join(out_dir, name + ".json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


# -- correctness -----------------------------------------------------------------------------------

def check_case(i, d, causal, asym, window, options=None):
    """One mixed-length case with empty sequences, fp64 reference, every output element poisoned first."""
    gen = torch.Generator().manual_seed(100 + i)
    q_lens = torch.randint(1, 700, (11,), generator=gen)
    q_lens[[1, 6]] = 0
    k_lens = q_lens + torch.randint(0, 200, (11,), generator=gen) if asym else q_lens
    q_off, k_off = lengths_to_offsets(q_lens).cuda(), lengths_to_offsets(k_lens).cuda()
    tq, tk = int(q_lens.sum()), int(k_lens.sum())
    hq, hkv = (3, 3) if HKV == H else (2 * (H // HKV), 2)  # with --gqa: H / HKV query heads per k/v head
    q = torch.randn(tq, hq, d, generator=gen).to("cuda", DTYPE)
    k, v = (torch.randn(tk, hkv, d, generator=gen).to("cuda", DTYPE) for _ in range(2))
    grad = torch.randn(tq, hq, d, generator=gen).to("cuda", DTYPE)
    scale, win = d ** -0.5, -1 if window is None else window
    out = torch.full((tq, hq, d), float("nan"), device="cuda", dtype=DTYPE)
    lse = torch.full((hq, tq), float("nan"), device="cuda")
    options = BASE if options is None else options
    launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, lse, options=options)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    launch_bwd(grad, q, k, v, out, lse, q_off, k_off, causal, scale, win, dq, dk, dv, options=options)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off, k_off, causal=causal, window=window)
    ref.backward(grad.double())
    errs = {"out": rel(out, ref.detach()), "dq": rel(dq, refs[0].grad), "dk": rel(dk, refs[1].grad),
            "dv": rel(dv, refs[2].grad)}
    finite = all(bool(torch.isfinite(t).all()) for t in (out, dq, dk, dv))
    passed = finite and all(e < 1e-2 for e in errs.values())
    log(f"check d={d} heads={hq}/{hkv} causal={causal} asym={asym} window={window} tma={options.tma is not False}: "
        + " ".join(f"{k}={e:.1e}" for k, e in errs.items()) + f" finite={finite} {'OK' if passed else 'FAIL'}")
    return {"d": d, "causal": causal, "asym": asym, "window": window, "finite": finite, **errs, "ok": passed}


def check_small(n_cases=4):
    """Mixed shapes with empty sequences against fp64, TMA and pointer paths."""
    global BASE
    cases = [(128, True, False, None), (128, True, True, 200), (256, False, True, None), (64, False, False, 50)]
    ok = True
    for i, (d, causal, asym, window) in enumerate(cases[:n_cases]):
        for tma in (None, False):  # default (TMA descriptors on Hopper), then plain pointer loads
            try:
                entry = check_case(i, d, causal, asym, window, opts(tma=tma))
            except Exception as exc:
                if tma is not None:
                    raise
                entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
            entry["tma"] = tma is None and BASE.tma is not False
            RESULTS["checks"].append(entry)
            if tma is None and not entry["ok"]:  # TMA path broken on this stack: time the pointer path only
                RESULTS["tma_error"] = entry.get("error", "wrong results")
                log(f"TMA path failed ({RESULTS['tma_error']}); using pointer loads from here on")
                BASE = dataclasses.replace(BASE, tma=False)
            elif not entry["ok"]:
                ok = False
    return ok


def fp8_error(out, ref, v) -> dict:
    """The fp8 forward's error measures: relative L2 to ``ref``, and the RMS error over the RMS of v (a softmax
    output is a convex combination of v's rows, so v sets its scale; the "normalised" error the 2e-2 bound is on)."""
    d = out.double() - ref.double()
    return {"rel": rel(out, ref), "norm": float(d.pow(2).mean().sqrt() / v.double().pow(2).mean().sqrt()),
            "max_abs": float(d.abs().max()), "finite": bool(torch.isfinite(out).all())}


def check_fp8_case(i, d, causal, asym, window, mode):
    """KernelOptions(fp8=mode) on one mixed-length case with empty sequences (outputs and gradients poisoned):
    the forward within 2e-2 (normalised, fp8_error) of fp64, the straight-through gradients within 1e-2."""
    gen = torch.Generator().manual_seed(200 + i)
    q_lens = torch.randint(1, 700, (11,), generator=gen)
    q_lens[[1, 6]] = 0
    k_lens = q_lens + torch.randint(0, 200, (11,), generator=gen) if asym else q_lens
    q_off, k_off = lengths_to_offsets(q_lens).cuda(), lengths_to_offsets(k_lens).cuda()
    tq, tk = int(q_lens.sum()), int(k_lens.sum())
    q = torch.randn(tq, 3, d, generator=gen).to("cuda", DTYPE)
    k, v = (torch.randn(tk, 3, d, generator=gen).to("cuda", DTYPE) for _ in range(2))
    grad = torch.randn(tq, 3, d, generator=gen).to("cuda", DTYPE)
    scale, win = d ** -0.5, -1 if window is None else window
    options = opts(fp8=mode)
    out = torch.full((tq, 3, d), float("nan"), device="cuda", dtype=DTYPE)
    lse = torch.full((3, tq), float("nan"), device="cuda")
    launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, lse, options=options)
    dq, dk, dv = family.backward(grad, q, k, v, out, lse, q_off, k_off, causal, scale, win, options=options)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off, k_off, causal=causal, window=window)
    ref.backward(grad.double())
    e = fp8_error(out, ref.detach(), v)
    grads = {"dq": rel(dq, refs[0].grad), "dk": rel(dk, refs[1].grad), "dv": rel(dv, refs[2].grad)}
    finite = e["finite"] and all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))
    passed = finite and e["norm"] < 2e-2 and all(g < 1e-2 for g in grads.values())
    log(f"fp8 {mode} check d={d} causal={causal} asym={asym} window={window}: out rel={e['rel']:.1e} "
        f"norm={e['norm']:.1e} max={e['max_abs']:.1e} " + " ".join(f"{k}={g:.1e}" for k, g in grads.items())
        + f" finite={finite} {'OK' if passed else 'FAIL'}")
    return {"mode": mode, "d": d, "causal": causal, "asym": asym, "window": window, "finite": finite, **e, **grads,
            "ok": passed}


def check_fp8_long(mode, length=65600, magnitude=30.0):
    """One long sequence of large-magnitude bf16 inputs (logits in the thousands): the fp8 forward stays finite;
    its error against bf16 jfa's output is reported."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    off = lengths_to_offsets(torch.tensor([length, 0, 3])).cuda()
    q, k, v = (torch.randn(length + 3, H, D, device="cuda", generator=gen).mul_(magnitude).to(DTYPE)
               for _ in range(3))
    out = jfa_triton(q, k, v, off, causal=True, options=opts(fp8=mode))
    e = fp8_error(out, jfa_triton(q, k, v, off, causal=True, options=BASE), v)
    log(f"fp8 {mode} long L={length} x{magnitude}: vs bf16 rel={e['rel']:.1e} norm={e['norm']:.1e} "
        f"finite={e['finite']} {'OK' if e['finite'] else 'FAIL'}")
    return {"mode": mode, "length": length, "magnitude": magnitude, **e, "ok": e["finite"]}


def check_fp8(n_cases=4) -> bool:
    """The fp8 forward's accuracy first (--fp8): small cases against fp64, then the long large-magnitude one."""
    cases = [(128, True, False, None), (128, True, True, 200), (64, False, True, None), (128, False, False, 50)]
    entries = []
    for mode in ("qk", "qkv"):
        entries += [check_fp8_case(i, *c, mode) for i, c in enumerate(cases[:n_cases])]
        entries.append(check_fp8_long(mode))
    RESULTS["fp8_checks"] = entries
    return all(e["ok"] for e in entries)


# -- methods ---------------------------------------------------------------------------------------

class Workload:
    def __init__(self, name, lens):
        self.name, self.lens = name, lens
        self.B = lens.numel()
        self.T = int(lens.sum())
        self.Lmax = int(lens.max())
        self.sum_l2 = float((lens.double() ** 2).sum())
        self.offsets = lengths_to_offsets(lens).cuda()
        gen = torch.Generator(device="cuda").manual_seed(7)
        self.q, self.k, self.v = (torch.randn(self.T, heads, D, device="cuda", dtype=DTYPE, generator=gen)
                                  .requires_grad_() for heads in (H, HKV, HKV))
        self.grad = torch.randn(self.T, H, D, device="cuda", dtype=DTYPE, generator=gen)

    def leaves(self):
        return [self.q, self.k, self.v]


def make_jfa(w, options=None):
    options = BASE if options is None else options
    return (lambda: jfa_triton(w.q, w.k, w.v, w.offsets, causal=True, options=options)), w.leaves(), w.grad


def make_jfa_ptr(w):
    """jfa with plain pointer loads instead of TMA tensor descriptors."""
    return make_jfa(w, opts(tma=False))


def make_jfa_nobuckets(w):
    """jfa without length buckets (one launch per kernel on the main tiles), whatever BUCKETS_BY_DEFAULT says."""
    return make_jfa(w, opts(buckets=()))


def make_jfa_fp8_qk(w):
    """jfa with the fp8 forward on Q and K (KernelOptions(fp8="qk")); the backward in bf16."""
    return make_jfa(w, opts(fp8="qk"))


def make_jfa_fp8_qkv(w):
    """jfa with the fp8 forward on Q, K, V and P (KernelOptions(fp8="qkv")); the backward in bf16."""
    return make_jfa(w, opts(fp8="qkv"))


def make_flex(w):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from gemzoo.api import positions, seq_ids

    doc = seq_ids(w.offsets, w.T)
    pos = positions(w.offsets, w.T)

    def mask_mod(b, h, qi, kj):
        return (doc[qi] == doc[kj]) & (pos[kj] <= pos[qi])

    block_mask = create_block_mask(mask_mod, None, None, w.T, w.T, device="cuda", _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)

    def fn():
        out = flex(w.q.transpose(0, 1).unsqueeze(0), w.k.transpose(0, 1).unsqueeze(0),
                   w.v.transpose(0, 1).unsqueeze(0), block_mask=block_mask, enable_gqa=HKV != H)
        return out.squeeze(0).transpose(0, 1)

    return fn, w.leaves(), w.grad


def _varlen_causal() -> dict:
    """varlen_attn's causal argument: window_size=(-1, 0) where it has one (torch >= 2.11), else is_causal."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}


def make_fa_varlen(w):
    """torch's FlashAttention varlen on the same jagged [T, H, D] tensors (int32 cumulative offsets)."""
    from torch.nn.attention.varlen import varlen_attn

    cu = w.offsets.to(torch.int32)
    causal = _varlen_causal()

    def fn():
        return varlen_attn(w.q, w.k, w.v, cu, cu, w.Lmax, w.Lmax, **causal)

    return fn, w.leaves(), w.grad


def make_njt(w):
    lmin, lmax = int(w.lens.min()), w.Lmax

    def nt(t):
        return torch.nested.nested_tensor_from_jagged(t, w.offsets, min_seqlen=lmin, max_seqlen=lmax).transpose(1, 2)

    def fn():
        out = F.scaled_dot_product_attention(nt(w.q), nt(w.k), nt(w.v), is_causal=True, enable_gqa=HKV != H)
        return out.transpose(1, 2).values()

    return fn, w.leaves(), w.grad


def make_padded(w):
    """Pre-padded [B, H, Lmax, D] leaves, SDPA is_causal (flash): padding never reaches real rows."""
    from gemzoo.api import jagged_to_padded

    pads = [jagged_to_padded(t.detach(), w.offsets, w.Lmax).transpose(1, 2).contiguous().requires_grad_()
            for t in w.leaves()]
    grad = jagged_to_padded(w.grad, w.offsets, w.Lmax).transpose(1, 2).contiguous()

    def fn():
        return F.scaled_dot_product_attention(*pads, is_causal=True, enable_gqa=HKV != H)

    return fn, pads, grad


METHODS = {"jfa": make_jfa, "jfa_ptr": make_jfa_ptr, "jfa_nobuckets": make_jfa_nobuckets, "flex": make_flex,
           "fa_varlen": make_fa_varlen, "njt_sdpa": make_njt, "padded_sdpa": make_padded}
# --fp8 adds these beside bf16 jfa (their outputs are cross-checked against bf16 jfa's like the others')
FP8_METHODS = {"jfa_fp8_qk": make_jfa_fp8_qk, "jfa_fp8_qkv": make_jfa_fp8_qkv}
# the methods on jfa's [T, H, D] layout, whose outputs and gradients are cross-checked against jfa's
SAME_LAYOUT = ("jfa", "jfa_ptr", "jfa_nobuckets", "flex", "fa_varlen", "njt_sdpa", *FP8_METHODS)


def bench(fn, leaves, grad, warmup=25, rep=100):
    from triton.testing import do_bench

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(grad)

    t_fwd = do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")
    t_fb = do_bench(fwd_bwd, warmup=warmup, rep=rep, grad_to_none=leaves, return_mode="median")
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in leaves:
        t.grad = None
    return t_fwd, t_fb, peak


def bench_graphed(fn, leaves, grad, warmup=25, rep=100):
    """(fwd ms, fwd+bwd ms) as ``bench`` times them, but of CUDA-graph replays (gemzoo.testing.cuda_graph): each
    recorded once, so the time is the kernels' alone, without the host's work per call (launches, autograd,
    input checks), as a compiled model in "reduce-overhead" mode runs them."""
    from triton.testing import do_bench

    from gemzoo.testing import cuda_graph

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        for t in leaves:
            t.grad = None  # recorded: the backward writes fresh buffers, which every replay rewrites
        fn().backward(grad)

    t_fwd = do_bench(cuda_graph(fwd)[0].replay, warmup=warmup, rep=rep, return_mode="median")
    t_fb = do_bench(cuda_graph(fwd_bwd)[0].replay, warmup=warmup, rep=rep, return_mode="median")
    for t in leaves:
        t.grad = None
    return t_fwd, t_fb


def run_workload(w, methods):
    res = {"B": w.B, "T": w.T, "Lmax": w.Lmax, "sum_L2": w.sum_l2,
           "padding_waste": 1 - w.sum_l2 / (w.B * w.Lmax ** 2), "methods": {},
           "jfa_launches": [{"tiles": [c.block_m, c.block_n], "lengths": r}
                            for c, r in length_buckets(w.q, w.k, w.B, "fwd", options=BASE)]}
    RESULTS["workloads"][w.name] = res
    fl_fwd, fl_fb = 2 * H * D * w.sum_l2, 7 * H * D * w.sum_l2
    outs = {}
    for name in methods:
        t0 = time.time()
        try:
            fn, leaves, grad = {**METHODS, **FP8_METHODS}[name](w)
            if name in SAME_LAYOUT:  # cross-check outputs and grads
                out = fn()
                out.backward(grad)
                outs[name] = [out.detach().clone()] + [t.grad.clone() for t in leaves]
                for t in leaves:
                    t.grad = None
            t_fwd, t_fb, peak = bench(fn, leaves, grad)
        except Exception as exc:  # a baseline that fails is reported, not fatal
            res["methods"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            log(f"{w.name} {name}: FAILED {exc}")
            continue
        res["methods"][name] = {"fwd_ms": t_fwd, "fwd_bwd_ms": t_fb, "fwd_tflops": fl_fwd / t_fwd / 1e9,
                                "fwd_bwd_tflops": fl_fb / t_fb / 1e9, "peak_mem_gb": peak / 1e9,
                                "setup_s": time.time() - t0}
        log(f"{w.name} {name}: fwd {t_fwd:.3f} ms ({fl_fwd / t_fwd / 1e9:.0f} TF/s)  fwd+bwd {t_fb:.3f} ms "
            f"({fl_fb / t_fb / 1e9:.0f} TF/s)  peak {peak / 1e9:.2f} GB")
    if "jfa" in outs:
        for other in SAME_LAYOUT[1:]:
            if other in outs:
                errs = {n: rel(a, b)
                        for n, a, b in zip(("out", "dq", "dk", "dv"), outs["jfa"], outs[other], strict=True)}
                res[f"jfa_vs_{other}"] = errs
                log(f"{w.name} jfa vs {other}: " + " ".join(f"{k}={e:.1e}" for k, e in errs.items()))
    return res


def breakdown(w, tma=None):
    """Per-kernel times of jfa's fwd+bwd (ms), schedules included."""
    return _breakdown(w, "jfa_ptr" if tma is False else "jfa", opts(tma=tma))


def outputs_and_grads(fn, leaves, grad) -> list[torch.Tensor]:
    """[out, *grads of leaves] of one call of ``fn`` backpropagating ``grad``, the leaves' grads left cleared."""
    for t in leaves:
        t.grad = None
    o = fn()
    o.backward(grad)
    res = [o.detach().clone()] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return res


def fwd_bwd_outputs(w, options: KernelOptions) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of one jfa fwd+bwd on workload ``w`` under ``options``: what a sweep candidate is checked
    against."""
    return outputs_and_grads(*make_jfa(w, options))


def kernel_calls(w, options: KernelOptions) -> dict:
    """Each kernel of jfa's causal fwd+bwd on workload ``w`` under ``options`` as a callable (fwd, preprocess, dkdv,
    dq), schedules included; their inputs (out, lse, delta) come from one forward and preprocess run first."""
    off = w.offsets
    q, k, v = (t.detach() for t in (w.q, w.k, w.v))
    scale = D ** -0.5
    out = torch.empty_like(q)
    lse = torch.empty(H, w.T, device="cuda")
    launch_fwd(q, k, v, off, off, True, scale, -1, out, lse, options=options)
    delta = family._launch_preprocess(out, w.grad)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    return {
        "fwd": lambda: launch_fwd(q, k, v, off, off, True, scale, -1, out, lse, options=options),
        "preprocess": lambda: family._launch_preprocess(out, w.grad),
        "dkdv": lambda: family._launch_dkdv(w.grad, q, k, v, lse, delta, off, off, True, scale, -1, dk, dv, 0, 1.0,
                                            -1, 0.0, options),
        "dq": lambda: family._launch_dq(w.grad, q, k, v, lse, delta, off, off, True, scale, -1, dq, 0, 1.0, -1, 0.0,
                                        options),
    }


def _breakdown(w, tag, options):
    from triton.testing import do_bench

    off = w.offsets
    parts = {"schedule": lambda: build_schedule(off, off, w.T, 128, over="q", causal=True, window=None),
             **kernel_calls(w, options)}
    res = {name: do_bench(fn, warmup=10, rep=50, return_mode="median") for name, fn in parts.items()}
    fl = H * D * w.sum_l2
    res["dkdv_tflops"] = 8 * fl / 2 / res["dkdv"] / 1e9  # 4 matmuls over the causal half
    res["dq_tflops"] = 6 * fl / 2 / res["dq"] / 1e9  # 3 matmuls
    RESULTS["workloads"][w.name][f"{tag}_breakdown_ms"] = res
    log(f"{w.name} {tag} breakdown: " + " ".join(f"{k}={v:.3f}" for k, v in res.items()))


def sweep(workloads, deadline, parts=("configs", "order", "tma")):
    """Block shapes / warps / stages per kernel, longest-first vs natural order, TMA forward tiles, dQ fused
    into the dk/dv kernel, and the short workload's length-bucket tiles (``sweep_short``)."""
    from triton.testing import do_bench

    base = default_configs(D, "cuda")
    fwd_cfgs = [base.fwd, KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 8, 2), KernelConfig(128, 128, 4, 3),
                KernelConfig(64, 128, 4, 3)]
    dkdv_cfgs = [base.dkdv, KernelConfig(64, 128, 8, 2), KernelConfig(32, 128, 8, 3), KernelConfig(128, 64, 8, 2),
                 KernelConfig(64, 128, 8, 1)]
    dq_cfgs = [base.dq, KernelConfig(128, 128, 8, 2), KernelConfig(128, 64, 4, 3), KernelConfig(64, 64, 4, 3),
               KernelConfig(128, 32, 8, 3)]
    out = RESULTS["sweep"]

    def timed(w, cfgs, mode, order="lpt", buckets=None, fused_dq=None):
        fn, leaves, grad = make_jfa(w, opts(configs=cfgs, order=order, buckets=buckets, fused_dq=fused_dq))
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    fn()
            return do_bench(run, warmup=10, rep=50, return_mode="median")
        return do_bench(lambda: fn().backward(grad), warmup=10, rep=50, grad_to_none=leaves,
                        return_mode="median")

    if "configs" in parts and D == 256:
        sweep_d256(workloads, deadline)
    elif "configs" in parts:
        for kind, cfgs in (("fwd", fwd_cfgs), ("dkdv", dkdv_cfgs), ("dq", dq_cfgs)):
            for c in cfgs:
                if time.time() > deadline:
                    log("sweep: out of time budget, stopping")
                    return
                full = Configs(**{**base.__dict__, kind: c})
                key = f"{kind} BM{c.block_m} BN{c.block_n} w{c.num_warps} s{c.num_stages}"
                try:
                    out[key] = {w.name: timed(w, full, "fwd" if kind == "fwd" else "fwd_bwd") for w in workloads}
                except Exception as exc:
                    out[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                log(f"sweep {key}: {out[key]}")
    if "order" in parts:
        # the adversarial layout for in-memory order: sequences stored shortest first, the longest last
        asc = Workload("gem_lognormal_ascending", torch.sort(workloads[0].lens).values)
        for order in ("lpt", "item", "natural"):
            if time.time() > deadline:
                return
            key = f"order {order}"
            out[key] = {w.name: {"fwd": timed(w, base, "fwd", order), "fwd_bwd": timed(w, base, "fwd_bwd", order)}
                        for w in workloads + [asc]}
            log(f"sweep {key}: {out[key]}")
    if "tma" in parts:
        for fwd_c in (KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 8, 2)):
            if time.time() > deadline:
                return
            key = f"fwd BM{fwd_c.block_m} BN{fwd_c.block_n} w{fwd_c.num_warps} s{fwd_c.num_stages} tma"
            out[key] = {w.name: timed(w, Configs(**{**base.__dict__, "fwd": fwd_c}), "fwd") for w in workloads}
            log(f"sweep {key}: {out[key]}")
    if "fused_dq" in parts:  # dQ inside the dk/dv kernel (fp32 atomics) against the separate dq kernel
        fused_cfgs = {"off": None, "on": base, "on, dkdv_fused BM64 BN128 w8 s3":
                      Configs(**{**base.__dict__, "dkdv_fused": KernelConfig(64, 128, 8, 3)})}
        for name, cfgs in fused_cfgs.items():
            if time.time() > deadline:
                return
            key = f"fused_dq {name}"
            try:
                out[key] = {w.name: timed(w, cfgs or base, "fwd_bwd", fused_dq=cfgs is not None) for w in workloads}
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            log(f"sweep {key}: {out[key]}")
    short = [w for w in workloads if w.name == "short"]
    if "short" in parts and short:
        sweep_short(short[0], deadline)


# D = 256 candidates per kernel, (BM, BN, warps, stages, TMA), in the order timed: the backward first (dk/dv
# 10.0 ms and dq 6.8 of fwd+bwd's 20.5 on the H200), pointer loads before TMA (D = 256 on TMA crashed ptxas in
# an early triton 3.6 GPU run; offline every candidate compiles with triton 3.6.0 and 3.7.1, and a failure on
# the GPU is recorded and the sweep goes on). From bench/compile_sm90.py (ptxas for sm_90a, triton 3.7.1,
# 2026-12-04): bytes spilled per thread (stores + loads) in the comments; all fit 227 KB of shared memory.
# Today's tiles (default_configs: dk/dv 32 q x 64 k, dq 64 q x 32 k, fwd 64 x 64, 8 warps, 2 stages, pointer
# loads) spill 9,332 / 3,968 / 6,640: the pointer path holds a 64-bit address per element of each 256-wide
# tile. 32-row tiles (dk/dv's keys, dq's queries) run mma.sync, not wgmma (whose M is 64).
D256_CANDIDATES = {
    "dkdv": [(32, 32, 8, 2, False),  # 560, mma.sync
             (16, 64, 8, 2, False),  # 5,880
             (32, 64, 8, 2, True),  # 1,980: today's tiles through TMA
             (64, 32, 8, 2, True),  # 0, mma.sync
             (32, 32, 8, 2, True),  # 0 (232 registers), mma.sync
             (32, 32, 4, 2, True),  # 256, mma.sync; 98 KB of shared memory: two programs per SM
             (64, 32, 8, 1, True),  # 8, mma.sync
             (16, 64, 8, 2, True),  # 1,972
             (64, 64, 8, 2, True)],  # 3,488
    "dq": [(32, 64, 4, 2, False),  # 3,244, mma.sync
           (128, 32, 8, 2, False),  # 5,812
           (64, 32, 8, 2, True),  # 720: today's tiles through TMA
           (32, 64, 8, 1, True),  # 0, mma.sync
           (32, 64, 4, 2, True),  # 136, mma.sync
           (64, 64, 8, 2, True),  # 704
           (64, 32, 4, 1, True),  # 940; 96 KB of shared memory: two programs per SM
           (128, 32, 8, 1, True),  # 1,296
           (64, 64, 16, 2, True)],  # 1,286 (128 registers)
    "fwd": [(128, 32, 8, 2, False),  # 3,972
            (64, 64, 8, 2, True),  # 0: today's tiles through TMA
            (64, 64, 8, 3, True),  # 0, 224 KB of shared memory
            (64, 64, 8, 1, True),  # 384
            (128, 64, 16, 2, True),  # 932 (128 registers)
            (128, 64, 8, 1, True),  # 936
            (128, 64, 8, 2, True)],  # 1,876
}


def kernel_ms(w, kind: str, options: KernelOptions) -> float:
    """Median ms of kernel ``kind`` (fwd, dkdv or dq) alone on workload ``w`` under ``options``, schedule included."""
    from triton.testing import do_bench

    return do_bench(kernel_calls(w, options)[kind], warmup=25, rep=200, return_mode="median")


def d256_options(configs: Configs) -> KernelOptions:
    """Options running ``configs`` at D = 256 as given: _tma_ok refuses TMA there unless asked (tma=True), so a
    config that asks for TMA (tma None) turns it on for the call, and the others keep pointer loads (tma False)."""
    if all(configs.of(kind).tma is False for kind in ("fwd", "dkdv", "dq")):
        return opts(configs=configs)
    return opts(configs=configs, tma=True)


def sweep_d256(workloads, deadline):
    """--sweep configs at --head-dim 256: each kernel's D256_CANDIDATES with the other two on today's tiles,
    pointer loads before TMA; each candidate's out, dq, dk, dv checked against the launch on default_configs
    (max relative error < 1e-2) before it is timed (fwd+bwd, and its kernel alone); then the best per kernel
    together, and the best pointer-load ones together (a fallback should TMA fail at D = 256)."""
    from triton.testing import do_bench

    base = default_configs(D, "cuda")
    ptr = Configs(*(dataclasses.replace(base.of(kind), tma=False) for kind in ("fwd", "dkdv", "dq")))
    out = RESULTS["sweep"].setdefault("d256", {})
    flops = {"fwd": 2, "dkdv": 4, "dq": 3}  # / (H D sum L^2): 2 per matmul (fwd 2, dk/dv 4, dq 3), causal half

    refs = {w.name: fwd_bwd_outputs(w, opts(configs=ptr)) for w in workloads}

    def measure(key, configs, kind):
        """{workload: {fwd_bwd_ms, fwd_ms, <kind>_ms, <kind>_tflops, max_rel_vs_default, ok}}; False past the
        deadline."""
        if time.time() > deadline:
            log("sweep d256: out of time budget, stopping")
            return False
        options, res = d256_options(configs), {}
        for w in workloads:
            try:
                err = max(rel(a, b) for a, b in zip(fwd_bwd_outputs(w, options), refs[w.name], strict=True))
                r = {"max_rel_vs_default": err, "ok": err < 1e-2}
                if r["ok"]:
                    fn, leaves, grad = make_jfa(w, options)
                    r["fwd_bwd_ms"] = do_bench(lambda fn=fn, grad=grad: fn().backward(grad), warmup=25, rep=200,
                                               grad_to_none=leaves, return_mode="median")
                    for t in leaves:
                        t.grad = None
                    for k in ("fwd", "dkdv", "dq") if kind == "all" else (kind,):
                        r[f"{k}_ms"] = ms = kernel_ms(w, k, options)
                        r[f"{k}_tflops"] = flops[k] * H * D * w.sum_l2 / ms / 1e9
            except Exception as exc:
                r = {"error": f"{type(exc).__name__}: {exc}"[:300], "ok": False}
            res[w.name] = r
        out[key] = res
        log(f"sweep d256 {key}: " + str({w: {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                                         for w, r in res.items()}))
        return res

    if measure("default", ptr, "all") is False:
        return
    best = {False: {}, True: {}}  # per TMA use: kind -> (ms of the kernel on the first workload, config)
    for tma in (False, True):
        for kind, tiles in D256_CANDIDATES.items():
            for bm, bn, warps, stages, use_tma in tiles:
                if use_tma != tma:
                    continue
                c = KernelConfig(bm, bn, warps, stages, tma=None if tma else False)
                key = f"{kind} BM{bm} BN{bn} w{warps} s{stages} {'tma' if tma else 'ptr'}"
                res = measure(key, dataclasses.replace(ptr, **{kind: c}), kind)
                if res is False:
                    return
                first = res[workloads[0].name]
                if first.get("ok") and (kind not in best[tma] or first[f"{kind}_ms"] < best[tma][kind][0]):
                    best[tma][kind] = (first[f"{kind}_ms"], c)
    default = {kind: (out["default"][workloads[0].name].get(f"{kind}_ms", float("inf")), ptr.of(kind))
               for kind in ("fwd", "dkdv", "dq")}
    pointer = {kind: min(default[kind], best[False].get(kind, default[kind]), key=lambda x: x[0])
               for kind in default}
    overall = {kind: min(pointer[kind], best[True].get(kind, pointer[kind]), key=lambda x: x[0]) for kind in default}
    for name, pick in (("best pointer loads", pointer), ("best", overall)):
        configs = Configs(*(pick[kind][1] for kind in ("fwd", "dkdv", "dq")))
        RESULTS["sweep"][f"d256 {name}"] = {kind: str(pick[kind][1]) for kind in pick}
        if measure(f"combo {name}", configs, "all") is False:
            return


SHORT_TILES = {  # candidates for a short bucket's tiles: (BM, BN, warps, stages) per kernel
    "fwd": [(64, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 1), (64, 32, 4, 1), (32, 64, 4, 1), (32, 32, 4, 1),
            (32, 32, 2, 1), (32, 32, 2, 2), (16, 32, 2, 1), (16, 16, 1, 1)],
    "dkdv": [(64, 64, 8, 3), (64, 64, 4, 1), (32, 64, 4, 1), (64, 32, 4, 1), (32, 32, 4, 1), (32, 32, 2, 1),
             (16, 32, 2, 1), (32, 16, 2, 1)],
    "dq": [(64, 64, 8, 3), (64, 64, 4, 1), (32, 64, 4, 1), (64, 32, 4, 1), (32, 32, 4, 1), (32, 32, 2, 1),
           (16, 32, 2, 1), (32, 16, 2, 1)],
}
MID_TILES = {  # for a second bucket, sequences of 65..128 tokens (pointer loads, as the short bucket's)
    "fwd": [(128, 128, 8, 3), (128, 64, 4, 1), (64, 64, 4, 1), (64, 32, 4, 1), (64, 64, 4, 2), (32, 32, 2, 1)],
    "dkdv": [(64, 128, 8, 3), (64, 64, 4, 1), (32, 64, 4, 1), (32, 32, 2, 1), (16, 32, 2, 1), (64, 64, 8, 2)],
    "dq": [(128, 64, 8, 3), (64, 64, 4, 1), (64, 32, 4, 1), (32, 32, 2, 1), (128, 64, 4, 1), (64, 64, 8, 2)],
}


class ShortSweep:
    """Tiles of the short workload's length buckets (bench_jfa.py --sweep short): each kernel's candidates in
    one bucket, the other kernels and buckets fixed, every candidate checked against the unbucketed launch
    (max relative error of out, dq, dk, dv) before its time counts; then combinations of the winners."""

    def __init__(self, w, deadline):
        self.w, self.deadline, self.out = w, deadline, RESULTS["sweep"].setdefault("short", {})
        self.ref = self.outputs((), None)

    def outputs(self, buckets, tma):
        return fwd_bwd_outputs(self.w, opts(buckets=buckets, tma=tma))

    def timed(self, buckets, mode, tma=None):
        from triton.testing import do_bench

        fn, leaves, grad = make_jfa(self.w, opts(buckets=buckets, tma=tma))
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    fn()
            return do_bench(run, warmup=10, rep=40, return_mode="median")
        ms = do_bench(lambda: fn().backward(grad), warmup=10, rep=40, grad_to_none=leaves, return_mode="median")
        for t in leaves:
            t.grad = None
        return ms

    def measure(self, key, buckets, modes, tma=None):
        """{mode: ms, max_rel_vs_unbucketed, ok} of one variant, or None past the deadline."""
        if time.time() > self.deadline:
            log("sweep short: out of time budget, stopping")
            return None
        try:
            err = max(rel(a, b) for a, b in zip(self.outputs(buckets, tma), self.ref, strict=False))
            res = {m: self.timed(buckets, m, tma) for m in modes}
            res.update(max_rel_vs_unbucketed=err, ok=err < 1e-2)
        except Exception as exc:
            res = {"error": f"{type(exc).__name__}: {exc}"[:300], "ok": False}
        self.out[key] = res
        log(f"sweep short {key}: {res}")
        return res

    def tiles(self, name, below, max_len, configs, candidates, tmas):
        """The best config per kernel for the bucket (previous max, max_len], ``below`` the buckets under it."""
        best = {}
        for kind, tiles in candidates.items():
            for tile in tiles:
                for tma in tmas:
                    c = KernelConfig(*tile, tma=tma)
                    key = (f"{name} {kind} BM{c.block_m} BN{c.block_n} w{c.num_warps} s{c.num_stages}"
                           + (" ptr" if tma is False else ""))
                    mode = "fwd" if kind == "fwd" else "fwd_bwd"
                    res = self.measure(key, (*below, Bucket(max_len, Configs(**{**configs.__dict__, kind: c}))),
                                       (mode,))
                    if res is None:
                        return best
                    if res["ok"] and (kind not in best or res[mode] < best[kind][0]):
                        best[kind] = (res[mode], c)
        RESULTS["sweep"][f"short_best {name}"] = {k: {"ms": v[0], "config": str(v[1])} for k, v in best.items()}
        return best


def sweep_short(w, deadline):
    """The <= 64 bucket's tiles (ops.short_buckets) fixed, a 65..128 bucket's swept (pointer loads); then the
    default buckets, with the 128 bucket's winners, with TMA forced on everywhere, and with pointer loads in the
    main launch too (fwd and fwd+bwd, each checked against the unbucketed launch)."""
    sw = ShortSweep(w, deadline)
    short = short_buckets(D, "cuda")
    mid_base = Configs(*(KernelConfig(64, 64, 4, 1, tma=False),) * 3)
    best = sw.tiles("128", short, 128, mid_base, MID_TILES, (False,))
    combos = {"off": ((), None), "default": (short, None), "default, TMA everywhere": (short, True),
              "default, pointer loads everywhere": (short, False),
              "default + 128 on 64x64 w4 s1": ((*short, Bucket(128, mid_base)), None)}
    if len(best) == 3:
        mid = Configs(best["fwd"][1], best["dkdv"][1], best["dq"][1])
        combos["default + 128 best"] = ((*short, Bucket(128, mid)), None)
        combos["default + 128 best, pointer loads everywhere"] = ((*short, Bucket(128, mid)), False)
    for name, (buckets, tma) in combos.items():
        if sw.measure(f"combo {name}", buckets, ("fwd", "fwd_bwd"), tma) is None:
            return


def table():
    heads = f"H={H}" if HKV == H else f"H={H} q heads over {HKV} k/v heads"
    lines = ["", f"jfa benchmark on {RESULTS['device']} ({heads}, D={D}, bf16; median ms of do_bench)",
             f"{'workload':14} {'method':12} {'fwd ms':>8} {'TF/s':>5} {'f+b ms':>8} {'TF/s':>5} {'peak GB':>8} "
             f"{'jfa x fwd':>9} {'jfa x f+b':>9}"]
    for wname, res in RESULTS["workloads"].items():
        j = res["methods"].get("jfa", {})
        for name, m in res["methods"].items():
            if "error" in m:
                lines.append(f"{wname:14} {name:12} ERROR {m['error'][:60]}")
                continue
            sf = m["fwd_ms"] / j["fwd_ms"] if "fwd_ms" in j else float("nan")
            sb = m["fwd_bwd_ms"] / j["fwd_bwd_ms"] if "fwd_bwd_ms" in j else float("nan")
            lines.append(f"{wname:14} {name:12} {m['fwd_ms']:8.3f} {m['fwd_tflops']:5.0f} {m['fwd_bwd_ms']:8.3f} "
                         f"{m['fwd_bwd_tflops']:5.0f} {m['peak_mem_gb']:8.2f} {sf:9.2f} {sb:9.2f}")
        lines.append(f"{'':14} T={res['T']} Lmax={res['Lmax']} padding waste={res['padding_waste']:.0%}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out", help="folder for bench_jfa.json")
    ap.add_argument("--sweep", default="", help="comma-separated extra sweeps: configs, order, tma, fused_dq, short")
    ap.add_argument("--workloads", default="gem_lognormal,uniform_8k,short", help="comma-separated subset")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds after which the sweep stops")
    ap.add_argument("--checks", type=int, default=4, help="how many small correctness cases to run (1-4)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    ap.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    ap.add_argument("--gqa", nargs="?", const="32,8", default=None, metavar="HQ,HKV",
                    help="grouped-query attention: HQ query heads over HKV k/v heads (default 32,8)")
    ap.add_argument("--fp8", action="store_true",
                    help="add the fp8 forward (KernelOptions.fp8 qk and qkv) beside bf16 jfa, its accuracy checked first")
    args = ap.parse_args()
    global H, HKV, D
    if args.heads < 1 or args.head_dim < 1:
        sys.exit(f"--heads and --head-dim must be positive, got {args.heads} and {args.head_dim}")
    H = HKV = args.heads
    D = args.head_dim
    if args.gqa is not None:
        try:
            H, HKV = (int(x) for x in args.gqa.split(","))
        except ValueError:
            sys.exit(f"--gqa takes HQ,HKV (e.g. 32,8), got {args.gqa!r}")
        if HKV < 1 or H % HKV:
            sys.exit(f"--gqa {args.gqa}: the k/v heads must divide the query heads")
    RESULTS["heads"] = {"q": H, "kv": HKV}
    RESULTS["head_dim"] = D
    if not torch.cuda.is_available():
        sys.exit("bench_jfa needs a CUDA device")
    import triton

    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    RESULTS["command"] = " ".join(sys.argv)
    t0 = time.time()
    ok = check_small(args.checks)
    save(args.out)
    if not ok:
        print("jfa FAILED its correctness checks; not timing it", flush=True)
        sys.exit(1)
    methods = args.methods.split(",")
    if args.fp8:
        fp8_ok = check_fp8(args.checks)
        save(args.out)
        if fp8_ok:
            methods = [m for m in methods if m not in FP8_METHODS]
            at = methods.index("jfa") + 1 if "jfa" in methods else 0
            methods[at:at] = list(FP8_METHODS)
        else:
            print("the fp8 forward FAILED its accuracy checks; not timing it", flush=True)
    lengths = {"gem_lognormal": gem_lognormal, "uniform_8k": uniform_8k, "short": short_lengths}
    workloads = [Workload(name, lengths[name]()) for name in args.workloads.split(",")]
    for w in workloads:
        run_workload(w, methods)
        if "jfa" in args.methods:
            breakdown(w)
            breakdown(w, tma=False)
        save(args.out)
        log(f"[{time.time() - t0:.0f}s]")
    if args.sweep:
        sweep(workloads, t0 + args.budget, args.sweep.split(","))
        save(args.out)
    print(table(), flush=True)
    name = "table.txt" if HKV == H else "table_gqa.txt"
    if D != 128:
        name = name.replace(".txt", f"_d{D}.txt")
    with open(os.path.join(args.out, name), "w") if args.out else open(os.devnull, "w") as f:
        f.write(table() + "\n")


if __name__ == "__main__":
    main()
