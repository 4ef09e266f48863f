"""Registration, capabilities, CPU dispatch (shared conformance suite), input errors, schedules."""

from __future__ import annotations

import pytest
import torch
from gemzoo_jfa.ops import KERNEL
from gemzoo_jfa.schedule import build_schedule, capacity

from gemzoo.api import AttentionRequest, JaggedShapeError, PluginError, lengths_to_offsets, registry
from gemzoo.testing import attention_cases, check_attention
from gemzoo.testing.timeouts import hang_guard


def test_entry_point_registers_jfa():
    assert "jfa" in registry.names("attention")
    entry = registry.entry("attention", "jfa")
    assert entry.obj is KERNEL
    assert entry.distribution == "gemzoo-jfa"


def test_capabilities_are_honest():
    caps = KERNEL.capabilities
    assert caps.activations == {"softmax"}
    assert caps.window and not caps.block
    assert caps.missing(AttentionRequest(activation="silu")) == ["activation='silu'"]
    assert caps.missing(AttentionRequest(block=True)) == ["block_size"]
    assert not caps.missing(AttentionRequest(asymmetric=True, window=True, head_dim=256, device="cuda"))
    assert caps.missing(AttentionRequest(head_dim=512))


@pytest.mark.parametrize("case", attention_cases(KERNEL.capabilities), ids=str)
def test_conformance_cpu_dispatch(case):
    check_attention(KERNEL, case, device="cpu")


def test_cpu_dispatch_goes_to_cpu_kernel_or_reference(monkeypatch):
    calls = []
    fallback = registry.get("attention", "cpu" if "cpu" in registry.names("attention") else "reference")
    monkeypatch.setattr(type(fallback), "__call__", lambda self, *a, **k: calls.append(1) or a[0])
    q = torch.randn(6, 1, 8)
    KERNEL(q, q, q, lengths_to_offsets(torch.tensor([6])))
    assert calls == [1]


def _inputs(lens=(3, 4)):
    off = lengths_to_offsets(torch.tensor(lens))
    q = torch.randn(sum(lens), 2, 16)
    return q, off


@pytest.mark.parametrize("entry", ["jfa_triton", "KERNEL"])
def test_errors_name_the_problem_and_fix(entry):
    """The Triton entry and the registered kernel (CPU fallback included) fail the same way, through the
    shared check: options jfa does not declare name the registered kernels that can serve them."""
    from gemzoo_jfa.ops import jfa_triton

    fn = jfa_triton if entry == "jfa_triton" else KERNEL
    q, off = _inputs()
    with pytest.raises(PluginError, match=r"'jfa' does not support activation='silu'.*can serve this call: ") as exc:
        fn(q, q, q, off, activation="silu")
    able = [n.strip(" .") for n in str(exc.value).split("can serve this call: ")[1].split(",")]
    assert "reference" in able and set(able) <= set(registry.names("attention"))  # registered ones only
    with pytest.raises(PluginError, match=r"does not support block_size.*reference"):
        fn(q, q, q, off, block_size=4)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        fn(q, q, q, off, window=0)
    with pytest.raises(JaggedShapeError, match="int64.*long"):
        fn(q, q, q, off.int())
    with pytest.raises(JaggedShapeError, match="non-decreasing"):
        fn(q, q, q, torch.tensor([0, 5, 4, 7]))
    with pytest.raises(PluginError, match="head_dim 320"):
        big = torch.randn(7, 1, 320)
        fn(big, big, big, off)
    with pytest.raises(PluginError, match="dtype torch.float64"):
        fn(q.double(), q.double(), q.double(), off)
    with pytest.raises(JaggedShapeError, match="k_offsets is required"):
        fn(q, q[:5], q[:5], off)
    with pytest.raises(JaggedShapeError, match="max_k_len=3 is smaller than the longest key sequence"):
        fn(q, q, q, off, max_k_len=3)


