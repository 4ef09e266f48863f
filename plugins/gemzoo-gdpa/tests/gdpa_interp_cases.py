"""Run gdpa's Triton path under TRITON_INTERPRET=1 on tiny shapes; print one JSON line of results.

Run as a subprocess by test_interpreter.py, so the variable is set before Triton is first imported.
Every case launches into NaN-poisoned outputs and gradients (unwritten elements fail) and compares
forward and dq/dk/dv against the fp64 reference.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a script run: switch the interpreter on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from gemzoo.api import (  # noqa: E402
    ACTIVATION_CODES,
    ACTIVATIONS,
    lengths_to_offsets,  # noqa: E402
    reference_attention,
)

POINTWISE = [a for a in ACTIVATIONS if a != "softmax"]
Q4, K4 = [5, 0, 37, 16], [9, 4, 20, 40]

# name -> (activation, q lengths, k lengths or None, causal, window, norm, D, Dv, dtype, split)
CASES = {f"act-{a}": (a, Q4, None, True, None, 16.0, 16, 16, "float32", 0) for a in POINTWISE}
CASES.update({
    "silu-full-nonorm": ("silu", Q4, None, False, None, None, 16, 16, "float32", 0),
    "silu-asym-causal": ("silu", Q4, K4, True, None, 8.0, 16, 16, "float32", 0),
    "gelu-asym-full": ("gelu", Q4, K4, False, None, None, 16, 16, "float32", 0),
    "relu2-lk<lq-causal": ("relu2", [30, 17], [3, 17], True, None, 4.0, 16, 16, "float32", 0),
    "hardswish-lk<lq-full": ("hardswish", [30, 17], [3, 17], False, None, None, 16, 16, "float32", 0),
    "silu-window": ("silu", Q4, None, True, 7, 16.0, 16, 16, "float32", 0),
    "leaky-asym-window": ("leaky_relu", Q4, K4, True, 5, None, 16, 16, "float32", 0),
    "identity-full-window-emptyk": ("identity", [5, 3, 37, 16], [0, 4, 20, 40], False, 9, 3.0, 16, 16, "float32", 0),
    "silu-emptyq-both": ("silu", [0, 6, 0], [4, 0, 0], False, None, None, 16, 16, "float32", 0),
    "silu-d24-dv40": ("silu", [21, 0, 9], None, True, None, 2.0, 24, 40, "float32", 0),
    "silu-bf16": ("silu", [33, 0, 20], None, True, None, 16.0, 16, 16, "bfloat16", 0),
    "gelu_tanh-fp16": ("gelu_tanh", [33, 20, 0], None, False, None, 8.0, 16, 16, "float16", 0),
    # split-K (short Q over long K): forced split counts (some splits empty), causal/full/window, bf16
    "split-silu-cross": ("silu", [3, 0, 8, 5], [70, 9, 0, 45], False, None, None, 16, 16, "float32", 4),
    "split-gelu-causal": ("gelu", [3, 0, 8, 5], [70, 9, 0, 45], True, None, 4.0, 16, 16, "float32", 3),
    "split-relu-window": ("relu", [3, 0, 20, 5], [70, 9, 0, 45], True, 19, None, 16, 24, "float32", 8),
    "split-silu-bf16": ("silu", [3, 0, 8, 5], [70, 9, 0, 45], False, None, 2.0, 16, 16, "bfloat16", 2),
})
# Grouped k/v (GQA 4 over 2 and 6 over 3, MQA 4 over 1), head dims 256 and 50, the split-K path and the
# relative bias: name -> grouped_query_errors keywords
GQA_CASES = {
    "gqa4x2-silu-causal": dict(q_lens=Q4, activation="silu", norm=16.0),
    "mqa4x1-gelu-asym-full": dict(q_lens=Q4, k_lens=K4, kv_heads=1, activation="gelu", causal=False),
    "gqa6x3-relu-window": dict(q_lens=Q4, k_lens=K4, heads=6, kv_heads=3, activation="relu", window=5, norm=8.0),
    "gqa4x2-silu-d256": dict(q_lens=[5, 0, 20], head_dim=256, activation="silu"),
    "mqa4x1-silu-d50": dict(q_lens=Q4, kv_heads=1, head_dim=50, activation="silu", norm=16.0),
    "mqa4x1-split-silu-cross": dict(q_lens=[3, 0, 8, 5], k_lens=[70, 9, 0, 45], kv_heads=1, activation="silu",
                                    causal=False, options="split"),
    "gqa4x2-silu-relative-bias": dict(q_lens=Q4, activation="silu", norm=16.0, relative_bias=True),
}
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def run_poisoned(q, k, v, q_off, k_off, causal, window, grad, code, scale, inv_norm, options):
    """Launch fwd and bwd into NaN-filled buffers; return out, dq, dk, dv."""
    from gemzoo_jfa.family import launch_bwd, launch_fwd

    win = -1 if window is None else window
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
    if q.shape[0]:
        launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, None, code, inv_norm, options=options)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    launch_bwd(grad, q, k, v, None, None, q_off, k_off, causal, scale, win, dq, dk, dv, code, inv_norm,
               options=options)
    return out, dq, dk, dv


def run_case(act, q_lens, k_lens, causal, window, norm, d, dv, dtype, split, tma=False, fused_dq=False):
    from gemzoo_jfa.family import KernelOptions

    gen = torch.Generator().manual_seed(abs(hash((act, tuple(q_lens), causal, window, d, split))) % 2**31)
    q_lens = torch.tensor(q_lens)
    k_lens = q_lens if k_lens is None else torch.tensor(k_lens)
    q_off, k_off = lengths_to_offsets(q_lens), lengths_to_offsets(k_lens)
    h, dt = 2, getattr(torch, dtype)
    tq, tk = int(q_lens.sum()), int(k_lens.sum())
    q = torch.randn(tq, h, d, generator=gen).to(dt)
    k = torch.randn(tk, h, d, generator=gen).to(dt)
    v = torch.randn(tk, h, dv, generator=gen).to(dt)
    grad = torch.randn(tq, h, dv, generator=gen).to(dt)
    scale = d ** -0.5 * 2.0  # larger scores: every activation's nonlinear part is exercised
    got = run_poisoned(q, k, v, q_off, k_off, causal, window, grad, ACTIVATION_CODES[act], scale,
                       1.0 if norm is None else 1.0 / norm, KernelOptions(split=split, tma=tma, fused_dq=fused_dq))
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off, k_off, causal=causal, window=window, activation=act, scale=scale,
                              norm=norm)
    if ref.requires_grad:
        ref.backward(grad.double())
    ref_grads = tuple(torch.zeros_like(r) if r.grad is None else r.grad for r in refs)  # no pair: zero grads
    res = {}
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), got, (ref.detach(),) + ref_grads, strict=True):
        res[name] = float((mine.double() - theirs).abs().max()) if theirs.norm() == 0 else _rel(mine, theirs)
        res[name + "_finite"] = bool(torch.isfinite(mine).all())
    res["tol"] = TOL[dtype]
    return res


def nan_confined():
    """NaN in one sequence's q, k and v stays in that sequence (outputs and all gradients), for the plain,
    split-K and TMA paths."""
    from gemzoo_gdpa import gdpa_triton
    from gemzoo_jfa.family import KernelOptions

    res = {}
    for tag, ctx, causal in (("plain", dict(split=0), True), ("split", dict(split=4), False),
                             ("tma", dict(split=0, tma=True), True)):
        q_lens, k_lens = torch.tensor([5, 16, 21]), torch.tensor([16, 40, 16])
        q_off, k_off = lengths_to_offsets(q_lens), lengths_to_offsets(k_lens)
        gen = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(int(n), 2, 16, generator=gen) for n in (q_lens.sum(), k_lens.sum(), k_lens.sum()))
        q[7, 0, 3] = k[20, 1, 0] = v[30, 0, 5] = float("nan")  # all inside sequence 1
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = gdpa_triton(*leaves, q_off, k_off, causal=causal, activation="silu", options=KernelOptions(**ctx))
        out.backward(torch.ones_like(out))
        qs, ks = slice(5, 21), slice(16, 56)
        others_q = torch.cat([out[:5], out[21:]]), torch.cat([q.grad[:5], q.grad[21:]])
        others_k = torch.cat([k.grad[:16], k.grad[56:]]), torch.cat([v.grad[:16], v.grad[56:]])
        res[tag] = {"others_finite": bool(all(torch.isfinite(t).all() for t in others_q + others_k)),
                    "own_nan": bool(torch.isnan(out[qs]).any() and torch.isnan(k.grad[ks]).any())}
    return res


def strided_offsets():
    """Offsets that are a strided view (t[::2]) give the same result as contiguous ones (jfa and gdpa)."""
    from gemzoo_gdpa import gdpa_triton
    from gemzoo_jfa import jfa_triton

    lens = torch.tensor([7, 0, 19, 4])
    off = lengths_to_offsets(lens)
    strided = torch.stack([off, torch.full_like(off, 10**6)], 1).reshape(-1)[::2]
    assert not strided.is_contiguous() and torch.equal(strided, off)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(30, 2, 16, generator=gen) for _ in range(3))
    res = {}
    for name, fn, act in (("jfa", jfa_triton, "softmax"), ("gdpa", gdpa_triton, "silu")):
        ref = reference_attention(q.double(), k.double(), v.double(), off, activation=act)
        res[name] = {"contiguous": _rel(fn(q, k, v, off, activation=act), ref),
                     "strided": _rel(fn(q, k, v, strided, strided, activation=act), ref)}
    return res


def conformance():
    """The shared gemzoo conformance suite, run on the Triton path itself (CPU tensors, interpreter)."""
    from gemzoo_gdpa import gdpa_triton
    from gemzoo_gdpa.ops import KERNEL

    from gemzoo.testing.interpreter import conformance_results

    return conformance_results(gdpa_triton, KERNEL.capabilities)


def compile_check():
    """torch.compile(fullgraph=True) traces the custom op (fake impl + autograd), then runs it; opcheck."""
    from gemzoo_gdpa import gdpa_triton
    from gemzoo_gdpa.ops import gdpa_fwd

    from gemzoo.testing.interpreter import compiled_matches_eager

    off = lengths_to_offsets(torch.tensor([7, 0, 19]))
    q, k, v = (torch.randn(26, 2, 16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return gdpa_triton(q, k, v, off, causal=True, activation="silu", norm=19.0).square().sum()

    same = compiled_matches_eager(f, q, k, v)
    torch.library.opcheck(gdpa_fwd, (q, k, v, off, off, True, 1, 0.25, 0.5, -1, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    return {"compile": same, "opcheck": True}


def all_cases() -> dict:
    res = {name: run_case(*args) for name, args in CASES.items()}
    res["tma-silu-asym-window"] = run_case("silu", Q4, K4, True, 5, 4.0, 16, 16, "float32", 0, tma=True)
    res["tma-gelu-full-bf16"] = run_case("gelu", [21, 0, 40], [33, 7, 18], False, None, None, 16, 16,
                                         "bfloat16", 0, tma=True)
    # dQ inside the dk/dv kernel (fp32 atomics), with the forward's split-K path beside it
    res["fused-dq-silu-asym-window"] = run_case("silu", Q4, K4, True, 5, 4.0, 16, 16, "float32", 0, fused_dq=True)
    res["fused-dq-split-gelu-cross"] = run_case("gelu", [3, 0, 8, 5], [70, 9, 0, 45], False, None, None, 16, 16,
                                                "float32", 4, fused_dq=True)
    return res


def gqa_cases() -> dict:
    """GQA_CASES through gdpa_triton (``options``: a KernelOptions for it only), against the fp64 reference."""
    from gemzoo_gdpa.ops import gdpa_triton
    from gemzoo_jfa.family import KernelOptions

    from gemzoo.testing.attention import grouped_query_errors

    out = {}
    for name, kw in GQA_CASES.items():
        kw = dict(kw)
        split = kw.pop("options", None) == "split"  # forced key splits (the short-Q/long-K path)
        out[name] = grouped_query_errors(gdpa_triton, options=KernelOptions(split=4) if split else None, **kw)
    return out


def main(which: str) -> None:
    from gemzoo.testing.interpreter import print_group

    print_group({"cases": all_cases, "conformance": conformance, "gqa": gqa_cases,
                 "misc": lambda: {"nan": nan_confined(), "strided": strided_offsets(), "compile": compile_check()}},
                which)


if __name__ == "__main__":
    main(sys.argv[1])
