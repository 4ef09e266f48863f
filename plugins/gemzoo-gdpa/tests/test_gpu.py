"""GPU checks (skipped without CUDA): random jagged inputs with empty sequences against an fp64 reference,
outputs and gradients poisoned with NaN first so unwritten elements fail; the shared conformance suite on
CUDA; the split-K cross-attention path; NaN confinement; torch.compile."""

from __future__ import annotations

import pytest
import torch
from gemzoo_jfa.family import DEFAULT_OPTIONS, KernelOptions, launch_bwd, launch_fwd

from gemzoo.api import ACTIVATION_CODES, ACTIVATIONS, lengths_to_offsets, reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

POINTWISE = [a for a in ACTIVATIONS if a != "softmax"]
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 5e-3}


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def _lengths(gen, batch, max_len):
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[torch.rand(batch, generator=gen) < 0.2] = 0
    lens[1] = 0
    return lens


def run_poisoned(q, k, v, q_off, k_off, causal, window, grad, act, scale, norm, options=DEFAULT_OPTIONS):
    win = -1 if window is None else window
    code, inv_norm = ACTIVATION_CODES[act], 1.0 if norm is None else 1.0 / norm
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), device=q.device, dtype=q.dtype)
    launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, None, code, inv_norm, options=options)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    launch_bwd(grad, q, k, v, None, None, q_off, k_off, causal, scale, win, dq, dk, dv, code, inv_norm,
               options=options)
    return out, dq, dk, dv


def check(d, dv_dim, causal, k_mode, window, dtype, act, norm, split=None, batch=9, max_q=300):
    gen = torch.Generator().manual_seed(d * 7 + causal + (window or 0) + len(act))
    heads = 4  # as the bench: the same compiled variants
    q_lens = _lengths(gen, batch, max_q)
    if k_mode == "same":
        k_lens = q_lens
    elif k_mode == "longer":
        k_lens = q_lens + torch.randint(0, 90, (batch,), generator=gen)
        k_lens[2] = 0  # queries with no keys at all: output 0
    else:  # "history": short q, long k (the cross-attention path)
        k_lens = torch.randint(1, 3000, (batch,), generator=gen)
        k_lens[3] = 0
    q_off, k_off = lengths_to_offsets(q_lens).cuda(), lengths_to_offsets(k_lens).cuda()
    tq, tk = int(q_lens.sum()), int(k_lens.sum())
    q = torch.randn(tq, heads, d, generator=gen).to("cuda", dtype)
    k = torch.randn(tk, heads, d, generator=gen).to("cuda", dtype)
    v = torch.randn(tk, heads, dv_dim, generator=gen).to("cuda", dtype)
    grad = torch.randn(tq, heads, dv_dim, generator=gen).to("cuda", dtype)
    scale = d ** -0.5
    got = run_poisoned(q, k, v, q_off, k_off, causal, window, grad, act, scale, norm, KernelOptions(split=split))
    torch.cuda.synchronize()
    for name, t in zip(("out", "dq", "dk", "dv"), got, strict=True):
        assert torch.isfinite(t).all(), f"{name} has unwritten (NaN) or non-finite elements"
    refs = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off.cpu(), k_off.cpu(), causal=causal, window=window, activation=act,
                              scale=scale, norm=norm)
    ref.backward(grad.double().cpu())
    errs = {n: _rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(),) + tuple(
        r.grad for r in refs), strict=False)}
    assert all(e < TOL[dtype] for e in errs.values()), errs


CASES = [
    # (head dim, value dim, causal, keys, window, dtype)
    (128, 128, True, "same", None, torch.bfloat16),
    (128, 128, False, "same", None, torch.bfloat16),
    (64, 64, True, "longer", None, torch.bfloat16),
    (256, 256, True, "same", None, torch.bfloat16),
    (128, 128, True, "same", 100, torch.bfloat16),
    (64, 96, True, "longer", 77, torch.float16),
    (128, 128, True, "same", None, torch.float32),
]


@pytest.mark.parametrize("d,dv,causal,keys,window,dtype", CASES)
def test_silu_against_fp64_reference_poisoned(d, dv, causal, keys, window, dtype):
    check(d, dv, causal, keys, window, dtype, "silu", 300.0)


@pytest.mark.parametrize("act", POINTWISE)
def test_every_activation_bf16(act):
    check(128, 128, True, "same", None, torch.bfloat16, act, None if act == "identity" else 64.0, batch=6)


@pytest.mark.parametrize("act,causal,split", [("silu", False, None), ("silu", False, 0), ("silu", False, 4),
                                              ("gelu", True, None), ("relu2", False, None)])
def test_cross_attention_short_q_long_k(act, causal, split):
    check(128, 128, causal, "history", None, torch.bfloat16, act, 32.0, split=split, batch=12, max_q=64)


def test_conformance_suite_on_cuda():
    from gemzoo_gdpa.ops import KERNEL

    from gemzoo.testing import attention_cases, check_attention

    for case in attention_cases(KERNEL.capabilities):  # every declared activation and option in bf16
        check_attention(KERNEL, case, device="cuda", dtype=torch.bfloat16)
    for case in attention_cases(KERNEL.capabilities):  # fp32 (declared too) on two of them
        if case.activation in ("silu", "gelu"):
            check_attention(KERNEL, case, device="cuda", dtype=torch.float32)


