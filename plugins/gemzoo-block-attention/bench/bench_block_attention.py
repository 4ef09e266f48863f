#!/usr/bin/env python3
"""Benchmark block-attention in one process: H=4, D=128, bf16, forward and forward+backward.

Rows:
  * block 64 on one sequence of L = 8K, 16K, 32K, 64K: block-attention vs FlexAttention with the same
    BlockMask (compiled) and dense causal SDPA (flash); time linear in L (t(2L) / t(L) ~ 2)
  * block 64 + window 1024 at L = 32K vs Flex with the same mask
  * block 64 on gem-lognormal (jagged, B=64) vs Flex with a document + block mask
  * rotary fused vs rotary applied in torch before the kernel (block 64, gem-lognormal), with peak memory
Median of triton.testing.do_bench(warmup=25, rep=100); ``--graphs`` adds each block-attention and Flex row timed as
CUDA-graph replays (the kernels' time without the host's per call, as a compiled model in "reduce-overhead" mode
runs them); TFLOP/s from allowed pairs only (fwd 4*H*D per pair,
fwd+bwd 3x). Correctness first: every block-attention row is checked against Flex (same mask) forward.
The gem-lognormal distribution is bench_jfa's (imported).

    PYTHONPATH=.:plugins/gemzoo-jfa:plugins/gemzoo-block-attention \
        python3 plugins/gemzoo-block-attention/bench/bench_block_attention.py --out results/ [--deadline 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gemzoo-jfa" / "bench"))
from bench_jfa import bench_graphed, gem_lognormal, log, rel  # noqa: E402
from gemzoo_block_attention import block_attention_triton  # noqa: E402
from gemzoo_block_attention.ops import rope_jagged  # noqa: E402

from gemzoo.api import (  # noqa: E402
    attention_pairs,  # noqa: E402
    lengths_to_offsets,
    positions,
    seq_ids,
)

H, D, DTYPE, BLOCK, THETA = 4, 128, torch.bfloat16, 64, 10000.0
RESULTS: dict = {"device": None, "rows": [], "skipped": []}
GRAPHS = False  # --graphs: also time block-attention and Flex as CUDA-graph replays (the kernels alone)
DEVICE = "cuda"  # --dry-run: "cpu" under TRITON_INTERPRET=1, tiny shapes, one untimed call each (code paths only)


def save(out_dir):
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_block_attention.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def inputs(lens, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    off = lengths_to_offsets(lens).to(DEVICE)
    t = int(lens.sum())
    dtype = DTYPE if DEVICE == "cuda" else torch.float32
    q, k, v = (torch.randn(t, H, D, device=DEVICE, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(t, H, D, device=DEVICE, dtype=dtype, generator=gen)
    return off, (q, k, v), grad


def timed(fn, leaves, grad):
    """(fwd ms, fwd+bwd ms, peak bytes of one fwd+bwd above what is allocated before it)."""
    if DEVICE != "cuda":  # dry run: one forward (and backward where CPU has one), untimed
        if getattr(fn, "cpu_backward", True):
            fn().backward(grad)
        else:
            with torch.no_grad():
                fn()
        for t in leaves:
            t.grad = None
        return 1.0, 1.0, 0
    from triton.testing import do_bench

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(grad)

    t_f = do_bench(fwd, warmup=25, rep=100, return_mode="median")
    t_fb = do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=list(leaves), return_mode="median")
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
    return t_f, t_fb, peak


_flex = None


def flex_fn(off, leaves, t, *, block, window, doc_mask):
    """FlexAttention (compiled) over [1, H, T, D] with the same mask: document (when jagged) & causal & block
    (& window), bottom-right = top-left here (Lq = Lk)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _flex
    if DEVICE != "cuda":
        _flex = flex_attention
    if _flex is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _flex = torch.compile(flex_attention, dynamic=False)
    doc, pos = seq_ids(off, t), positions(off, t)

    def mask_mod(b, h, qi, kj):
        ok = (pos[kj] <= pos[qi]) & (pos[qi] // block == pos[kj] // block)
        if doc_mask:
            ok = ok & (doc[qi] == doc[kj])
        if window is not None:
            ok = ok & (pos[qi] - pos[kj] < window)
        return ok

    bm = create_block_mask(mask_mod, None, None, t, t, device=DEVICE, _compile=DEVICE == "cuda")
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in leaves)
    if DEVICE != "cuda":  # CPU Flex refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()

    def fn():
        return _flex(q, k, v, block_mask=bm).squeeze(0).transpose(0, 1)

    fn.cpu_backward = False  # FlexAttention has no CPU backward
    return fn


