"""GPU checks (skipped without CUDA): random jagged inputs with empty sequences and partial last blocks against
the fp64 reference, outputs and gradients poisoned with NaN first so unwritten elements fail; the shared
conformance suite on CUDA; fused RoPE against RoPE applied in torch; a long sequence; torch.compile."""

from __future__ import annotations

import pytest
import torch

from gemzoo.api import ACTIVATION_CODES, lengths_to_offsets, reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 1e-2, torch.float32: 5e-3}


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-3 * max(b.numel(), 1) ** 0.5))


def run_poisoned(q, k, v, q_off, k_off, grad, *, causal, window, block, rope, act, norm):
    from gemzoo_block_attention.ops import block_options
    from gemzoo_jfa.family import launch_bwd, launch_fwd

    code, inv_norm = ACTIVATION_CODES[act], 1.0 if norm is None else 1.0 / norm
    win, blk, theta, scale = -1 if window is None else window, -1 if block is None else block, rope or 0.0, None
    scale = q.shape[-1] ** -0.5
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), device=q.device, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device) if code == 0 else None
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    options = block_options(q, blk)
    launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, lse, code, inv_norm, blk, theta, options)
    launch_bwd(grad, q, k, v, out, lse, q_off, k_off, causal, scale, win, dq, dk, dv, code, inv_norm, blk, theta,
               options)
    return out, dq, dk, dv


CASES = {  # name -> (block, window, rope_theta, causal, k mode, activation, norm, D, dtype)
    "b64-causal": (64, None, None, True, "same", "softmax", None, 128, torch.bfloat16),
    "b64-causal-rope": (64, None, 10000.0, True, "same", "softmax", None, 128, torch.bfloat16),
    "b64-win100-rope": (64, 100, 10000.0, True, "same", "softmax", None, 128, torch.bfloat16),
    "b7-full-asym": (7, None, None, False, "longer", "softmax", None, 64, torch.bfloat16),
    "b128-causal-asym-rope": (128, None, 500.0, True, "longer", "softmax", None, 128, torch.float16),
    "b1-causal": (1, None, None, True, "same", "softmax", None, 64, torch.bfloat16),
    "b64-silu-rope": (64, None, 10000.0, True, "same", "silu", 300.0, 128, torch.bfloat16),
    "b32-fp32-rope": (32, 50, 10000.0, False, "same", "softmax", None, 64, torch.float32),
    "b64-d96-rope": (64, None, 10000.0, True, "same", "softmax", None, 96, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_poisoned_against_reference(name):
    block, window, rope, causal, k_mode, act, norm, d, dtype = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    q_lens = torch.randint(1, 400, (9,), generator=gen)
    q_lens[[1, 5]] = 0
    k_lens = q_lens + torch.randint(0, 90, (9,), generator=gen) if k_mode == "longer" else q_lens
    q_off, k_off = lengths_to_offsets(q_lens).cuda(), lengths_to_offsets(k_lens).cuda()
    tq, tk, h = int(q_lens.sum()), int(k_lens.sum()), 4
    q, k, v = (torch.randn(n, h, d, generator=gen).to("cuda", dtype) for n in (tq, tk, tk))
    grad = torch.randn(tq, h, d, generator=gen).to("cuda", dtype)
    got = run_poisoned(q, k, v, q_off, k_off, grad, causal=causal, window=window, block=block, rope=rope, act=act,
                       norm=norm)
    refs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off.cpu(), k_off.cpu(), causal=causal, window=window, block_size=block,
                              rope_theta=rope, activation=act, norm=norm)
    ref.backward(grad.double().cpu())
    wants = (ref.detach(),) + tuple(r.grad for r in refs)
    for what, mine, theirs in zip(("out", "dq", "dk", "dv"), got, wants, strict=True):
        assert torch.isfinite(mine).all(), f"{name}: {what} has NaN/Inf (unwritten elements stay NaN)"
        err = _rel(mine, theirs)
        assert err <= TOL[dtype], f"{name}: {what} relative error {err:.2e}"


def test_conformance_on_cuda():
    from gemzoo_block_attention.ops import KERNEL

    from gemzoo.testing import attention_cases, check_attention

    for case in attention_cases(KERNEL.capabilities, quick=True):
        check_attention(KERNEL, case, device="cuda", dtype=torch.bfloat16)


def test_fused_rope_equals_rope_in_torch():
    from gemzoo_block_attention import block_attention_triton
    from gemzoo_block_attention.ops import rope_jagged

    gen = torch.Generator().manual_seed(3)
    off = lengths_to_offsets(torch.tensor([3000, 0, 700, 64, 65])).cuda()
    q, k, v = (torch.randn(3829, 4, 128, generator=gen).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3))
    fused = block_attention_triton(q, k, v, off, block_size=64, rope_theta=10000.0)
    fused.float().square().sum().backward()
    g_fused = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    qr, kr = rope_jagged(q, k, off, off, 10000.0)
    plain = block_attention_triton(qr, kr, v, off, block_size=64)
    plain.float().square().sum().backward()
    assert _rel(fused, plain) < 1e-2
    for a, t in zip(g_fused, (q, k, v), strict=True):
        assert _rel(a, t.grad) < 2e-2