def _expected_items(lens, block):
    return {(b, i) for b, n in enumerate(lens) for i in range((n + block - 1) // block)}


@pytest.mark.parametrize("over", ["q", "k"])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 100)])
def test_schedule_covers_every_block_once_longest_first(over, causal, window):
    gen = torch.Generator().manual_seed(3)
    lq = torch.randint(0, 700, (37,), generator=gen)
    lq[[0, 5]] = 0
    lk = lq + torch.randint(0, 50, (37,), generator=gen)
    lens = (lq if over == "q" else lk).tolist()
    qo, ko = lengths_to_offsets(lq), lengths_to_offsets(lk)
    total = sum(lens)
    items = build_schedule(qo, ko, total, 64, over=over, causal=causal, window=window)
    assert items.dtype == torch.int32 and items.shape == (2, capacity(total, 37, 64))
    seq, blk = items.tolist()
    real = [(s, b) for s, b in zip(seq, blk, strict=True) if s >= 0]
    assert len(real) == len(set(real)) and set(real) == _expected_items(lens, 64)
    assert all(s < 0 for s in seq[len(real):]), "empty slots must come last"
    # lpt: sequences longest first, each sequence's items contiguous
    seq_order = [s for i, s in enumerate(x[0] for x in real) if i == 0 or real[i - 1][0] != s]
    assert len(seq_order) == len(set(seq_order)), "a sequence's items must be contiguous"
    sizes = (lq + lk).tolist()
    assert [sizes[s] for s in seq_order] == sorted((sizes[s] for s in seq_order), reverse=True)
    natural = build_schedule(qo, ko, total, 64, over=over, causal=causal, window=window, order="natural")
    assert [tuple(x) for x in natural.t().tolist() if x[0] >= 0] == sorted(real)
    item = build_schedule(qo, ko, total, 64, over=over, causal=causal, window=window, order="item")
    item_real = [tuple(x) for x in item.t().tolist() if x[0] >= 0]
    assert sorted(item_real) == sorted(real)
    if causal and window is None and over == "q":  # costliest item first: the longest last block
        costs = [lk[s] - lq[s] + min(b * 64 + 64, lq[s]) for s, b in item_real]
        assert costs == sorted(costs, reverse=True)


