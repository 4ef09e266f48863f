"""GPU checks of the relative attention bias fused into the jfa family's kernels (skipped without CUDA): HSTU's
shapes (B=128, lengths up to 200, H=1-2, D=25/50/64) and a long-sequence batch, bf16 and fp32, against the
fp64 reference on the GPU (whose fp32 log is the kernels' libdevice log), every output and gradient
NaN-poisoned first; gdpa_triton's autograd and torch.compile(fullgraph) with the bias."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).parent))
from rb_cases import errors, make_inputs, reference, rel_err, run_family  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float32: 5e-3}  # fp32 tiles multiply in TF32


def _lengths(gen, batch, max_len):
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[torch.rand(batch, generator=gen) < 0.1] = 0
    lens[1] = 0
    return lens.tolist()


def _check(act, batch, max_len, heads, d, dtype, timed, causal=True, norm=None, window=None, n_pos=None,
           cross=False, fused_dq=False):
    from gemzoo_jfa.family import KernelOptions

    gen = torch.Generator().manual_seed(batch + max_len + heads * 7 + d + timed)
    q_lens = _lengths(gen, batch, max_len)
    k_lens = [n + int(torch.randint(0, 40, (1,), generator=gen)) for n in q_lens] if cross else None
    n_pos = max_len + 1 if n_pos is None else n_pos
    inputs = make_inputs(gen, q_lens, k_lens, heads, d, d, dtype, n_pos, 128, timed, device="cuda")
    scale = d ** -0.5
    got = run_family(*inputs, act, causal, window, scale, norm, KernelOptions(fused_dq=fused_dq))
    torch.cuda.synchronize()
    errs = errors(got, reference(*inputs, act, causal, window, scale, norm))
    bad = {k: v for k, v in errs.items() if (k.endswith("_finite") or k.endswith("_none")) and not v}
    assert not bad, f"unwritten (NaN) or non-finite outputs: {bad}"
    over = {k: v for k, v in errs.items() if isinstance(v, float) and v > TOL[dtype]}
    assert not over, f"relative error over {TOL[dtype]}: {over} (all: {errs})"


@pytest.mark.parametrize("d", [25, 50, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hstu_shape_silu_time_bias(d, dtype):
    _check("silu", 128, 200, 1, d, dtype, True, norm=200.0)


@pytest.mark.parametrize("heads,timed", [(2, True), (2, False), (1, False)])
def test_hstu_shape_heads_and_positions_only(heads, timed):
    _check("silu", 128, 200, heads, 50, torch.bfloat16, timed, norm=200.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_sequences(dtype):
    _check("silu", 6, 3000, 2, 64, dtype, True, norm=3000.0, n_pos=1024)


@pytest.mark.parametrize("act,causal,window,cross,fused_dq", [
    ("gelu", False, None, False, False), ("silu", True, 64, True, False), ("silu", True, None, False, True),
    ("softmax", True, None, False, False), ("softmax", True, None, True, False)])
def test_variants(act, causal, window, cross, fused_dq):
    _check(act, 32, 200, 2, 64, torch.bfloat16, True, causal=causal, window=window, cross=cross,
           norm=None if act == "softmax" else 64.0, fused_dq=fused_dq)


def test_gdpa_triton_autograd_and_compile_with_bias():
    from gemzoo_gdpa import gdpa_triton

    from gemzoo.api import RelativeAttentionBias

    gen = torch.Generator().manual_seed(0)
    q_lens = _lengths(gen, 64, 200)
    q, k, v, grad, off, _, rb = make_inputs(gen, q_lens, None, 1, 50, 50, torch.bfloat16, 201, 128, True,
                                            device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, rb.positions, rb.time_weights)]

    def f(q, k, v, pos, tw):
        bias = RelativeAttentionBias(pos, tw, rb.q_times, rb.k_times)
        return gdpa_triton(q, k, v, off, causal=True, activation="silu", norm=200.0, relative_bias=bias)

    out = f(*leaves)
    out.backward(grad)
    eager = [out.detach()] + [t.grad.clone() for t in leaves]
    want = reference(q, k, v, grad, off, off, rb, "silu", True, None, 50 ** -0.5, 200.0)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dpos", "dtw"), eager, want, strict=True):
        assert rel_err(mine, theirs) < 2e-2, name
    for t in leaves:
        t.grad = None
    compiled = torch.compile(f, fullgraph=True)(*leaves)
    compiled.backward(grad)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dpos", "dtw"),
                                  [compiled.detach()] + [t.grad for t in leaves], eager, strict=True):
        assert rel_err(mine, theirs) < 1e-2, f"compiled {name} differs from eager"
