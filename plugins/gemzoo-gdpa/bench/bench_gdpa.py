#!/usr/bin/env python3
"""Benchmark gdpa (pointwise attention) against its baselines, every row in one process.

Workloads (H=4, D=128, bf16; distributions from plugins/gemzoo-jfa/bench/bench_jfa.py and docs/benchmarks.md):
  1. silu causal self-attention, norm = max length, on gem_lognormal and uniform_8k, fwd and fwd+bwd:
     gdpa vs eager torch pointwise on padded tensors and jfa (softmax) on the same data;
  2. every other activation, fwd+bwd, gem_lognormal: vs gdpa silu;
  3. cross attention: 16, 64 and 256 candidates per user (``--candidates``) over gem_lognormal histories,
     non-causal, fwd+bwd: gdpa silu (the default plan: split-K forward; and unsplit) vs FlexAttention (softmax,
     compiled, document mask), jfa softmax on the same mask and the eager padded reference;
  4. short: B=4096, lognormal median 48, sigma 0.7, clipped 1..1024, silu causal: vs eager and jfa.
Median of triton.testing.do_bench(warmup=25, rep=100); with ``--graphs`` the cross rows are also timed as CUDA-graph
replays (each method recorded once, forward and fwd+bwd), which leaves out the host's time per call. Useful FLOPs count allowed pairs only: causal
fwd 2*H*D*sum L^2, fwd+bwd 7*H*D*sum L^2 (docs/benchmarks.md); cross fwd 4*H*D*pairs, fwd+bwd 14*H*D*pairs.
Correctness first: gdpa against the eager padded implementation on every workload it is timed on; on the cross
rows also (with --no-eager too) the split plan against the unsplit kernel and jfa softmax against Flex.

    PYTHONPATH=.:plugins/gemzoo-jfa:plugins/gemzoo-gdpa python3 plugins/gemzoo-gdpa/bench/bench_gdpa.py [--out DIR]
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
from bench_jfa import (  # noqa: E402
    Workload,
    bench_graphed,
    gem_lognormal,
    log,
    outputs_and_grads,
    rel,
    short_lengths,
    uniform_8k,
)
from gemzoo_gdpa import gdpa_triton  # noqa: E402
from gemzoo_jfa import jfa_triton  # noqa: E402

from gemzoo.api import ACTIVATIONS, apply_activation, jagged_to_padded, lengths_to_offsets, padded_to_jagged  # noqa: E402

H, D, DTYPE = 4, 128, torch.bfloat16
RESULTS: dict = {"device": None, "rows": [], "checks": {}}
EAGER = True  # --no-eager skips the (slow) eager padded baselines
GRAPHS = False  # --graphs also times the cross rows as CUDA-graph replays
EAGER_BUDGET = 24e9  # bytes of [chunk, H, Lq, Lk] intermediates the eager baseline may hold at once


def timed(fwd, fwd_bwd, leaves):
    from triton.testing import do_bench

    t_f = do_bench(fwd, warmup=25, rep=100, return_mode="median")
    t_fb = do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    for t in leaves:
        t.grad = None
    return t_f, t_fb


def autograd_pair(fn, leaves, grad):
    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(grad)

    return fwd, fwd_bwd


class Eager:
    """Eager torch pointwise attention on padded [chunk, H, Lq, Lk] tensors, chunked over the batch so the
    score tensors fit (a chunk's backward runs right after its forward). Same math as docs/attention.md."""

    def __init__(self, q, k, v, q_off, k_off, grad, causal, act, norm):
        lq, lk = q_off.diff(), k_off.diff()
        self.lq_max, self.lk_max = int(lq.max()), int(lk.max())
        self.q_off, self.causal, self.act, self.norm = q_off, causal, act, norm
        pad = lambda t, off, n: jagged_to_padded(t.detach(), off, n).transpose(1, 2).contiguous()  # noqa: E731
        self.leaves = [pad(q, q_off, self.lq_max).requires_grad_(), pad(k, k_off, self.lk_max).requires_grad_(),
                       pad(v, k_off, self.lk_max).requires_grad_()]
        self.grad = pad(grad, q_off, self.lq_max)
        self.lq, self.lk = lq, lk
        per_seq = H * self.lq_max * self.lk_max * 14  # bf16 S, P, act' and grads, bool mask
        self.chunk = max(1, int(EAGER_BUDGET // per_seq))
        self.B = lq.numel()
        self.scale = q.shape[-1] ** -0.5

    def _chunk(self, s, e, q, k, v):
        i = torch.arange(self.lq_max, device=q.device).view(1, 1, -1, 1)
        j = torch.arange(self.lk_max, device=q.device).view(1, 1, 1, -1)
        lq, lk = self.lq[s:e].view(-1, 1, 1, 1), self.lk[s:e].view(-1, 1, 1, 1)
        mask = j < lk
        if self.causal:
            mask = mask & (j <= i + lk - lq)
        sc = self.scale * (q[s:e] @ k[s:e].transpose(-1, -2))
        p = apply_activation(sc, self.act) * mask
        if self.norm is not None:
            p = p / self.norm
        return p @ v[s:e]

    def fwd(self):
        with torch.no_grad():
            return [self._chunk(s, min(s + self.chunk, self.B), *self.leaves) for s in range(0, self.B, self.chunk)]

    def fwd_bwd(self):
        for s in range(0, self.B, self.chunk):
            e = min(s + self.chunk, self.B)
            self._chunk(s, e, *self.leaves).backward(self.grad[s:e])

    def output(self):
        out = torch.cat(self.fwd())
        return padded_to_jagged(out.transpose(1, 2), self.q_off)


def row(workload, method, t_f, t_fb, fl_f, fl_fb, **extra):
    r = {"workload": workload, "method": method, "fwd_ms": t_f, "fwd_bwd_ms": t_fb,
         "fwd_tflops": fl_f / t_f / 1e9 if t_f else None, "fwd_bwd_tflops": fl_fb / t_fb / 1e9 if t_fb else None,
         **extra}
    RESULTS["rows"].append(r)
    log(f"{workload:14} {method:18} fwd {t_f:8.3f} ms ({r['fwd_tflops']:5.0f} TF/s)  fwd+bwd {t_fb:8.3f} ms "
        f"({r['fwd_bwd_tflops']:5.0f} TF/s)")
    return r


def guarded(name, fn):
    try:
        return fn()
    except Exception as exc:  # a failing baseline is reported, not fatal
        log(f"{name}: FAILED {type(exc).__name__}: {exc}"[:500])
        RESULTS["rows"].append({"workload": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
        torch.cuda.empty_cache()
        return None


def self_attention(name, lens, activations, baselines=True):
    w = Workload(name, lens)
    fl_f, fl_fb = 2 * H * D * w.sum_l2, 7 * H * D * w.sum_l2
    norm = float(w.Lmax)
    res = {}
    for act in activations:
        fn = lambda act=act: gdpa_triton(w.q, w.k, w.v, w.offsets, causal=True, activation=act, norm=norm)  # noqa
        t_f, t_fb = timed(*autograd_pair(fn, w.leaves(), w.grad), w.leaves())
        res[act] = row(name, f"gdpa {act}", t_f, t_fb, fl_f, fl_fb)
    if not baselines:
        return res
    jfa = lambda: jfa_triton(w.q, w.k, w.v, w.offsets, causal=True)  # noqa: E731
    res["jfa"] = guarded(f"{name} jfa", lambda: row(name, "jfa softmax", *timed(*autograd_pair(jfa, w.leaves(), w.grad),
                                                                                   w.leaves()), fl_f, fl_fb))

    def eager():
        e = Eager(w.q, w.k, w.v, w.offsets, w.offsets, w.grad, True, "silu", norm)
        mine = gdpa_triton(w.q, w.k, w.v, w.offsets, causal=True, activation="silu", norm=norm)
        RESULTS["checks"][f"{name} gdpa vs eager out"] = err = rel(mine, e.output())
        log(f"{name}: gdpa silu vs eager padded, out rel err {err:.2e} (chunk {e.chunk} of {e.B})")
        return row(name, "eager padded silu", *timed(e.fwd, e.fwd_bwd, e.leaves), fl_f, fl_fb, chunk=e.chunk)

    if EAGER:
        res["eager"] = guarded(f"{name} eager", eager)
    w = None  # the workload's tensors go before the next one's
    torch.cuda.empty_cache()
    return res


def flex_cross(q, k, v, q_off, k_off):
    """The cross rows' baseline: compiled FlexAttention (softmax) with a per-user block mask, as a callable."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from gemzoo.api import seq_ids

    tq, tk = q.shape[0], k.shape[0]
    qd, kd = seq_ids(q_off, tq), seq_ids(k_off, tk)
    mask = create_block_mask(lambda b, h, i, j: qd[i] == kd[j], None, None, tq, tk, device="cuda", _compile=True)
    compiled = torch.compile(flex_attention, dynamic=False)
    heads_first = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
    return lambda: compiled(heads_first(q), heads_first(k), heads_first(v), block_mask=mask).squeeze(0).transpose(0, 1)


def check_cross(name, q, k, v, q_off, k_off, grad, norm):
    """Checked before any timing, also under --no-eager: the split plan against the unsplit kernel (out, dq, dk,
    dv), and jfa softmax against Flex's output, on the workload's own tensors. The eager padded reference adds
    its own checks when it runs."""
    from gemzoo_jfa.family import KernelOptions

    leaves = [q, k, v]
    plans = [outputs_and_grads(lambda s=s: gdpa_triton(q, k, v, q_off, k_off, causal=False, activation="silu",
                                                         norm=norm, options=KernelOptions(split=s)), leaves, grad)
             for s in (None, 0)]
    for n, a, b in zip(("out", "dq", "dk", "dv"), *plans, strict=True):
        RESULTS["checks"][f"{name} split vs unsplit {n}"] = rel(a, b)
    with torch.no_grad():
        RESULTS["checks"][f"{name} jfa vs flex out"] = rel(jfa_triton(q, k, v, q_off, k_off, causal=False),
                                                             flex_cross(q, k, v, q_off, k_off)())
    log(f"{name} checks: " + ", ".join(f"{k.split(' ', 1)[1]} {v:.1e}" for k, v in RESULTS["checks"].items()
                                      if k.startswith(name + " ")))


def cross_attention(n_cand=64):
    hist = gem_lognormal()
    B = hist.numel()
    cand = torch.full((B,), n_cand)
    q_off, k_off = lengths_to_offsets(cand).cuda(), lengths_to_offsets(hist).cuda()
    tq, tk = int(cand.sum()), int(hist.sum())
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(tq, H, D, device="cuda", dtype=DTYPE, generator=gen).requires_grad_()
    k, v = (torch.randn(tk, H, D, device="cuda", dtype=DTYPE, generator=gen).requires_grad_() for _ in range(2))
    grad = torch.randn(tq, H, D, device="cuda", dtype=DTYPE, generator=gen)
    leaves = [q, k, v]
    pairs = n_cand * tk
    fl_f, fl_fb = 4 * H * D * pairs, 14 * H * D * pairs
    name = f"cross{n_cand}"
    norm = float(hist.max())
    info = {"B": B, "Tq": tq, "Tk": tk, "Lk_max": int(hist.max())}
    RESULTS.setdefault("cross_workloads", {})[name] = info
    log(f"{name}: {info}")
    res = {}
    from gemzoo_jfa.family import KernelOptions

    check_cross(name, q, k, v, q_off, k_off, grad, norm)

    def measure(key, method, fn, graphs=GRAPHS):
        """``fn`` timed as eager calls, then (--graphs) as CUDA-graph replays, the same callable both ways."""
        res[key] = row(name, method, *timed(*autograd_pair(fn, leaves, grad), leaves), fl_f, fl_fb)
        if graphs:  # kernel time: the host taken out
            res[f"{key} graph"] = guarded(f"{name} {method} (graph)", lambda: row(
                name, f"{method} (graph)", *bench_graphed(fn, leaves, grad), fl_f, fl_fb))
        return res[key]

    for tag, split in (("gdpa silu", None), ("gdpa silu unsplit", 0)):
        options = KernelOptions(split=split)
        fn = lambda options=options: gdpa_triton(  # noqa: E731
            q, k, v, q_off, k_off, causal=False, activation="silu", norm=norm, options=options)
        measure(tag, tag, fn, graphs=GRAPHS and split is None)
    # the softmax kernel of the same family on the same mask, and Flex (its block mask built once)
    res["jfa"] = guarded(f"{name} jfa", lambda: measure("jfa", "jfa softmax", lambda: jfa_triton(
        q, k, v, q_off, k_off, causal=False)))
    res["flex"] = guarded(f"{name} flex", lambda: measure("flex", "flex softmax", flex_cross(q, k, v, q_off, k_off)))

    def eager():
        e = Eager(q, k, v, q_off, k_off, grad, False, "silu", norm)
        mine = gdpa_triton(q, k, v, q_off, k_off, causal=False, activation="silu", norm=norm)
        RESULTS["checks"][f"{name} gdpa vs eager out"] = rel(mine, e.output())
        for t in leaves:
            t.grad = None
        mine.backward(grad)
        mine_g = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        e.fwd_bwd()
        theirs = [padded_to_jagged(g.transpose(1, 2), off) for g, off in zip((x.grad for x in e.leaves),
                                                                              (q_off, k_off, k_off), strict=False)]
        for n, a, b in zip(("dq", "dk", "dv"), mine_g, theirs, strict=True):
            RESULTS["checks"][f"{name} gdpa vs eager {n}"] = rel(a, b)
        for t in e.leaves:
            t.grad = None
        log(f"{name} checks: " + ", ".join(f"{k.split()[-1]} {v:.1e}" for k, v in RESULTS["checks"].items()
                                          if k.startswith(name)))
        return row(name, "eager padded silu", *timed(e.fwd, e.fwd_bwd, e.leaves), fl_f, fl_fb, chunk=e.chunk)

    if EAGER:
        res["eager"] = guarded(f"{name} eager", eager)
    return res


def table():
    lines = ["", f"gdpa benchmark on {RESULTS['device']} (H={H}, D={D}, bf16; median ms of do_bench)",
             f"{'workload':14} {'method':20} {'fwd ms':>9} {'TF/s':>5} {'f+b ms':>9} {'TF/s':>5}"]
    for r in RESULTS["rows"]:
        if "error" in r:
            lines.append(f"{r['workload']:14} ERROR {r['error'][:80]}")
            continue
        lines.append(f"{r['workload']:14} {r['method']:20} {r['fwd_ms']:9.3f} {r['fwd_tflops']:5.0f} "
                     f"{r['fwd_bwd_ms']:9.3f} {r['fwd_bwd_tflops']:5.0f}")
    lines.append("")
    lines.append("targets:")
    for t in RESULTS.get("targets", []):
        lines.append(f"  {'MET ' if t['met'] else 'MISS'} {t['what']}: {t['value']:.2f} (target {t['target']})")
    return "\n".join(lines)


def targets(res):
    out = []

    def add(what, value, target, ok):
        out.append({"what": what, "value": value, "target": target, "met": bool(ok)})

    for wl in ("gem_lognormal", "uniform_8k"):
        r = res.get(wl, {})
        g = r.get("silu")
        if g and r.get("jfa"):
            x = g["fwd_bwd_tflops"] / r["jfa"]["fwd_bwd_tflops"]
            add(f"{wl} silu fwd+bwd vs jfa softmax", x, ">= 1.2x", x >= 1.2)
        if g and r.get("eager"):
            x = r["eager"]["fwd_bwd_ms"] / g["fwd_bwd_ms"]
            add(f"{wl} silu fwd+bwd vs eager padded", x, ">= 10x", x >= 10)
        if g:
            add(f"{wl} silu fwd useful TFLOP/s", g["fwd_tflops"], ">= 450", g["fwd_tflops"] >= 450)
    r = res.get("gem_lognormal", {})
    for act in ACTIVATIONS:
        if act not in ("softmax", "silu") and r.get(act) and r.get("silu"):
            x = r[act]["fwd_bwd_ms"] / r["silu"]["fwd_bwd_ms"]
            add(f"gem_lognormal {act} fwd+bwd time / silu", x, "<= 1.15", x <= 1.15)
    for name, c in res.get("cross", {}).items():
        g = c.get("gdpa silu")
        if g and c.get("flex"):
            x = c["flex"]["fwd_bwd_ms"] / g["fwd_bwd_ms"]
            add(f"{name} fwd+bwd vs flex", x, ">= 3x", x >= 3)
        g, f = c.get("gdpa silu graph"), c.get("flex graph")
        if g and f:
            x = f["fwd_bwd_ms"] / g["fwd_bwd_ms"]
            add(f"{name} fwd+bwd vs flex, CUDA graphs", x, ">= 3x", x >= 3)
        if g and c.get("jfa graph"):
            x = c["jfa graph"]["fwd_bwd_ms"] / g["fwd_bwd_ms"]
            add(f"{name} fwd+bwd vs jfa softmax, CUDA graphs", x, ">= 1.5x", x >= 1.5)
        if g and c.get("jfa"):
            x = c["jfa"]["fwd_bwd_ms"] / g["fwd_bwd_ms"]
            add(f"{name} fwd+bwd vs jfa softmax", x, ">= 1.5x", x >= 1.5)
    s = res.get("short", {})
    if s.get("silu") and s.get("jfa"):
        x = s["jfa"]["fwd_bwd_ms"] / s["silu"]["fwd_bwd_ms"]
        add("short silu fwd+bwd vs jfa softmax", x, ">= 1.0x", x >= 1.0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out", help="folder for bench_gdpa.json")
    ap.add_argument("--only", default="self,acts,cross,short",
                    help="comma-separated subset of self (gem_lognormal and uniform_8k), self1 (gem_lognormal only), "
                         "acts, cross, short")
    ap.add_argument("--acts", default="", help="comma-separated activations for the acts rows (default: all)")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager padded baselines")
    ap.add_argument("--graphs", action="store_true",
                    help="also time the cross rows (gdpa, jfa, Flex) as CUDA-graph replays: kernels without the host")
    ap.add_argument("--candidates", default="16,64,256",
                    help="comma-separated candidates per user for the cross rows (default 16,64,256)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gdpa needs a CUDA device")
    import triton

    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    RESULTS["command"] = " ".join(sys.argv)
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    only = set(args.only.split(","))
    global EAGER, GRAPHS
    EAGER, GRAPHS = not args.no_eager, args.graphs
    t0 = time.time()
    res = {}

    def save():
        RESULTS["targets"] = targets(res)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_gdpa.json"), "w") as f:
                json.dump(RESULTS, f, indent=1)
            with open(os.path.join(args.out, "table_gdpa.txt"), "w") as f:
                f.write(table() + "\n")
        log(f"[{time.time() - t0:.0f}s]")

    # priority order (a run cut short keeps the first rows): silu self-attention with its baselines, cross,
    # short, then the other activations against the silu figure of this same run
    if "self" in only or "self1" in only:
        res["gem_lognormal"] = guarded("gem_lognormal",
                                       lambda: self_attention("gem_lognormal", gem_lognormal(), ["silu"])) or {}
        save()
    if "self" in only:
        res["uniform_8k"] = guarded("uniform_8k", lambda: self_attention("uniform_8k", uniform_8k(), ["silu"])) or {}
        save()
    if "cross" in only:
        for n_cand in (int(c) for c in args.candidates.split(",")):
            res.setdefault("cross", {})[f"cross{n_cand}"] = guarded(f"cross{n_cand}",
                                                                  lambda n=n_cand: cross_attention(n)) or {}
            save()
    if "short" in only:
        res["short"] = guarded("short", lambda: self_attention("short", short_lengths(), ["silu"])) or {}
        save()
    if "acts" in only:
        others = args.acts.split(",") if args.acts else [a for a in ACTIVATIONS if a not in ("softmax", "silu")]
        acts = others if "silu" in res.get("gem_lognormal", {}) else ["silu"] + others
        res.setdefault("gem_lognormal", {}).update(self_attention("gem_lognormal", gem_lognormal(), acts,
                                                                  baselines=False))
        save()
    print(table(), flush=True)


if __name__ == "__main__":
    main()
