"""The ``cpu`` attention kernel (C++, gemzoo._C) beyond the shared conformance suite: sequences spanning
many 64x64 tiles under every mask, reduced-precision inputs, query rows without keys, and opcheck."""

import pytest
import torch

import gemzoo
from gemzoo import ops
from gemzoo.jagged import lengths_to_offsets
from gemzoo.testing.attention import AttentionCase, check_attention
from gemzoo.testing.timeouts import hang_guard

needs_ext = pytest.mark.skipif(not ops.extension_available(), reason="gemzoo._C is not built")
KERNEL = gemzoo.registry.get("attention", "cpu")


def _long_cases():
    cases = []
    for act in ("softmax", "silu", "gelu", "relu", "identity"):
        for causal, asym in ((True, False), (False, True)):
            cases.append(AttentionCase(act, causal, asym, norm=None if act == "softmax" else 100.0, batch=4,
                                       max_len=160, head_dim=32, seed=200 + len(cases)))
    for window, block in ((70, None), (5, None), (None, 64), (None, 48), (40, 32)):
        for causal, asym in ((True, False), (True, True), (False, True)):
            cases.append(AttentionCase("softmax", causal, asym, window=window, block_size=block, batch=4,
                                       max_len=160, head_dim=16, seed=200 + len(cases)))
    cases.append(AttentionCase("silu", True, True, window=50, block_size=64, norm=30.0, batch=4, max_len=160,
                               seed=299))
    return cases