def test_long_sequence_blocks_vs_per_block_reference():
    """One 20,000-token sequence (positions past 16K for RoPE) against the reference run block by block."""
    from gemzoo_block_attention import block_attention_triton

    from gemzoo.api import apply_rope

    n, bs = 20000, 64
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 2, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    off = lengths_to_offsets(torch.tensor([n])).cuda()
    out = block_attention_triton(q, k, v, off, block_size=bs, rope_theta=10000.0)
    pos = torch.arange(n, device="cuda")
    qr, kr = apply_rope(q.double(), pos, 10000.0), apply_rope(k.double(), pos, 10000.0)
    nb = -(-n // bs)
    pad = nb * bs - n
    qb, kb, vb = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)).view(nb, bs, 2, 128).transpose(1, 2)
                  for t in (qr, kr, v.double()))
    s = qb @ kb.transpose(-1, -2) * 128 ** -0.5
    causal = torch.ones(bs, bs, dtype=torch.bool, device="cuda").tril()
    valid = (torch.arange(nb * bs, device="cuda") < n).view(nb, 1, 1, bs)
    ref = torch.softmax(s.masked_fill(~(causal & valid), float("-inf")), -1) @ vb
    ref = ref.transpose(1, 2).reshape(nb * bs, 2, 128)[:n]
    assert _rel(out, ref) < 1e-2


def test_torch_compile_fullgraph():
    from gemzoo_block_attention import block_attention_triton

    off = lengths_to_offsets(torch.tensor([700, 0, 129])).cuda()
    q, k, v = (torch.randn(829, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return block_attention_triton(q, k, v, off, block_size=64, window=100, rope_theta=10000.0).float().sum()

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.allclose(eager, compiled, rtol=1e-3, atol=1e-2)


# Grouped k/v (GQA, MQA) on the GPU paths (TMA, buckets, fused dQ where they apply), against the fp64 reference
LONG_Q, LONG_K = [300, 0, 17, 129, 64, 1], [280, 5, 40, 129, 10, 0]
SHORT_Q = [5, 0, 37, 16, 3, 20, 64, 1] * 4  # a short batch: length buckets
GQA_GPU_CASES = {
    "gqa8x2-block64-d128-bf16": dict(q_lens=LONG_Q, heads=8, kv_heads=2, head_dim=128, block_size=64, dtype=torch.bfloat16),
    "mqa8x1-block32-silu-asym-bf16": dict(q_lens=LONG_Q, k_lens=LONG_K, heads=8, kv_heads=1, head_dim=64,
                                          block_size=32, activation="silu", norm=64.0, causal=False, dtype=torch.bfloat16),
    "gqa4x2-block64-window-rope-d256-bf16": dict(q_lens=LONG_Q, head_dim=256, block_size=64, window=40,
                                                 rope_theta=10000.0, dtype=torch.bfloat16),
    "gqa6x3-block16-rope-d50-fp32": dict(q_lens=LONG_Q, heads=6, kv_heads=3, head_dim=50, block_size=16,
                                         rope_theta=500.0, dtype=torch.float32),
}


@pytest.mark.parametrize("name", list(GQA_GPU_CASES))
def test_grouped_query_against_fp64_reference(name):
    from gemzoo_block_attention.ops import block_attention_triton

    from gemzoo.testing.attention import assert_errors_within, grouped_query_errors

    kw = dict(GQA_GPU_CASES[name])
    dtype = kw.pop("dtype")
    errors = grouped_query_errors(block_attention_triton, device="cuda", dtype=dtype, **kw)
    assert_errors_within(errors, TOL[dtype], name)


def test_cuda_graph_replays_new_lengths():
    """Block attention (forward and backward) recorded in a CUDA graph and replayed on new lengths in the same
    buffers: its block-narrowed schedules are rebuilt inside the graph."""
    from gemzoo_block_attention import block_attention_triton

    from gemzoo.testing.attention import assert_errors_within, cuda_graph_errors

    errors = cuda_graph_errors(block_attention_triton, block_size=64, max_len=600)
    assert_errors_within(errors, 1.5e-2, "block-attention under a CUDA graph")
