"""Registration, honest capabilities, CPU dispatch (shared conformance suite), input errors, split schedules."""

from __future__ import annotations

import pytest
import torch

import gemzoo
from gemzoo.errors import JaggedShapeError
from gemzoo.interfaces.attention import ACTIVATIONS, AttentionRequest
from gemzoo.jagged import lengths_to_offsets
from gemzoo.testing import attention_cases, check_attention
from gemzoo_gdpa.plugin import KERNEL
from gemzoo_jfa.schedule import build_split_schedule


def test_entry_point_registers_gdpa():
    assert "gdpa" in gemzoo.registry.names("attention")
    entry = gemzoo.registry.entry("attention", "gdpa")
    assert entry.obj is KERNEL
    assert entry.distribution == "gemzoo-gdpa"


def test_capabilities_are_honest():
    caps = KERNEL.capabilities
    assert caps.activations == set(ACTIVATIONS) - {"softmax"}
    assert {"silu", "gelu", "gelu_tanh", "relu", "relu2", "leaky_relu", "hardswish", "identity"} <= caps.activations
    assert caps.missing(AttentionRequest(activation="softmax")) == ["activation='softmax'"]
    assert caps.missing(AttentionRequest(activation="silu", block=True)) == ["block_size"]
    assert not caps.missing(AttentionRequest(activation="silu", causal=False, asymmetric=True, window=True,
                                             head_dim=256, device="cuda"))
    assert caps.missing(AttentionRequest(activation="silu", head_dim=512))


def test_softmax_requests_go_to_other_kernels():
    able = [n for n in gemzoo.registry.names("attention")
            if not gemzoo.registry.get("attention", n).capabilities.missing(AttentionRequest(activation="softmax"))]
    assert "jfa" in able and "gdpa" not in able


@pytest.mark.parametrize("case", attention_cases(KERNEL.capabilities), ids=str)
def test_conformance_cpu_dispatch(case):
    check_attention(KERNEL, case, device="cpu")


@pytest.mark.parametrize("window", [None, 6])
def test_cpu_fallback_window_and_norm(window):
    from gemzoo.testing.attention import AttentionCase

    check_attention(KERNEL, AttentionCase("gelu_tanh", True, True, window=window, norm=7.0, seed=9), device="cpu")


def test_cpu_dispatch_goes_to_cpu_kernel_or_reference(monkeypatch):
    calls = []
    fallback = gemzoo.registry.get("attention", "cpu" if "cpu" in gemzoo.registry.names("attention") else "reference")
    monkeypatch.setattr(fallback, "fn", lambda *a, **k: calls.append(k["activation"]) or a[0])
    q = torch.randn(6, 1, 8)
    KERNEL(q, q, q, lengths_to_offsets(torch.tensor([6])), activation="gelu")
    assert calls == ["gelu"]


def _inputs(lens=(3, 4)):
    off = lengths_to_offsets(torch.tensor(lens))
    return torch.randn(sum(lens), 2, 16), off


def test_errors_name_the_problem_and_fix():
    from gemzoo.errors import PluginError
    from gemzoo_gdpa.ops import gdpa_triton

    q, off = _inputs()
    with pytest.raises(PluginError, match="softmax.*jfa"):
        gdpa_triton(q, q, q, off, activation="softmax")
    with pytest.raises(PluginError, match="softmax.*jfa"):
        KERNEL(q, q, q, off)  # the interface's default activation is softmax: the same error on CPU
    with pytest.raises(ValueError, match="unknown activation.*silu"):
        gdpa_triton(q, q, q, off, activation="tanh")
    with pytest.raises(PluginError, match="block_size"):
        gdpa_triton(q, q, q, off, block_size=4)
    with pytest.raises(ValueError, match="norm"):
        gdpa_triton(q, q, q, off, norm=0)
    with pytest.raises(JaggedShapeError, match="int64"):
        gdpa_triton(q, q, q, off.int())
    with pytest.raises(JaggedShapeError, match="non-decreasing"):
        gdpa_triton(q, q, q, torch.tensor([0, 5, 4, 7]))
    with pytest.raises(JaggedShapeError, match="head dims up to 256"):
        big = torch.randn(7, 1, 16)
        gdpa_triton(big, big, torch.randn(7, 1, 320), lengths_to_offsets(torch.tensor([7])))
    with pytest.raises(PluginError, match="dtype"):
        gdpa_triton(q.double(), q.double(), q.double(), off)
    with pytest.raises(JaggedShapeError, match="max_q_len=3 is smaller"):
        gdpa_triton(q, q, q, off, max_q_len=3)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 50)])
def test_split_schedule_covers_every_allowed_key_once(causal, window):
    gen = torch.Generator().manual_seed(4)
    lq = torch.randint(0, 40, (23,), generator=gen)
    lq[[0, 5]] = 0
    lk = torch.randint(0, 700, (23,), generator=gen)
    lk[7] = 0
    qo, ko = lengths_to_offsets(lq), lengths_to_offsets(lk)
    bm, split_n = 16, 64
    seq, blk, split = build_split_schedule(qo, ko, bm, split_n, causal=causal, window=window).tolist()
    items = list(zip(seq, blk, split))
    assert len(items) == len(set(items))
    for b in range(23):  # every (query block, allowed key) is in exactly one item
        for m in range((int(lq[b]) + bm - 1) // bm):
            mine = sorted(s for (sb, mb, s) in items if sb == b and mb == m)
            assert mine, f"query block {m} of sequence {b} has no item"
            rows = torch.arange(m * bm, min(m * bm + bm, int(lq[b]))) + int(lk[b] - lq[b])
            cols = torch.arange(int(lk[b]))
            ok = torch.ones(len(rows), len(cols), dtype=torch.bool)
            if causal:
                ok &= cols[None] <= rows[:, None]
            if window is not None:
                ok &= rows[:, None] - cols[None] < window
            needed = sorted({int(c) // split_n for c in cols[ok.any(0)]})
            assert set(needed) <= set(mine) and len(mine) <= max(len(needed), 1)
    assert all(s >= 0 for s in seq), "split schedules hold real items only"