def sdpa_dense_fn(leaves):
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in leaves)

    def fn():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(0).transpose(0, 1)

    return fn


def tflops(pairs, ms, fwd_bwd):
    return 4 * H * D * pairs * (3 if fwd_bwd else 1) / (ms * 1e-3) / 1e12


def row(name, method, lens, ms_f, ms_fb, peak, pairs, **extra):
    r = {"workload": name, "method": method, "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "peak_gib": peak / 2**30,
         "T": int(lens.sum()), "allowed_pairs": pairs, "fwd_tflops": tflops(pairs, ms_f, False),
         "fwd_bwd_tflops": tflops(pairs, ms_fb, True), **extra}
    RESULTS["rows"].append(r)
    log(f"{name:28s} {method:22s} fwd {ms_f:8.3f} ms  fwd+bwd {ms_fb:8.3f} ms  peak {r['peak_gib']:6.2f} GiB  "
        f"{r['fwd_bwd_tflops']:6.1f} TFLOP/s (allowed pairs)" + "".join(f"  {k}={v}" for k, v in extra.items()))
    return r


def compare(name, lens, *, window=None, doc_mask=False, dense=False):
    """block-attention vs Flex (same mask) [vs dense causal SDPA] on one workload."""
    off, leaves, grad = inputs(lens)
    t = int(lens.sum())
    pairs = attention_pairs(lens, causal=True, block_size=BLOCK, window=window)

    def mine():
        return block_attention_triton(*leaves, off, block_size=BLOCK, window=window)

    flex = flex_fn(off, leaves, t, block=BLOCK, window=window, doc_mask=doc_mask)
    with torch.no_grad():
        err = rel(mine().float(), flex().float())
    assert err < 2e-2, f"{name}: block-attention differs from Flex (same mask): {err:.2e}"
    r_mine = row(name, "block-attention", lens, *timed(mine, leaves, grad), pairs, err_vs_flex=round(err, 5))
    r_flex = row(name, "flex", lens, *timed(flex, leaves, grad), pairs)
    r_mine["speedup_fwd_vs_flex"] = r_flex["fwd_ms"] / r_mine["fwd_ms"]
    r_mine["speedup_fwd_bwd_vs_flex"] = r_flex["fwd_bwd_ms"] / r_mine["fwd_bwd_ms"]
    if dense:
        r_sdpa = row(name, "sdpa-dense-causal", lens, *timed(sdpa_dense_fn(leaves), leaves, grad),
                     attention_pairs(lens, causal=True))
        r_mine["speedup_fwd_bwd_vs_dense_sdpa"] = r_sdpa["fwd_bwd_ms"] / r_mine["fwd_bwd_ms"]
    log(f"  -> vs Flex: fwd {r_mine['speedup_fwd_vs_flex']:.2f}x, fwd+bwd {r_mine['speedup_fwd_bwd_vs_flex']:.2f}x")
    if GRAPHS and DEVICE == "cuda":  # the same calls replayed from CUDA graphs: kernel time, no host per call
        g_mine = row(name, "block-attention (graph)", lens, *bench_graphed(mine, list(leaves), grad), 0, pairs)
        g_flex = row(name, "flex (graph)", lens, *bench_graphed(flex, list(leaves), grad), 0, pairs)
        g_mine["speedup_fwd_vs_flex"] = g_flex["fwd_ms"] / g_mine["fwd_ms"]
        g_mine["speedup_fwd_bwd_vs_flex"] = g_flex["fwd_bwd_ms"] / g_mine["fwd_bwd_ms"]
        log(f"  -> CUDA graphs, vs Flex: fwd {g_mine['speedup_fwd_vs_flex']:.2f}x, "
            f"fwd+bwd {g_mine['speedup_fwd_bwd_vs_flex']:.2f}x")
    return r_mine


