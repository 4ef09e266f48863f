"""Registration, honest capabilities, CPU dispatch (shared conformance suite), input errors, split schedules."""

from __future__ import annotations

import pytest
import torch
from gemzoo_gdpa.ops import KERNEL
from gemzoo_jfa.schedule import build_schedule, split_items

from gemzoo.api import ACTIVATIONS, AttentionRequest, JaggedShapeError, lengths_to_offsets, registry
from gemzoo.testing import attention_cases, check_attention


def test_entry_point_registers_gdpa():
    assert "gdpa" in registry.names("attention")
    entry = registry.entry("attention", "gdpa")
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
    able = [n for n in registry.names("attention")
            if not registry.get("attention", n).capabilities.missing(AttentionRequest(activation="softmax"))]
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
    fallback = registry.get("attention", "cpu" if "cpu" in registry.names("attention") else "reference")
    monkeypatch.setattr(fallback, "fn", lambda *a, **k: calls.append(k["activation"]) or a[0])
    q = torch.randn(6, 1, 8)
    KERNEL(q, q, q, lengths_to_offsets(torch.tensor([6])), activation="gelu")
    assert calls == ["gelu"]


def _inputs(lens=(3, 4)):
    off = lengths_to_offsets(torch.tensor(lens))
    return torch.randn(sum(lens), 2, 16), off


def test_errors_name_the_problem_and_fix():
    from gemzoo_gdpa.ops import gdpa_triton

    from gemzoo.api import PluginError

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


@pytest.mark.parametrize("n_splits", [1, 4])
def test_split_items_repeat_each_item_once_per_split(n_splits):
    gen = torch.Generator().manual_seed(4)
    lq = torch.randint(0, 40, (23,), generator=gen)
    lk = torch.randint(0, 700, (23,), generator=gen)
    qo, ko = lengths_to_offsets(lq), lengths_to_offsets(lk)
    items = build_schedule(qo, ko, int(lq.sum()), 16, over="q", causal=False, window=None)
    split = split_items(items, n_splits)
    assert split.dtype == torch.int32 and split.shape == (3, items.shape[1] * n_splits) and split.is_contiguous()
    assert torch.equal(split[:2, ::n_splits], items)  # same order: costliest items first
    assert split[2].tolist() == list(range(n_splits)) * items.shape[1]


@pytest.mark.parametrize("lk", [1, 63, 64, 65, 700, 16384])
def test_split_chunks_cover_the_keys(lk):
    """The kernel's rule: chunk = ceil(Lk / n) rounded up to BN; n chunks cover [0, Lk)."""
    for n in (1, 2, 8, 16):
        per_split = -(-lk // n)
        chunk = -(-per_split // 64) * 64
        assert n * chunk >= lk and chunk % 64 == 0


def test_cross_attention_call_reads_no_device_value(monkeypatch):
    """gdpa's cross attention from its entry, forward and backward (the shared input check, the split-K plan,
    schedules, fp32 buffers, launch arguments, eager autograd), reads nothing back from the device once the
    batch's offsets were validated from their host copy (``validated_longest(host=...)``, as the models do): on
    the meta device any such read raises. Kernels stubbed; meta tensors take the eager bodies here (the entry
    routes them to the custom op's fake otherwise). Twice: the second call runs from the check's and the launch
    plans' caches."""
    import dataclasses

    import gemzoo_gdpa.ops as ops
    from gemzoo_jfa import family, kernels

    from gemzoo.api import FunctionKernel, validated_longest

    launched = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((self.name, kw.get("SPLIT", False)))

    for name in ("attn_fwd_kernel", "attn_bwd_preprocess", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        monkeypatch.setattr(kernels, name, Stub(name))
    caps = dataclasses.replace(KERNEL.capabilities, devices=frozenset({"meta"}), backward_devices=frozenset({"meta"}))
    monkeypatch.setattr(ops, "KERNEL", FunctionKernel(ops.gdpa_triton, caps, "gdpa on the meta device"))
    monkeypatch.setattr(ops, "run_attention", lambda op, fwd, bwd, *a: family._EagerAttention.apply(fwd, bwd, *a))
    hist = torch.tensor([70, 9, 300, 45, 1000])
    q_host, k_host = lengths_to_offsets(torch.full((5,), 8)), lengths_to_offsets(hist)
    q_off, k_off = q_host.to("meta"), k_host.to("meta")
    tq, tk = 40, int(hist.sum())
    validated_longest(q_off, tq, host=q_host)
    validated_longest(k_off, tk, host=k_host)
    q = torch.empty(tq, 2, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(tk, 2, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    for _ in range(2):
        out = ops.gdpa_triton(q, k, v, q_off, k_off, causal=False, activation="silu", norm=1000.0)
        out.backward(torch.empty_like(out))
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert [n for n, split in launched if split] == ["attn_fwd_kernel"] * 2  # split-K forward, twice
    assert [split for n, split in launched if n == "attn_bwd_dq_kernel"] == [False] * 2  # dQ unsplit
    with pytest.raises((RuntimeError, NotImplementedError)):  # offsets not validated: the check reads them
        ops.gdpa_triton(q, k, v, q_off.clone(), k_off, causal=False, activation="silu")


@pytest.mark.parametrize("candidates,plan", [(16, (8, 64)), (64, (8, 64)), (256, None)])
def test_split_plan_splits_few_candidates_over_long_histories(candidates, plan):
    """The split is a shape rule (no kernel runs): up to 64 candidates a user over 1500-key histories split the
    keys 8 ways on 64-row query blocks; 256 candidates already fill the GPU unsplit."""
    from gemzoo_jfa.family import split_plan

    q = torch.empty(64 * candidates, 4, 128, device="meta")
    k = torch.empty(64 * 1500, 4, 128, device="meta")
    assert split_plan(q, k, 64, 1, 128, 128) == plan
    assert split_plan(q, k, 64, 0, 128, 128) is None  # softmax never splits
    assert split_plan(k, k, 64, 1, 128, 128) is None  # self-attention does not
    assert split_plan(q, k, 64, 1, 128, 128, split=0) is None  # KernelOptions.split = 0: never
    assert split_plan(q, k, 64, 1, 128, 128, split=4)[0] == 4  # a fixed split count is kept
