"""GPU checks (skipped without CUDA): random jagged inputs with empty sequences against an fp64 reference,
outputs and gradients poisoned with NaN first so unwritten elements fail."""

from __future__ import annotations

import pytest
import torch
from gemzoo_jfa.family import DEFAULT_OPTIONS, KernelOptions, launch_bwd, launch_fwd

from gemzoo.api import lengths_to_offsets, reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 5e-3}


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def _lengths(gen, batch, max_len):
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[torch.rand(batch, generator=gen) < 0.2] = 0
    lens[1] = 0
    return lens


def run_poisoned(q, k, v, q_off, k_off, causal, window, grad, options=DEFAULT_OPTIONS):
    """Launch fwd and bwd into NaN-filled buffers; return out, dq, dk, dv."""
    scale = q.shape[-1] ** -0.5
    win = -1 if window is None else window
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), device=q.device, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device, dtype=torch.float32)
    launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, lse, options=options)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    launch_bwd(grad, q, k, v, out, lse, q_off, k_off, causal, scale, win, dq, dk, dv, options=options)
    return out, dq, dk, dv


CASES = [
    # (head dim, causal, asymmetric, window, dtype)
    (128, True, False, None, torch.bfloat16),
    (128, False, False, None, torch.bfloat16),
    (64, True, True, None, torch.bfloat16),
    (32, False, True, None, torch.float16),
    (256, True, False, None, torch.bfloat16),
    (128, True, False, 100, torch.bfloat16),
    (64, True, True, 77, torch.float16),
    (128, True, False, None, torch.float32),
    (96, True, False, None, torch.bfloat16),
    (256, False, True, 300, torch.float32),
    (64, False, False, None, torch.float16),
]


@pytest.mark.parametrize("d,causal,asym,window,dtype", CASES)
def test_against_fp64_reference_poisoned(d, causal, asym, window, dtype):
    check_against_fp64_poisoned(d, causal, asym, window, dtype)


def check_against_fp64_poisoned(d, causal, asym, window, dtype, options=DEFAULT_OPTIONS, tol=None) -> dict:
    gen = torch.Generator().manual_seed(d * 7 + causal + 2 * asym + (window or 0))
    heads, batch = 3, 9
    q_lens = _lengths(gen, batch, 300)
    k_lens = (q_lens + torch.randint(0, 90, (batch,), generator=gen)) if asym else q_lens
    if asym:
        k_lens[2] = 0  # queries with no keys at all: output 0
    q_off, k_off = lengths_to_offsets(q_lens).cuda(), lengths_to_offsets(k_lens).cuda()
    tq, tk = int(q_lens.sum()), int(k_lens.sum())
    q = torch.randn(tq, heads, d, generator=gen).to("cuda", dtype)
    k = torch.randn(tk, heads, d, generator=gen).to("cuda", dtype)
    v = torch.randn(tk, heads, d, generator=gen).to("cuda", dtype)
    grad = torch.randn(tq, heads, d, generator=gen).to("cuda", dtype)
    out, dq, dk, dv = run_poisoned(q, k, v, q_off, k_off, causal, window, grad, options)
    torch.cuda.synchronize()
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{name} has unwritten (NaN) or non-finite elements"
    refs = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off.cpu(), k_off.cpu(), causal=causal, window=window)
    ref.backward(grad.double().cpu())
    errs = {"out": _rel(out, ref.detach()), "dq": _rel(dq, refs[0].grad), "dk": _rel(dk, refs[1].grad),
            "dv": _rel(dv, refs[2].grad)}
    assert all(e < (tol or TOL[dtype]) for e in errs.values()), errs
    return errs