@pytest.mark.parametrize("over", ["q", "k"])
def test_length_buckets_split_the_schedule_without_overlap(over):
    """Bucketed schedules hold exactly the items of their sequences (by max(Lq, Lk)), each once, within their
    capacity, and together every item of the unbucketed schedule."""
    gen = torch.Generator().manual_seed(5)
    lq = torch.randint(0, 200, (41,), generator=gen)
    lq[[0, 7]] = 0
    lk = (lq + torch.randint(-30, 30, (41,), generator=gen)).clamp_min(0)
    qo, ko = lengths_to_offsets(lq), lengths_to_offsets(lk)
    lens = (lq if over == "q" else lk).tolist()
    total = sum(lens)
    longer = torch.maximum(lq, lk).tolist()
    union = set()
    for lo, hi in ((0, 32), (32, 64), (64, None)):
        items = build_schedule(qo, ko, total, 32, over=over, causal=True, window=None, lengths=(lo, hi))
        assert items.shape == (2, capacity(total, 41, 32, (lo, hi)))
        real = [(s, b) for s, b in items.t().tolist() if s >= 0]
        inside = [i for i, n in enumerate(longer) if n > lo and (hi is None or n <= hi)]
        assert len(real) == len(set(real)) and set(real) == _expected_items(lens, 32) & {
            (s, b) for s in inside for b in range(-(-lens[s] // 32))}
        assert union.isdisjoint(real)
        union |= set(real)
    assert union == _expected_items(lens, 32)


def test_length_buckets_apply_to_short_batches_only():
    from gemzoo_jfa import family

    def launches(lens, **kw):
        q = torch.empty(sum(lens), 4, 128, dtype=torch.bfloat16, device="meta")
        options = family.KernelOptions(**kw)
        return [(c.block_m, c.block_n, r) for c, r in family.length_buckets(q, q, len(lens), "fwd", options=options)]

    assert launches([16] * 10) == [(16, 16, None)]  # no default buckets off CUDA
    small = family.Configs(*(family.KernelConfig(16, 16, 1, 1),) * 3)
    buckets = (family.Bucket(64, small),)
    assert launches([2000, 10], buckets=buckets) == [(16, 16, (0, 64)), (16, 16, (64, None))]  # asked for: always
    assert launches([2000, 10], buckets=()) == [(16, 16, None)]
    assert family.short_buckets(128, "cuda", 2) and not family.short_buckets(256, "cuda", 2)
    assert not family.short_buckets(128, "cuda", 4)
    expected = family.short_buckets(128, "cuda", 2) if family.BUCKETS_BY_DEFAULT else ()
    assert family.default_buckets(128, "cuda", 2) == expected


def test_a_short_softmax_batch_loads_its_long_sequences_through_pointers(monkeypatch):
    from gemzoo_jfa import family

    monkeypatch.setattr(family, "default_buckets", lambda *a: family.short_buckets(128, "cuda", 2))
    big = family.KernelConfig(128, 128, 8, 3)
    monkeypatch.setattr(family, "default_configs", lambda *a, **kw: family.Configs(big, big, big))
    q = torch.empty(300, 4, 128, dtype=torch.bfloat16, device="meta")
    softmax = family.length_buckets(q, q, 10, "fwd")
    assert [c.tma for c, _ in softmax] == [False, False, False]  # both buckets and the main tiles
    silu = family.length_buckets(q, q, 10, "fwd", activation=family.ACTIVATION_CODES["silu"])
    assert [c.tma for c, _ in silu] == [False, False, None]  # pointwise: the main tiles keep TMA
    assert [c.tma for c, _ in family.length_buckets(q, q, 10, "fwd", block=64)] == [False, False, None]  # block masks
    long = torch.empty(10 * 2000, 4, 128, dtype=torch.bfloat16, device="meta")
    assert [c.tma for c, _ in family.length_buckets(long, long, 10, "fwd")] == [None]  # a long batch: one launch


def test_schedule_long_sequence_int64():
    lens = torch.tensor([70_000, 0, 3])
    off = lengths_to_offsets(lens)
    items = build_schedule(off, off, 70_003, 128, over="q", causal=True, window=None)
    seq, blk = items.tolist()
    real = [(s, b) for s, b in zip(seq, blk, strict=True) if s >= 0]
    assert len(real) == 547 + 1 and real[0] == (0, 546)  # last block of the 70K sequence costs most
    assert real[-1] == (2, 0)
    with pytest.raises(ValueError, match="order"):
        build_schedule(off, off, 70_003, 128, over="q", causal=True, window=None, order="random")


def test_schedule_is_built_once_per_offsets_and_rebuilt_when_they_change():
    """The attention layers of one batch share its offsets, so they share one schedule; an in-place change of
    the offsets, or another tensor (even at a reused address), builds a new one with the right values."""
    def sched(off):
        return build_schedule(off, off, int(off[-1]), 16, over="q", causal=True, window=None)

    off = lengths_to_offsets(torch.tensor([40, 0, 7]))
    first = sched(off)
    assert sched(off) is first  # cached
    assert sched(off.clone()) is not first and torch.equal(sched(off.clone()), first)  # same values, new tensor
    assert build_schedule(off, off, 47, 16, over="k", causal=True, window=None) is not first  # other arguments
    off[1:] = torch.tensor([7, 7, 47])  # in place: lengths 7, 0, 40
    changed = sched(off)
    assert changed is not first
    assert torch.equal(changed, sched(lengths_to_offsets(torch.tensor([7, 0, 40]))))
    for _ in range(40):  # freed tensors whose ids are reused never match a stale entry
        other = lengths_to_offsets(torch.tensor([3, 30]))
        assert torch.equal(sched(other), sched(lengths_to_offsets(torch.tensor([3, 30])).clone()))


HOPPER_VARIANTS = ["bucket64 fwd tma w8", "default dkdv tma (reference)", "fused-dq dkdv tma BM32 BN128 w8 s3",
                   "fp8 qk fwd tma BM128 BN128 w8 s3", "fp8 qkv fwd tma BM128 BN64 w8 s3", "fp8 qkv fwd ptr D16 BM64 BN64 w4 s1",
                   "fp8 quantize G128", "fp32 ieee D50 dkdv ptr", "fp32 tf32 D50 dkdv ptr"]


@pytest.fixture(scope="module")
def hopper_compiles():
    """bench/compile_sm90.py over HOPPER_VARIANTS, in one subprocess without TRITON_INTERPRET (which turns the
    kernels into interpreted functions): name -> its result."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    script = Path(__file__).resolve().parents[1] / "bench" / "compile_sm90.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), "--only", ",".join(HOPPER_VARIANTS), "--json"],
                         capture_output=True, text=True, env=env, timeout=hang_guard(1800))
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", HOPPER_VARIANTS)
def test_kernel_variants_compile_for_hopper_offline(variant, hopper_compiles):
    """The GPU code path (not the interpreter's) compiles for sm_90a and ptxas accepts it, on a CPU machine:
    catches what only the compiler sees (a constexpr branch that types differently, a descriptor box)."""
    res = hopper_compiles[variant]
    assert res["ok"], res
    assert res["triton_shared"] <= 232448, "over Hopper's 227 KB of shared memory per block"
    if "fwd" in variant and variant.startswith("fp8"):  # QK^T (and, with qkv, P V) as e4m3 wgmma
        assert any(w.endswith("e4m3.e4m3") for w in res["wgmma"]), res
        assert ("qkv" not in variant) == any(w.endswith("bf16.bf16") for w in res["wgmma"]), res
    if variant.startswith("fp32"):  # full-fp32 dots run on the FMA units, TF32 ones as tf32 wgmma
        assert bool(res["wgmma"]) == ("tf32" in variant), res
        assert "ieee" not in variant or res["spill_bytes"] == 0, res  # its small tiles fit the registers


class _NoLaunch:
    """Stands in for a Triton kernel: records ``kernel[grid](...)`` launches and runs nothing."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, grid, kwargs.get("USE_TMA")))


def test_a_config_may_turn_tma_off_for_its_own_launches(monkeypatch):
    """KernelConfig.tma=False: that config's launches load tiles through pointers, the others keep TMA (the short
    buckets' tiles use it)."""
    from gemzoo_jfa import family, kernels

    calls = []
    for name in ("attn_fwd_kernel", "attn_bwd_preprocess", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        monkeypatch.setattr(kernels, name, _NoLaunch(name, calls))
    monkeypatch.setattr(family, "_tma_ok", lambda *a, **k: True)
    monkeypatch.setattr(family, "_desc", lambda t, rows: t)
    off = lengths_to_offsets(torch.tensor([5, 0, 130, 7])).to("meta")
    q = torch.empty(142, 2, 64, device="meta", dtype=torch.bfloat16)
    ptr = family.KernelConfig(16, 16, 1, 1, tma=False)
    lse = torch.empty(2, 142, device="meta", dtype=torch.float32)
    options = family.KernelOptions(buckets=(family.Bucket(64, family.Configs(ptr, ptr, ptr)),))
    family.launch_fwd(q, q, q, off, off, True, 0.125, -1, torch.empty_like(q), lse, options=options)
    family.backward(torch.empty_like(q), q, q, q, q, lse, off, off, True, 0.125, -1, options=options)
    for name in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        assert [tma for n, _, tma in calls if n == name] == [False, True], name  # the bucket, then the main tiles


@pytest.mark.parametrize("variant", ["plain", "window", "buckets", "fused_dq", "pointwise_split", "block"])
def test_the_launch_path_reads_no_device_value(monkeypatch, variant):
    """Everything before a launch (schedules, length buckets, key splits, buffers) runs on the device without
    a host sync: on the meta device, where any read of a value raises, with the kernels themselves stubbed out.
    The launchers are the family's (jfa, gdpa and block-attention call them)."""
    from gemzoo_jfa import family, kernels

    calls = []
    for name in ("attn_fwd_kernel", "attn_bwd_preprocess", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        monkeypatch.setattr(kernels, name, _NoLaunch(name, calls))
    lengths = [5, 0, 130, 7, 48]
    q_off = lengths_to_offsets(torch.tensor(lengths)).to("meta")
    k_off = q_off
    t, h, d = sum(lengths), 2, 64
    activation, block, window, causal = 0, -1, -1, True
    options = {}
    if variant == "window":
        window = 16
    elif variant == "buckets":
        options = {"buckets": family.short_buckets(d, "cuda")}
    elif variant == "fused_dq":
        options = {"fused_dq": True}
    elif variant == "pointwise_split":  # gdpa's cross attention: 3 candidates a user over the history
        activation, causal = family.ACTIVATION_CODES["silu"], False
        q_off = lengths_to_offsets(torch.full((len(lengths),), 3)).to("meta")
    elif variant == "block":  # block-attention
        activation, block, causal = family.ACTIVATION_CODES["silu"], 32, False
    tq = int(q_off.numel() - 1) * 3 if variant == "pointwise_split" else t
    q = torch.empty(tq, h, d, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(t, h, d, device="meta", dtype=torch.bfloat16) for _ in range(2))
    out, lse = torch.empty_like(q), torch.empty(h, tq, device="meta", dtype=torch.float32)
    opts = family.KernelOptions(**options)
    family.launch_fwd(q, k, v, q_off, k_off, causal, 0.125, window, out, lse, activation, 1.0, block, options=opts)
    dq, dk, dv = family.backward(torch.empty_like(q), q, k, v, out, lse, q_off, k_off, causal, 0.125, window,
                                 activation, 1.0, block, options=opts)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    launched = {name for name, *_ in calls}
    assert "attn_fwd_kernel" in launched and "attn_bwd_dkdv_kernel" in launched
    assert ("attn_bwd_dq_kernel" in launched) == (variant != "fused_dq")


def test_kernel_options_are_checked_and_cross_the_custom_op_as_an_index():
    from gemzoo_jfa import family

    from gemzoo.api import ACTIVATION_CODES

    assert family.ACTIVATION_CODES is ACTIVATION_CODES  # the kernels take gemzoo's one numbering
    assert family.options_index(None) == 0 and family.options_at(0) == family.KernelOptions()
    small = family.Configs(*(family.KernelConfig(16, 16, 1, 1),) * 3)
    options = family.KernelOptions(order="natural", tma=False, split=2, buckets=[family.Bucket(64, small)])
    assert options.buckets == (family.Bucket(64, small),)  # a list becomes a tuple: the options stay hashable
    index = family.options_index(options)
    assert index > 0 and family.options_index(family.KernelOptions(**vars(options))) == index
    assert family.options_at(index) is options
    with pytest.raises(ValueError, match="order='fastest'"):
        family.KernelOptions(order="fastest")
    with pytest.raises(ValueError, match="split"):
        family.KernelOptions(split=-1)
    with pytest.raises(ValueError, match="increasing"):
        family.KernelOptions(buckets=(family.Bucket(128, small), family.Bucket(64, small)))
    with pytest.raises(TypeError, match="KernelOptions"):
        family.options_index({"tma": False})


def test_launch_plans_are_reused_only_for_the_same_offsets_and_signature(monkeypatch):
    """The launches (buckets, split plan, schedules, argument lists) are planned once per offsets tensors and call
    signature: a second identical call plans nothing and launches with the same arguments; offsets changed in
    place, another scale or other strides are planned again, with their own schedule and arguments."""
    from gemzoo_jfa import family, kernels

    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((self.name, grid, a, kw))

    for name in ("attn_fwd_kernel", "attn_bwd_preprocess", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        monkeypatch.setattr(kernels, name, Recorder(name))
    planned = []
    real = family.length_buckets
    monkeypatch.setattr(family, "length_buckets", lambda *a, **kw: planned.append(a[3]) or real(*a, **kw))
    off = lengths_to_offsets(torch.tensor([5, 0, 130, 7]))
    q = torch.randn(142, 2, 16)
    out, lse = torch.empty_like(q), torch.empty(2, 142)

    def call(scale=0.125, k=q):
        launched.clear()
        family.launch_fwd(q, k, k, off, off, True, scale, -1, out, lse)
        family.backward(out, q, k, k, out, lse, off, off, True, scale, -1)
        return list(launched)

    def items(calls):  # the schedules passed (the only int32 tensors)
        return [x for _, _, args, _ in calls for x in args if isinstance(x, torch.Tensor) and x.dtype == torch.int32]

    first = call()
    assert planned == ["fwd", "dkdv", "dq"]
    assert {n for n, *_ in first} == {"attn_fwd_kernel", "attn_bwd_preprocess", "attn_bwd_dkdv_kernel",
                                      "attn_bwd_dq_kernel"}
    again = call()
    assert planned == ["fwd", "dkdv", "dq"]  # nothing planned again
    assert [(n, g, kw) for n, g, _, kw in again] == [(n, g, kw) for n, g, _, kw in first]
    assert [x.data_ptr() for x in items(again)] == [x.data_ptr() for x in items(first)]  # the same schedules
    before = [x.clone() for x in items(first)]
    off[2] = 40  # in place: [5, 0, 130, 7] becomes [5, 35, 95, 7]; a new version, new schedules
    changed = call()
    assert planned == ["fwd", "dkdv", "dq"] * 2
    assert any(not torch.equal(a, b) for a, b in zip(items(changed), before, strict=True))
    call(scale=0.5)  # another scale: its own arguments
    assert planned == ["fwd", "dkdv", "dq"] * 3
    fwd = next(a for n, _, a, _ in launched if n == "attn_fwd_kernel")
    assert 0.5 * family.LOG2E in [x for x in fwd if isinstance(x, float)]
    strided = torch.randn(142, 4, 16)[:, ::2]  # k and v with other strides: planned again, their strides passed
    call(k=strided)
    assert planned == ["fwd", "dkdv", "dq"] * 4
    fwd = next(a for n, _, a, _ in launched if n == "attn_fwd_kernel")
    assert strided.stride(0) in [x for x in fwd if isinstance(x, int)] and strided.stride(0) != q.stride(0)


@pytest.mark.parametrize("shape", [(142, 2, 16), (0, 4, 128), (7, 0, 3), (1, 1, 1), (5, 3, 0)])
def test_planned_strides_of_a_split_buffer_match_torch(shape):
    """A split launch's fp32 buffer is allocated per call, after its arguments were planned from its shape."""
    from gemzoo_jfa import family

    assert family._Strides(shape).stride() == torch.empty(shape, dtype=torch.float32).stride()
    assert family._Strides(shape).stride(1) == torch.empty(shape).stride(1)


@pytest.mark.parametrize("precision,dtype,dot", [("highest", torch.float32, "ieee"), ("high", torch.float32, "tf32"),
                                                 ("medium", torch.float32, "tf32"),
                                                 ("highest", torch.bfloat16, "tf32")])
def test_fp32_dots_follow_torchs_matmul_precision(precision, dtype, dot):
    """fp32 q multiplies in full fp32 under "highest" (torch's default) on FMA-sized tiles, in TF32 otherwise;
    16-bit operands keep Triton's default and their tiles."""
    from gemzoo_jfa import family

    q = torch.empty(64, 2, 64, dtype=dtype, device="meta")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert family._dot_precision(q) == dot
    finally:
        torch.set_float32_matmul_precision(before)
    ieee = family.default_configs(64, "cuda", 4, ieee=True)
    assert max(ieee.fwd.block_m, ieee.fwd.block_n, ieee.dkdv.block_m, ieee.dq.block_n) <= 32
    assert family.default_configs(64, "cuda", 2, ieee=False).fwd.block_m == 128
