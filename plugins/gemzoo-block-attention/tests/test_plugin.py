"""Registration, honest capabilities, CPU dispatch (shared conformance suite), input errors, linear schedules."""

from __future__ import annotations

import pytest
import torch
from gemzoo_block_attention.ops import KERNEL

from gemzoo.api import ACTIVATIONS, AttentionRequest, JaggedShapeError, PluginError, lengths_to_offsets, registry
from gemzoo.testing import attention_cases, check_attention


def test_entry_point_registers_block_attention():
    assert "block-attention" in registry.names("attention")
    entry = registry.entry("attention", "block-attention")
    assert entry.obj is KERNEL
    assert entry.distribution == "gemzoo-block-attention"


def test_capabilities_are_honest():
    caps = KERNEL.capabilities
    assert caps.block and caps.window and caps.rotary and caps.asymmetric and caps.non_causal
    assert caps.activations == set(ACTIVATIONS)  # the shared jfa/gdpa tile loop: softmax and pointwise
    assert not caps.missing(AttentionRequest(activation="silu", causal=False, asymmetric=True, window=True,
                                             block=True, rotary=True, head_dim=256, device="cuda"))
    assert caps.missing(AttentionRequest(head_dim=512)) == ["head_dim 512"]
    assert caps.missing(AttentionRequest(dtype=torch.float64)) == ["dtype torch.float64"]


def test_block_requests_find_block_attention():
    from gemzoo.api import kernels_that_serve

    able = kernels_that_serve(AttentionRequest(block=True, rotary=True, device="cuda"))
    assert "block-attention" in able and "jfa" not in able


@pytest.mark.parametrize("case", attention_cases(KERNEL.capabilities), ids=str)
def test_conformance_cpu_dispatch(case):
    check_attention(KERNEL, case, device="cpu")


def _inputs(lens=(3, 4), d=16):
    off = lengths_to_offsets(torch.tensor(lens))
    return torch.randn(sum(lens), 2, d), off


@pytest.mark.parametrize("fn", ["triton", "registered"])
def test_bad_options_name_the_value(fn):
    from gemzoo_block_attention import block_attention, block_attention_triton

    call = block_attention_triton if fn == "triton" else block_attention
    q, off = _inputs()
    for bad, match in (({"block_size": 0}, "block_size must be an int >= 1.*0"),
                       ({"block_size": -4}, "block_size.*-4"), ({"block_size": 2.5}, "block_size.*2.5"),
                       ({"window": 0}, "window must be an int >= 1.*0"), ({"window": -1}, "window.*-1"),
                       ({"rope_theta": 0.0}, "rope_theta must be a finite number > 0.*0.0"),
                       ({"rope_theta": -10.0}, "rope_theta.*-10.0"),
                       ({"rope_theta": float("nan")}, "rope_theta.*nan")):
        with pytest.raises(ValueError, match=match):
            call(q, q, q, off, **bad)
    q7 = torch.randn(7, 2, 15)
    with pytest.raises(ValueError, match="even head dim.*D=15"):
        call(q7, q7, q7, off, rope_theta=10000.0)
    if fn == "registered":  # an odd head dim is fine without rotary (the check is the rotary's)
        assert block_attention(q7, q7, q7, off, block_size=2).shape == (7, 2, 15)


def test_other_errors():
    from gemzoo_block_attention import block_attention_triton

    q, off = _inputs()
    with pytest.raises(JaggedShapeError, match="int64"):
        block_attention_triton(q, q, q, off.int(), block_size=2)
    with pytest.raises(JaggedShapeError, match="head dims up to 256"):
        big = torch.randn(7, 1, 16)
        block_attention_triton(big, big, torch.randn(7, 1, 320), off, block_size=2)
    with pytest.raises(PluginError, match="dtype.*reference"):
        block_attention_triton(q.double(), q.double(), q.double(), off, block_size=2)
    with pytest.raises(JaggedShapeError, match="max_q_len=3 is smaller"):
        block_attention_triton(q, q, q, off, max_q_len=3, block_size=2)


def test_rotary_needs_a_rotary_kernel():
    q, off = _inputs()
    with pytest.raises(PluginError, match="rope_theta.*block-attention"):
        registry.get("attention", "jfa")(q, q, q, off, rope_theta=10000.0)


def test_rope_jagged_matches_reference_rule():
    """The torch rotation (CPU dispatch, bench baseline): reference(rope(q), rope(k)) == reference(q, k, rope)."""
    from gemzoo_block_attention.ops import rope_jagged

    from gemzoo.api import reference_attention

    gen = torch.Generator().manual_seed(0)
    qo, ko = lengths_to_offsets(torch.tensor([5, 0, 9])), lengths_to_offsets(torch.tensor([8, 3, 4]))
    q, k, v = torch.randn(14, 2, 8, generator=gen), torch.randn(15, 2, 8, generator=gen), torch.randn(15, 2, 8)
    qr, kr = rope_jagged(q, k, qo, ko, 100.0)
    a = reference_attention(qr, kr, v, qo, ko, causal=False, block_size=3)
    b = reference_attention(q, k, v, qo, ko, causal=False, block_size=3, rope_theta=100.0)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(qr, q)


@pytest.mark.parametrize("over", ["q", "k"])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 1024)])
def test_schedule_cost_is_linear_in_length(over, causal, window):
    """With a fixed block (and window), the keys (queries) visited per tile do not grow with L: the schedule's
    total cost doubles when L doubles."""
    from gemzoo_jfa.schedule import build_schedule

    costs = []
    for n in (8192, 16384, 32768):
        off = lengths_to_offsets(torch.tensor([n]))
        items = build_schedule(off, off, n, 64, over=over, causal=causal, window=window, block_size=64)
        seq, blk = items.tolist()
        costs.append(len([s for s in seq if s >= 0]))
        dense = build_schedule(off, off, n, 64, over=over, causal=causal, window=window)
        assert torch.equal(torch.sort(items[1]).values, torch.sort(dense[1]).values)  # same tiles, other costs
    assert costs[1] == 2 * costs[0] and costs[2] == 2 * costs[1]


def test_schedule_block_cost_counts_only_the_block():
    """Each query tile's cost is the keys of its own block(s) (plus the fixed block), not the causal prefix:
    with block 64 on 64-row tiles every tile costs the same, and the longest-first order is then arbitrary."""
    import gemzoo_jfa.schedule as sched

    off = lengths_to_offsets(torch.tensor([1000, 70]))
    seen = {}
    orig = torch.sort

    def spy(x, *a, **kw):
        seen.setdefault("cost", x.clone())
        return orig(x, *a, **kw)

    sched.torch.sort = spy
    try:
        # the torch builder sorts by these costs; the Triton one ranks by the same (tested equal to it)
        sched.build_schedule_torch(off, off, 1070, 64, "q", False, None, "lpt", 64, None)
    finally:
        sched.torch.sort = orig
    cost = seen["cost"]
    valid = cost[cost >= 0]
    assert int(valid.max()) <= 64 + 64 and int(valid.min()) >= 64