@pytest.mark.parametrize("case", _long_cases(), ids=str)
def test_long_sequences_match_reference(case):
    check_attention(KERNEL, case, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_reduced_precision_inputs(dtype, activation):
    case = AttentionCase(activation, True, False, norm=None if activation == "softmax" else 64.0, max_len=90, seed=9)
    check_attention(KERNEL, case, dtype=dtype)


@pytest.mark.parametrize("activation", ["softmax", "relu"])
def test_queries_without_keys_give_zeros(activation):
    q_off = lengths_to_offsets(torch.tensor([3, 2, 0, 4]))
    k_off = lengths_to_offsets(torch.tensor([0, 5, 3, 2]))  # sequence 0 has queries but no keys
    q = torch.randn(9, 2, 8, requires_grad=True)
    k = torch.randn(10, 2, 8, requires_grad=True)
    v = torch.randn(10, 2, 8, requires_grad=True)
    kw = dict(causal=False, activation=activation, norm=None if activation == "softmax" else 4.0)
    out = KERNEL(q, k, v, q_off, k_off, **kw)
    ref = gemzoo.registry.get("attention", "reference")(q, k, v, q_off, k_off, **kw)
    assert torch.equal(out[:3], torch.zeros(3, 2, 8))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    assert torch.equal(q.grad[:3], torch.zeros(3, 2, 8))
    assert torch.equal(k.grad[5:8], torch.zeros(3, 2, 8))  # sequence 2: keys without queries


@needs_ext
def test_uses_the_extension():
    assert ops.extension_info()["ops"]["jagged_attention_fwd"]["extension"] == ["cpu"]
    q = torch.randn(5, 1, 8)
    out, lse = torch.ops.gemzoo.jagged_attention_fwd(q, q, q, torch.tensor([0, 5]), torch.tensor([0, 5]), True, 0,
                                                     8 ** -0.5, 1.0, -1, -1)
    assert lse.shape == (1, 5) and torch.isfinite(lse).all()
    torch.testing.assert_close(out, KERNEL(q, q, q, torch.tensor([0, 5])))


@needs_ext
@pytest.mark.parametrize("activation,window,block", [(0, -1, -1), (1, 3, -1), (0, -1, 4)])
def test_opcheck(activation, window, block):
    q_off = lengths_to_offsets(torch.tensor([3, 0, 6]))
    k_off = lengths_to_offsets(torch.tensor([4, 2, 6]))
    q = torch.randn(9, 2, 8, requires_grad=True)
    k = torch.randn(12, 2, 8, requires_grad=True)
    v = torch.randn(12, 2, 4, requires_grad=True)
    args = (q, k, v, q_off, k_off, True, activation, 0.3, 5.0, window, block)
    torch.library.opcheck(torch.ops.gemzoo.jagged_attention_fwd.default, args)


def _relative_bias_cases():
    cases = []
    for rel in ("position", "position_time"):
        for act, causal, asym in (("softmax", True, False), ("silu", True, True), ("relu", False, True)):
            cases.append(AttentionCase(act, causal, asym, norm=None if act == "softmax" else 100.0, batch=4,
                                       max_len=150, head_dim=16, relative_bias=rel, seed=400 + len(cases)))
    cases.append(AttentionCase("softmax", True, False, window=70, block_size=64, batch=4, max_len=160,
                               relative_bias="position_time", seed=420))
    return cases


@pytest.mark.parametrize("case", _relative_bias_cases(), ids=str)
def test_relative_bias_over_many_tiles(case):
    """The fused relative bias over sequences of several 64x64 tiles (and the position table's clamp): output,
    dq, dk, dv and both tables' gradients against the fp64 reference."""
    check_attention(KERNEL, case, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_relative_bias_reduced_precision_inputs(dtype):
    check_attention(KERNEL, AttentionCase("silu", True, False, norm=64.0, max_len=90, relative_bias="position_time",
                                          seed=11), dtype=dtype)


def test_relative_bias_time_buckets_match_the_reference_formula():
    """The kernel's bucket, log taken in float32, for 200,000 random gaps and one at every bucket edge: with
    zero scores, identity activation and v = 1, the output of one query against one key is its bias, here
    time_weights[bucket] = bucket."""
    from gemzoo.api import RelativeAttentionBias

    gen = torch.Generator().manual_seed(0)
    gaps = torch.cat([torch.randint(1, 10 ** 9, (200_000,), generator=gen),
                      torch.round(torch.exp(torch.arange(1, 60) * 0.301)).long(), torch.tensor([0, -5])])
    n = gaps.numel()
    q, v = torch.zeros(n, 1, 4), torch.ones(n, 1, 4)
    rb = RelativeAttentionBias(torch.zeros(1), torch.arange(1001, dtype=torch.float32), gaps, torch.zeros_like(gaps))
    out = KERNEL(q, q, v, torch.arange(n + 1), activation="identity", scale=1.0, norm=1.0, relative_bias=rb)
    want = (torch.log(torch.abs(gaps).clamp(min=1)) / 0.301).long()
    assert torch.equal(out[:, 0, 0].long(), want)


@needs_ext
def test_relative_bias_opcheck():
    q_off = lengths_to_offsets(torch.tensor([3, 0, 6]))
    k_off = lengths_to_offsets(torch.tensor([4, 2, 6]))
    q = torch.randn(9, 2, 8, requires_grad=True)
    k = torch.randn(12, 2, 8, requires_grad=True)
    v = torch.randn(12, 2, 4, requires_grad=True)
    pos, tw = torch.randn(5, requires_grad=True), torch.randn(9, requires_grad=True)
    qt, kt = torch.randint(0, 5000, (9,)), torch.randint(0, 5000, (12,))
    for bias in ((pos,), (pos, tw, qt, kt, 0.301)):
        args = (q, k, v, q_off, k_off, True, 1, 0.3, 5.0, -1, -1, *bias)
        torch.library.opcheck(torch.ops.gemzoo.jagged_attention_fwd.default, args)


def test_bad_arguments_are_named():
    q = torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        KERNEL(q, q, q, torch.tensor([0, 4]), window=0)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        KERNEL(q, q, q, torch.tensor([0, 4]), activation="tanh")


@pytest.mark.multiprocess
@needs_ext
def test_portable_gemm_fallback():
    """GEMZOO_NO_BLAS=1: the plain-loop tile GEMMs (used where libtorch exports no sgemm) give the same results."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, gemzoo\n"
        "from gemzoo.testing.attention import AttentionCase, check_attention\n"
        "k = gemzoo.registry.get('attention', 'cpu')\n"
        "for c in (AttentionCase('softmax', True, True, batch=3, max_len=100, seed=1),\n"
        "          AttentionCase('silu', False, False, norm=50.0, window=30, batch=3, max_len=100, seed=2)):\n"
        "    check_attention(k, c)\n"
    )
    env = dict(os.environ, GEMZOO_NO_BLAS="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=hang_guard(300))
    assert res.returncode == 0, res.stderr[-2000:]