def test_nan_stays_in_its_sequence_cuda():
    from gemzoo_gdpa import gdpa_triton

    for causal, k_lens in ((True, [300, 200, 150]), (False, [3000, 4000, 2500])):
        q_lens = torch.tensor([300, 200, 150]) if causal else torch.tensor([64, 64, 64])
        k_lens = torch.tensor(k_lens)
        q_off, k_off = lengths_to_offsets(q_lens).cuda(), lengths_to_offsets(k_lens).cuda()
        q = torch.randn(int(q_lens.sum()), 4, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(int(k_lens.sum()), 4, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qs, ks = int(q_lens[0]) + 3, int(k_lens[0]) + 5  # inside sequence 1
        q[qs, 0, 1] = k[ks, 1, 2] = v[ks + 7, 0, 3] = float("nan")
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = gdpa_triton(*leaves, q_off, k_off, causal=causal, activation="silu")
        out.backward(torch.ones_like(out))
        a, b = int(q_lens[0]), int(q_lens[:2].sum())
        c, e = int(k_lens[0]), int(k_lens[:2].sum())
        for name, t, lo, hi in (("out", out, a, b), ("dq", q.grad, a, b), ("dk", k.grad, c, e),
                                ("dv", v.grad, c, e)):
            assert torch.isfinite(torch.cat([t[:lo], t[hi:]])).all(), f"NaN leaked into {name} of another sequence"
        assert torch.isnan(out[a:b]).any()


def test_registered_kernel_autograd_and_compile_on_cuda():
    from gemzoo_gdpa.ops import KERNEL

    from gemzoo.api import registry

    kernel = registry.get("attention", "gdpa") if "gdpa" in registry.names("attention") else KERNEL
    lens = torch.tensor([0, 129, 1, 0, 64, 300])
    off = lengths_to_offsets(lens).cuda()
    q, k, v = (torch.randn(int(lens.sum()), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def f(q, k, v):
        return kernel(q, k, v, off, activation="silu", norm=300.0).float().square().sum()

    f(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    refs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    reference_attention(*refs, off.cpu(), activation="silu", norm=300.0).square().sum().backward()
    for mine, theirs in zip(grads, refs, strict=True):
        assert _rel(mine, theirs.grad) < 2e-2
    for t in (q, k, v):
        t.grad = None
    torch.compile(f, fullgraph=True)(q, k, v).backward()
    for g, t in zip(grads, (q, k, v), strict=True):
        assert _rel(t.grad, g) < 1e-2


# Grouped k/v (GQA, MQA) on the GPU paths (TMA, buckets, fused dQ where they apply), against the fp64 reference
LONG_Q, LONG_K = [300, 0, 17, 129, 64, 1], [280, 5, 40, 129, 10, 0]
SHORT_Q = [5, 0, 37, 16, 3, 20, 64, 1] * 4  # a short batch: length buckets
GQA_GPU_CASES = {
    "gqa8x2-silu-d128-causal-bf16": dict(q_lens=LONG_Q, heads=8, kv_heads=2, head_dim=128, activation="silu",
                                         norm=256.0, dtype=torch.bfloat16),
    "mqa8x1-gelu-d64-asym-full-bf16": dict(q_lens=LONG_Q, k_lens=LONG_K, heads=8, kv_heads=1, head_dim=64,
                                           activation="gelu", causal=False, norm=256.0, dtype=torch.bfloat16),
    "gqa4x2-silu-d256-bf16": dict(q_lens=LONG_Q, head_dim=256, activation="silu", norm=256.0, dtype=torch.bfloat16),
    "gqa4x2-relu-d50-window-fp32": dict(q_lens=LONG_Q, head_dim=50, window=33, activation="relu", dtype=torch.float32),
    "mqa4x1-silu-cross-split-bf16": dict(q_lens=[3, 0, 8, 5] * 8, k_lens=[700, 9, 0, 450] * 8, kv_heads=1,
                                         head_dim=128, activation="silu", causal=False, norm=700.0, dtype=torch.bfloat16),
    "gqa4x2-silu-relative-bias-bf16": dict(q_lens=LONG_Q, head_dim=64, activation="silu", norm=256.0,
                                           relative_bias=True, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(GQA_GPU_CASES))
def test_grouped_query_against_fp64_reference(name):
    from gemzoo_gdpa.ops import gdpa_triton

    from gemzoo.testing.attention import assert_errors_within, grouped_query_errors

    kw = dict(GQA_GPU_CASES[name])
    dtype = kw.pop("dtype")
    errors = grouped_query_errors(gdpa_triton, device="cuda", dtype=dtype, **kw)
    assert_errors_within(errors, TOL[dtype], name)


@pytest.mark.parametrize("kw", [
    {"cross": True, "causal": False, "max_len": 900, "heads": 4, "kv_heads": 2},  # split-K forward
    {"causal": True, "max_len": 300},
], ids=["cross-split", "causal"])
def test_cuda_graph_replays_new_lengths(kw):
    """silu attention (forward and backward) recorded in a CUDA graph and replayed on new lengths in the same
    buffers; the cross case takes the split-K forward, whose plan and buffers are rebuilt inside the graph."""
    from gemzoo_gdpa import gdpa_triton

    from gemzoo.testing.attention import assert_errors_within, cuda_graph_errors

    errors = cuda_graph_errors(gdpa_triton, activation="silu", norm=float(kw["max_len"]), **kw)
    assert_errors_within(errors, 1e-2, f"gdpa under a CUDA graph {kw}")