def rotary(lens):
    """Fused RoPE vs RoPE in torch (rope_jagged: fp32 rotation, new q/k) before the same kernel."""
    name = "gem_lognormal rotary"
    off, leaves, grad = inputs(lens, seed=1)
    pairs = attention_pairs(lens, causal=True, block_size=BLOCK)

    def fused():
        return block_attention_triton(*leaves, off, block_size=BLOCK, rope_theta=THETA)

    def unfused():
        q, k = rope_jagged(leaves[0], leaves[1], off, off, THETA)
        return block_attention_triton(q, k, leaves[2], off, block_size=BLOCK)

    with torch.no_grad():
        err = rel(fused().float(), unfused().float())
    assert err < 2e-2, f"fused and unfused RoPE differ: {err:.2e}"
    r_f = row(name, "rope fused", lens, *timed(fused, leaves, grad), pairs, err_vs_unfused=round(err, 5))
    r_u = row(name, "rope in torch + kernel", lens, *timed(unfused, leaves, grad), pairs)
    r_f["speedup_fwd_bwd_vs_unfused"] = r_u["fwd_bwd_ms"] / r_f["fwd_bwd_ms"]
    r_f["peak_ratio_vs_unfused"] = r_f["peak_gib"] / max(r_u["peak_gib"], 1e-9)
    log(f"  -> fused RoPE: fwd+bwd {r_f['speedup_fwd_bwd_vs_unfused']:.2f}x, peak {r_f['peak_ratio_vs_unfused']:.2f}x")


def table():
    lines = ["| workload | method | fwd ms | fwd+bwd ms | peak GiB | fwd+bwd TFLOP/s (allowed pairs) | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in RESULTS["rows"]:
        ratio = ", ".join(f"{k.replace('speedup_', '').replace('_', ' ')} {v:.2f}x" for k, v in r.items()
                          if k.startswith("speedup") or k.startswith("peak_ratio"))
        lines.append(f"| {r['workload']} | {r['method']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                     f"{r['peak_gib']:.2f} | {r['fwd_bwd_tflops']:.1f} | {ratio} |")
    lin = RESULTS.get("linearity")
    if lin:
        lines.append("")
        lines.append("time linear in L (block-attention fwd+bwd, t(2L) / t(L)): " +
                     ", ".join(f"{k} {v:.2f}" for k, v in lin.items()))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out", help="folder for bench_block_attention.json")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds; rows not started by then are skipped")
    p.add_argument("--lengths", default="8192,16384,32768,65536")
    p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes, untimed")
    p.add_argument("--graphs", action="store_true",
                   help="also time block-attention and Flex as CUDA-graph replays: the kernels without the host")
    args = p.parse_args()
    import triton

    global DEVICE, BLOCK, GRAPHS
    GRAPHS = args.graphs
    histories = gem_lognormal  # the batch of the rotary and gem-lognormal rows
    if args.dry_run:
        DEVICE, BLOCK, args.lengths = "cpu", 16, "64,128"
        histories = lambda: torch.tensor([40, 0, 70, 17])  # noqa: E731
    start = time.time()
    RESULTS["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    RESULTS["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    one_seq = {n: (f"one seq L={n}", lambda n=n: compare(f"one_seq_L{n}", torch.tensor([n]), dense=True))
               for n in map(int, args.lengths.split(","))}
    win_l, win = (32768, 1024) if DEVICE == "cuda" else (128, 10)
    rest = [("rotary", lambda: rotary(histories())),
            ("gem-lognormal", lambda: compare("gem_lognormal_B64", histories(), doc_mask=True)),
            ("block+window L=32K", lambda: compare(f"one_seq_L{win_l}_win{win}", torch.tensor([win_l]), window=win))]
    lens = sorted(one_seq)
    steps = [one_seq[n] for n in lens[:2]] + rest[:1] + [one_seq[n] for n in lens[2:3]] + rest[1:2] + \
        [one_seq[n] for n in lens[3:]] + rest[2:]  # the cheap rows first: a --deadline cuts the tail
    for what, fn in steps:
        if time.time() - start > args.deadline:
            RESULTS["skipped"].append(what)
            log(f"skipped (deadline): {what}")
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - record and go on: one process measures every row
            RESULTS.setdefault("errors", {})[what] = f"{type(exc).__name__}: {exc}"
            log(f"FAILED {what}: {type(exc).__name__}: {exc}")
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        save(args.out)
    RESULTS["linearity"] = {}
    for method, tag in (("block-attention", ""), ("block-attention (graph)", " (graph)")):
        mine = {r["T"]: r["fwd_bwd_ms"] for r in RESULTS["rows"] if r["method"] == method
                and r["workload"].startswith("one_seq_L") and "win" not in r["workload"]}
        RESULTS["linearity"].update({f"{n}->{2 * n}{tag}": mine[2 * n] / mine[n] for n in sorted(mine)
                                     if 2 * n in mine})
    log(table())
    save(args.out)
    if args.out:
        Path(args.out, "bench_block_attention.md").write_text(table() + "\n")


if __name__ == "__main__":
    main()