@pytest.mark.parametrize("d,causal,asym,window", [(50, True, False, None), (128, False, True, 90)])
def test_fp32_follows_the_matmul_precision(d, causal, asym, window):
    """fp32 under torch's default "highest" multiplies in full fp32: out and grads within 1e-5 of fp64 (TF32 is
    about 1e-3); under "high" the same launch runs TF32, measurably further off."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        exact = check_against_fp64_poisoned(d, causal, asym, window, torch.float32, tol=1e-5)
        torch.set_float32_matmul_precision("high")
        tf32 = check_against_fp64_poisoned(d, causal, asym, window, torch.float32)
    finally:
        torch.set_float32_matmul_precision(before)
    assert max(tf32.values()) > 10 * max(exact.values()), (exact, tf32)


@pytest.mark.parametrize("d,causal,window,dtype", [(128, True, None, torch.bfloat16), (64, True, 40, torch.float16),
                                                    (128, False, None, torch.bfloat16)])
def test_short_histories_take_the_length_buckets_and_match_reference(d, causal, window, dtype):
    """Many short histories (the bench's short workload, smaller) on the short-sequence buckets: sequences of
    at most 64 tokens run on their own tiles, and every output and gradient still matches fp64."""
    from gemzoo_jfa.family import length_buckets, short_buckets

    gen = torch.Generator().manual_seed(d + causal)
    lens = (48 * torch.exp(0.7 * torch.randn(300, generator=gen))).round().clamp(1, 1024).long()
    lens[torch.rand(300, generator=gen) < 0.05] = 0
    off = lengths_to_offsets(lens).cuda()
    q, k, v, grad = (torch.randn(int(lens.sum()), 4, d, generator=gen).to("cuda", dtype) for _ in range(4))
    options = KernelOptions(buckets=short_buckets(d, "cuda", q.element_size()))
    assert [r for _, r in length_buckets(q, k, 300, "fwd", options=options)] == [(0, 64), (64, 128), (128, None)]
    out, dq, dk, dv = run_poisoned(q, k, v, off, off, causal, window, grad, options)
    torch.cuda.synchronize()
    refs = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, off.cpu(), causal=causal, window=window)
    ref.backward(grad.double().cpu())
    for name, mine, theirs in (("out", out, ref.detach()), ("dq", dq, refs[0].grad), ("dk", dk, refs[1].grad),
                               ("dv", dv, refs[2].grad)):
        assert torch.isfinite(mine).all(), f"{name} has unwritten (NaN) elements"
        assert _rel(mine, theirs) < TOL[dtype], (name, _rel(mine, theirs))


def test_autograd_and_registered_kernel_on_cuda():
    from gemzoo_jfa.ops import KERNEL

    from gemzoo.api import registry

    # the entry point exists only when the distribution is pip-installed; a source checkout uses the object
    kernel = registry.get("attention", "jfa") if "jfa" in registry.names("attention") else KERNEL
    lens = torch.tensor([0, 129, 1, 0, 64, 300])
    off = lengths_to_offsets(lens).cuda()
    q, k, v = (torch.randn(int(lens.sum()), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = kernel(q, k, v, off)
    out.float().square().sum().backward()
    refs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, off.cpu())
    ref.square().sum().backward()
    assert _rel(out.detach(), ref.detach()) < 1e-2
    for mine, theirs in zip((q, k, v), refs, strict=True):
        assert _rel(mine.grad, theirs.grad) < 2e-2


def test_long_sequence_64k_matches_sdpa():
    """A 65K-token sequence next to short and empty ones, against SDPA's flash kernel per sequence."""
    import torch.nn.functional as F
    from gemzoo_jfa import jfa_triton

    lens = torch.tensor([65_600, 0, 37, 1000])
    off = lengths_to_offsets(lens).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(int(lens.sum()), 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for _ in range(3))
    out = jfa_triton(q, k, v, off)
    grad = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    out.backward(grad)
    starts = off.tolist()
    for b in range(len(lens)):
        s, e = starts[b], starts[b + 1]
        if s == e:
            continue
        qs, ks, vs = (t.detach()[s:e].transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        ref.backward(grad[s:e].transpose(0, 1).unsqueeze(0))
        assert _rel(out.detach()[s:e], ref.detach()[0].transpose(0, 1)) < 1e-2
        for mine, theirs in zip((q, k, v), (qs, ks, vs), strict=True):
            assert _rel(mine.grad[s:e], theirs.grad[0].transpose(0, 1)) < 2e-2


@pytest.mark.parametrize("tma", [None, False], ids=["default", "pointer-loads"])
@pytest.mark.parametrize("d,causal,asym,window,dtype", [(128, True, False, None, torch.bfloat16),
                                                        (64, True, True, 77, torch.float16)])
def test_tma_and_pointer_paths_agree_with_reference(tma, d, causal, asym, window, dtype):
    check_against_fp64_poisoned(d, causal, asym, window, dtype, KernelOptions(tma=tma))


@pytest.mark.parametrize("d,causal,asym,window,dtype", [CASES[0], CASES[1], CASES[2], CASES[5], CASES[7]],
                         ids=["bf16-causal", "bf16-full", "bf16-asym", "bf16-window", "fp32"])
def test_fused_dq_matches_reference(d, causal, asym, window, dtype):
    """dQ inside the dk/dv kernel (fp32 atomics), poisoned outputs, against fp64."""
    check_against_fp64_poisoned(d, causal, asym, window, dtype, KernelOptions(fused_dq=True))


def test_strided_offsets_view_on_cuda():
    """A strided offsets view (t[::2]) gives the same result as contiguous offsets."""
    from gemzoo_jfa import jfa_triton

    lens = torch.tensor([300, 0, 17, 129, 1])
    off = lengths_to_offsets(lens).cuda()
    strided = torch.stack([off, torch.full_like(off, 10**6)], 1).reshape(-1)[::2]
    assert not strided.is_contiguous() and torch.equal(strided, off)
    q, k, v = (torch.randn(int(lens.sum()), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), off.cpu())
    assert _rel(jfa_triton(q, k, v, strided, strided), ref) < 1e-2
    assert _rel(jfa_triton(q, k, v, strided), ref) < 1e-2


# Grouped k/v (GQA, MQA) on the GPU paths (TMA, buckets, fused dQ where they apply), against the fp64 reference
LONG_Q, LONG_K = [300, 0, 17, 129, 64, 1], [280, 5, 40, 129, 10, 0]
SHORT_Q = [5, 0, 37, 16, 3, 20, 64, 1] * 4  # a short batch: length buckets
GQA_GPU_CASES = {
    "gqa8x2-d128-causal-bf16": dict(q_lens=LONG_Q, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16),
    "mqa8x1-d64-asym-full-bf16": dict(q_lens=LONG_Q, k_lens=LONG_K, heads=8, kv_heads=1, head_dim=64, causal=False,
                                      dtype=torch.bfloat16),
    "gqa4x2-d256-bf16": dict(q_lens=LONG_Q, head_dim=256, dtype=torch.bfloat16),
    "gqa4x2-d50-window-fp32": dict(q_lens=LONG_Q, head_dim=50, window=33, dtype=torch.float32),
    "gqa8x2-fused-dq-bf16": dict(q_lens=LONG_Q, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                                 options=KernelOptions(fused_dq=True)),
    "gqa8x2-short-buckets-bf16": dict(q_lens=SHORT_Q, heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16),
    "gqa4x2-relative-bias-bf16": dict(q_lens=LONG_Q, head_dim=64, relative_bias=True, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(GQA_GPU_CASES))
def test_grouped_query_against_fp64_reference(name):
    from gemzoo_jfa import jfa_triton

    from gemzoo.testing.attention import assert_errors_within, grouped_query_errors

    kw = dict(GQA_GPU_CASES[name])
    dtype = kw.pop("dtype")
    errors = grouped_query_errors(jfa_triton, device="cuda", dtype=dtype, **kw)
    assert_errors_within(errors, TOL[dtype], name)


# -- the fp8 forward (KernelOptions.fp8; jfa-fp8) ------------------------------------------------------------

FP8_CASES = [  # (head dim, causal, asymmetric, window, mode)
    (128, True, False, None, "qkv"), (128, True, False, None, "qk"), (64, False, True, None, "qkv"),
    (128, True, True, 200, "qkv"), (256, True, False, None, "qkv"), (96, False, False, None, "qk"),
]


def _fp8_norm(out, ref, v):
    """RMS error over v's RMS (a softmax output is a convex combination of v's rows)."""
    d = out.double().cpu() - ref.double().cpu()
    return float(d.pow(2).mean().sqrt() / v.double().cpu().pow(2).mean().sqrt())


@pytest.mark.parametrize("d,causal,asym,window,mode", FP8_CASES)
def test_fp8_forward_against_fp64_poisoned(d, causal, asym, window, mode):
    """Mixed lengths with empty sequences, bf16 inputs, outputs poisoned: the fp8 forward within 2e-2 (normalised)
    of fp64, and the backward (family.backward, which recomputes out and lse in bf16) equal to bf16 jfa's."""
    from gemzoo_jfa.family import backward

    gen = torch.Generator().manual_seed(d + 7 * causal + 13 * asym)
    q_lens = _lengths(gen, 12, 900)
    k_lens = q_lens + torch.randint(0, 150, (12,), generator=gen) if asym else q_lens
    q_off, k_off = lengths_to_offsets(q_lens).cuda(), lengths_to_offsets(k_lens).cuda()
    q = torch.randn(int(q_lens.sum()), 4, d, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(int(k_lens.sum()), 4, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    grad = torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)
    scale, win = d ** -0.5, -1 if window is None else window
    opts = KernelOptions(fp8=mode)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, q.shape[0]), float("nan"), device="cuda")
    launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, lse, options=opts)
    assert torch.isfinite(out).all()
    ref = reference_attention(q.double(), k.double(), v.double(), q_off, k_off, causal=causal, window=window)
    assert _fp8_norm(out, ref, v) < 2e-2 and _rel(out, ref) < 6e-2
    fp8_grads = backward(grad, q, k, v, out, lse, q_off, k_off, causal, scale, win, options=opts)
    _, dq, dk, dv = run_poisoned(q, k, v, q_off, k_off, causal, window, grad)
    for mine, theirs in zip(fp8_grads, (dq, dk, dv), strict=True):
        assert torch.equal(mine, theirs)  # straight-through: the bf16 kernels on the saved inputs


@pytest.mark.parametrize("mode", ["qk", "qkv"])
def test_fp8_long_sequence_large_magnitudes(mode):
    """A 65,600-token sequence beside short and empty ones, inputs of magnitude 30 (logits in the thousands) and
    a v block past e4m3's range: finite, and the registered jfa-fp8 kernel trains through it."""
    from gemzoo.api import registry

    gen = torch.Generator(device="cuda").manual_seed(5)
    off = lengths_to_offsets(torch.tensor([65600, 0, 17, 300])).cuda()
    q, k, v = (torch.randn(65917, 4, 128, device="cuda", generator=gen).mul_(30.0).to(torch.bfloat16)
               .requires_grad_() for _ in range(3))
    with torch.no_grad():
        v[1000:1064] *= 1000.0
    out = registry.get("attention", "jfa-fp8")(q, k, v, off, causal=True, fp8=mode)
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("kw", [
    {"head_dim": 64, "max_len": 96},  # one length bucket per size class: short sequences take their own tiles
    {"head_dim": 128, "max_len": 700, "window": 100},
    {"head_dim": 64, "max_len": 300, "heads": 4, "kv_heads": 2},
    {"head_dim": 64, "max_len": 400, "cross": True, "causal": False},
], ids=["short", "window", "gqa", "cross"])
def test_cuda_graph_replays_new_lengths(kw):
    """Forward and backward recorded in a CUDA graph, replayed on new lengths in the same buffers: the
    schedules are rebuilt inside the graph and nothing waits for the device during capture."""
    from gemzoo_jfa import jfa_attention

    from gemzoo.testing.attention import assert_errors_within, cuda_graph_errors

    assert_errors_within(cuda_graph_errors(jfa_attention, **kw), 1e-2, f"jfa under a CUDA graph {kw}")


def test_compiled_reduce_overhead_captures_the_op():
    """torch.compile(mode="reduce-overhead") records a layer that calls jfa into its CUDA graphs (no skip), a
    later call replays the graph (a cudaGraphLaunch, no kernel of ours launched on its own), and its output
    matches eager."""
    from gemzoo_jfa import jfa_attention
    from torch._dynamo.utils import counters

    lens = torch.tensor([0, 200, 7, 0, 64, 333])
    off = lengths_to_offsets(lens).cuda()
    proj = torch.nn.Linear(128, 3 * 128, device="cuda", dtype=torch.bfloat16)

    def layer(x, offsets):
        q, k, v = proj(x).view(x.shape[0], 3, 2, 64).unbind(1)
        return jfa_attention(q, k, v, offsets).sum(1)

    x = torch.randn(int(lens.sum()), 128, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            got = compiled(x, off).clone()
        want = layer(x, off)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled(x, off)
            torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert _rel(got, want) < 1e-2
    names = [e.name for e in prof.events()]
    assert "cudaGraphLaunch" in names, sorted(set(names))[:40]
    assert "attn_fwd_kernel" in names, "the graph's kernels ran"
    assert not any(n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx") for n in names), \
        "a kernel was launched outside the graph"


def test_schedules_are_cached_on_the_default_stream_only():
    """A batch's schedule is built once on the default stream; on a side stream (a CUDA graph's capture,
    torch.compile's "reduce-overhead" mode) it is built again, never taken from the cache."""
    from gemzoo_jfa.schedule import build_schedule

    off = lengths_to_offsets(torch.tensor([0, 300, 5, 77])).cuda()
    args = (off, off, int(off[-1]), 64)
    first = build_schedule(*args, over="q", causal=True, window=None)
    assert build_schedule(*args, over="q", causal=True, window=None) is first
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = build_schedule(*args, over="q", causal=True, window=None)
    torch.cuda.current_stream().wait_stream(side)
    assert again is not first and torch.equal(again, first)


@pytest.mark.parametrize("over", ["q", "k"])
def test_triton_schedule_matches_torch(over):
    """On the GPU the schedule is two Triton launches; it equals the torch builder's (run on the CPU) item for
    item, on 2,000 sequences of 0-5,000 tokens, in every mask and order."""
    from gemzoo_jfa.schedule import _build_triton, build_schedule_torch, schedules_match

    gen = torch.Generator().manual_seed(5)
    lq = torch.randint(0, 5000, (2000,), generator=gen) // torch.randint(1, 40, (2000,), generator=gen)
    lq[torch.rand(2000, generator=gen) < 0.1] = 0
    lk = lq.flip(0)
    qo, ko = lengths_to_offsets(lq), lengths_to_offsets(lk)
    total = int((lq if over == "q" else lk).sum())
    for causal, window, block_size, order, bucket, splits in [
            (True, None, None, "lpt", None, 0), (False, None, None, "lpt", None, 0),
            (True, 100, None, "lpt", (64, None), 0), (True, None, 64, "lpt", (0, 64), 0),
            (False, None, None, "natural", None, 0), (False, None, None, "lpt", None, 3 if over == "q" else 0)]:
        args = (total, 64, over, causal, window, order, block_size, bucket, splits)
        assert schedules_match(_build_triton(qo.cuda(), ko.cuda(), *args).cpu(), build_schedule_torch(qo, ko, *args)), args
