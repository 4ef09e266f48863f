"""Run the Triton kernels under TRITON_INTERPRET=1 on tiny shapes; print one JSON line of results.

Run as a subprocess by test_interpreter.py, so the variable is set before Triton is first imported.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a script run: switch the interpreter on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from gemzoo_jfa.family import Bucket, Configs, KernelConfig, KernelOptions  # noqa: E402

from gemzoo.api import (
    lengths_to_offsets,  # noqa: E402
    reference_attention,  # noqa: E402
)

# (name, q lengths, k lengths or None, causal, window, head dim, value head dim, dtype)
CASES = [
    ("causal", [5, 0, 37, 16], None, True, None, 32, 32, "float32"),
    ("full", [5, 0, 37, 16], None, False, None, 32, 32, "float32"),
    ("asym-causal", [5, 0, 37, 16], [9, 4, 20, 40], True, None, 32, 32, "float32"),
    ("asym-full", [5, 0, 37, 16], [9, 4, 20, 40], False, None, 32, 32, "float32"),
    ("window", [5, 0, 37, 16], None, True, 7, 32, 32, "float32"),
    ("asym-window", [5, 0, 37, 16], [9, 4, 20, 40], True, 5, 32, 32, "float32"),
    ("full-window-emptyk", [5, 3, 37, 16], [0, 4, 20, 40], False, 9, 32, 32, "float32"),
    ("causal-lk<lq", [30, 17], [3, 17], True, None, 16, 16, "float32"),
    ("d24-dv16", [21, 0, 9], None, True, None, 24, 16, "float32"),
    ("bf16", [33, 0, 20], None, True, None, 32, 32, "bfloat16"),
    ("fp16", [33, 20, 0], None, False, None, 32, 32, "float16"),
]


# Length buckets on the interpreter: 32 x 32 main tiles, sequences of at most 16 tokens on 16 x 16 tiles.
_BIG, _SMALL = KernelConfig(32, 32, 1, 1), KernelConfig(16, 16, 1, 1)
BUCKETED = dict(configs=Configs(_BIG, _BIG, _BIG), buckets=(Bucket(16, Configs(_SMALL, _SMALL, _SMALL)),))


def run_case(q_lens, k_lens, causal, window, d, dv, dtype, order="lpt", tma=False, buckets=False, fused_dq=False):
    from gemzoo_jfa import jfa_triton

    gen = torch.Generator().manual_seed(hash((tuple(q_lens), causal, window, d)) % 2**31)
    q_lens = torch.tensor(q_lens)
    k_lens = q_lens if k_lens is None else torch.tensor(k_lens)
    q_off, k_off = lengths_to_offsets(q_lens), lengths_to_offsets(k_lens)
    h = 2
    dt = getattr(torch, dtype)
    q = torch.randn(int(q_lens.sum()), h, d, generator=gen).to(dt).requires_grad_()
    k = torch.randn(int(k_lens.sum()), h, d, generator=gen).to(dt).requires_grad_()
    v = torch.randn(int(k_lens.sum()), h, dv, generator=gen).to(dt).requires_grad_()
    kw = dict(causal=causal, window=window)
    options = KernelOptions(order=order, tma=tma, fused_dq=fused_dq, **(BUCKETED if buckets else {}))
    out = jfa_triton(q, k, v, q_off, k_off, **kw, options=options)
    grad = torch.randn(out.shape, generator=gen).to(dt)
    out.backward(grad)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off, k_off, **kw)
    ref.backward(grad.double())
    errors = {}
    for name, mine, theirs in (("out", out, ref), ("dq", q.grad, refs[0].grad), ("dk", k.grad, refs[1].grad),
                               ("dv", v.grad, refs[2].grad)):
        mine, theirs = mine.detach().double(), theirs.detach()
        errors[name] = float((mine - theirs).norm() / theirs.norm().clamp_min(1e-6))
        errors[name + "_finite"] = bool(torch.isfinite(mine).all())
    errors["dtype_ok"] = out.dtype == dt and q.grad.dtype == dt
    return errors


def conformance():
    """The shared gemzoo conformance suite, run on the Triton path itself (CPU tensors, interpreter)."""
    from gemzoo_jfa import jfa_triton
    from gemzoo_jfa.ops import KERNEL

    from gemzoo.testing.interpreter import conformance_results

    return conformance_results(jfa_triton, KERNEL.capabilities)


def compile_check():
    """torch.compile(fullgraph=True) traces the custom op (fake impl + autograd), then runs it."""
    from gemzoo_jfa import jfa_triton

    from gemzoo.testing.interpreter import compiled_matches_eager

    lens = torch.tensor([7, 0, 19])
    off = lengths_to_offsets(lens)
    q, k, v = (torch.randn(26, 2, 16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return jfa_triton(q, k, v, off, causal=True).square().sum()

    return {"ok": compiled_matches_eager(f, q, k, v)}


def opcheck():
    from gemzoo_jfa.ops import jfa_fwd

    off = lengths_to_offsets(torch.tensor([5, 0, 11]))
    q, k, v = (torch.randn(16, 2, 16, requires_grad=True) for _ in range(3))
    torch.library.opcheck(jfa_fwd, (q, k, v, off, off, True, 0.25, -1, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    return {"ok": True}


def all_cases() -> dict:
    res = {name: run_case(*args) for name, *args in CASES}
    res["natural-order"] = run_case([5, 0, 37, 16], [9, 4, 20, 40], True, 5, 32, 32, "float32", order="natural")
    res["tma-asym-window"] = run_case([5, 0, 37, 16], [9, 4, 20, 40], True, 5, 32, 32, "float32", tma=True)
    res["tma-full"] = run_case([21, 0, 40], [33, 7, 18], False, None, 16, 16, "bfloat16", tma=True)
    short = [5, 0, 37, 16, 3, 20]  # 5, 0, 16, 3 in the 16-token bucket; 37 and 20 on the main tiles
    res["buckets-causal"] = run_case(short, None, True, None, 32, 32, "float32", buckets=True)
    res["buckets-asym-window"] = run_case(short, [9, 4, 20, 40, 2, 14], True, 5, 32, 32, "float32", buckets=True)
    res["buckets-full-emptyk"] = run_case(short, [0, 4, 20, 40, 2, 0], False, None, 32, 32, "float32", buckets=True)
    res["buckets-tma-bf16"] = run_case(short, None, True, None, 32, 32, "bfloat16", tma=True, buckets=True)
    # dQ inside the dk/dv kernel (fp32 atomics)
    res["fused-dq-causal"] = run_case([5, 0, 37, 16], None, True, None, 32, 32, "float32", fused_dq=True)
    res["fused-dq-asym-window"] = run_case([5, 0, 37, 16], [9, 4, 20, 40], True, 5, 32, 32, "float32", fused_dq=True)
    res["fused-dq-full-emptyk"] = run_case([5, 3, 37, 16], [0, 4, 20, 40], False, 9, 32, 32, "float32",
                                           fused_dq=True)
    res["fused-dq-d24-dv16"] = run_case([21, 0, 9], None, True, None, 24, 16, "float32", fused_dq=True)
    res["fused-dq-tma-buckets-bf16"] = run_case(short, None, True, None, 32, 32, "bfloat16", tma=True, buckets=True,
                                                fused_dq=True)
    return res


# Grouped k/v (GQA 4 over 2 and 6 over 3, MQA 4 over 1), head dims 256 and 50: name -> grouped_query_errors
# keywords (``options``: a KernelOptions for jfa_triton only)
Q4, K4 = [5, 0, 37, 16], [9, 4, 20, 40]
GQA_CASES = {
    "gqa4x2-causal": dict(q_lens=Q4),
    "mqa4x1-asym-full": dict(q_lens=Q4, k_lens=K4, kv_heads=1, causal=False),
    "gqa6x3-asym-window": dict(q_lens=Q4, k_lens=K4, heads=6, kv_heads=3, window=5),
    "gqa4x2-d256": dict(q_lens=[5, 0, 20], head_dim=256),
    "mqa4x1-d50-window": dict(q_lens=Q4, kv_heads=1, head_dim=50, window=7),
    "gqa4x2-relative-bias": dict(q_lens=Q4, relative_bias=True),
    "gqa4x2-fused-dq": dict(q_lens=Q4, k_lens=K4, options=KernelOptions(fused_dq=True)),
    "gqa4x2-buckets": dict(q_lens=[5, 0, 37, 16, 3, 20], options=KernelOptions(**BUCKETED)),
    "gqa4x2-tma-asym-window": dict(q_lens=Q4, k_lens=K4, window=5, options=KernelOptions(tma=True)),
    "mqa4x1-tma-fused-dq": dict(q_lens=Q4, kv_heads=1, options=KernelOptions(tma=True, fused_dq=True)),
}


def gqa_cases() -> dict:

    from gemzoo_jfa import jfa_triton

    from gemzoo.testing.attention import grouped_query_errors

    return {name: grouped_query_errors(jfa_triton, **kw) for name, kw in GQA_CASES.items()}


# -- the fp8 forward (KernelOptions.fp8) -------------------------------------------------------------
# Triton 3.x's interpreter runs tl.dot on e4m3 operands (exactly: it widens them to fp16), but its fp32 -> e4m3
# cast rounds wrongly (kernels._e4m3), so the kernels pre-round on the e4m3 grid there (EXACT / UPCAST): the
# interpreter runs the same e4m3 tiles and fp8 dots as the GPU, with correctly rounded values.

def fp8_errors(out, ref, v) -> dict:
    """rel: relative L2 to ``ref``; norm: RMS error over v's RMS (a softmax output is a convex combination of v's
    rows; the normalised error the 2e-2 bound is on); finite."""
    d = out.detach().double() - ref.detach().double()
    return {"rel": float(d.norm() / ref.norm().clamp_min(1e-12)),
            "norm": float(d.pow(2).mean().sqrt() / v.detach().double().pow(2).mean().sqrt()),
            "finite": bool(torch.isfinite(out).all())}


def fp8_case(mode, q_lens, k_lens=None, causal=True, window=None, d=32, dtype="float32", heads=2, kv_heads=2,
             **options):
    """KernelOptions(fp8=mode) forward against fp64, and its straight-through gradients against fp64 (the
    backward runs on the unquantised inputs, so they match as closely as the plain kernel's)."""
    from gemzoo_jfa import jfa_triton

    gen = torch.Generator().manual_seed(hash((mode, tuple(q_lens), causal, window, d, heads)) % 2**31)
    q_lens = torch.tensor(q_lens)
    k_lens = q_lens if k_lens is None else torch.tensor(k_lens)
    q_off, k_off = lengths_to_offsets(q_lens), lengths_to_offsets(k_lens)
    dt = getattr(torch, dtype)
    q = torch.randn(int(q_lens.sum()), heads, d, generator=gen).to(dt).requires_grad_()
    k = torch.randn(int(k_lens.sum()), kv_heads, d, generator=gen).to(dt).requires_grad_()
    v = torch.randn(int(k_lens.sum()), kv_heads, d, generator=gen).to(dt).requires_grad_()
    out = jfa_triton(q, k, v, q_off, k_off, causal=causal, window=window, options=KernelOptions(fp8=mode, **options))
    grad = torch.randn(out.shape, generator=gen).to(dt)
    out.backward(grad)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off, k_off, causal=causal, window=window)
    ref.backward(grad.double())
    res = fp8_errors(out, ref, v)
    for name, mine, theirs in (("dq", q.grad, refs[0].grad), ("dk", k.grad, refs[1].grad),
                               ("dv", v.grad, refs[2].grad)):
        res[name] = float((mine.double() - theirs).norm() / theirs.norm().clamp_min(1e-12))
        res["finite"] = res["finite"] and bool(torch.isfinite(mine).all())
    res["dtype_ok"] = out.dtype == dt
    return res


FP8_CASES = {
    "causal-empty": dict(q_lens=[5, 0, 37, 16]),
    "asym-full": dict(q_lens=[5, 0, 37, 16], k_lens=[9, 4, 20, 40], causal=False),
    "asym-window-nokeys": dict(q_lens=[5, 3, 37, 16], k_lens=[0, 4, 20, 40], window=5),
    "gqa4x2-d24": dict(q_lens=[5, 0, 37, 16], heads=4, kv_heads=2, d=24),
    "buckets": dict(q_lens=[5, 0, 37, 16, 3, 20], **BUCKETED),
    "tma": dict(q_lens=[5, 0, 37, 16], k_lens=[9, 4, 20, 40], tma=True),
    "bf16": dict(q_lens=[33, 0, 20], dtype="bfloat16"),
}


def fp8_quantizer() -> dict:
    """The Triton quantiser (interpreter) against the torch rule, bit for bit: blocks from each sequence's start,
    an all-zero block, magnitudes from 1e-6 to 1e4, a non-power-of-two head dim, the transposed layout."""
    from gemzoo_jfa.family import quantize_fp8, quantize_fp8_reference

    gen = torch.Generator().manual_seed(5)
    out = {}
    for name, lens, d, block in (("mixed", [5, 0, 37, 16], 32, 16), ("d24-block8", [9, 1, 30], 24, 8)):
        off = lengths_to_offsets(torch.tensor(lens))
        t = int(off[-1])
        x = torch.randn(t, 2, d, generator=gen) * torch.logspace(-6, 4, t)[:, None, None]
        x[5:21] = 0  # the third sequence's first block all zero
        x[7, 1, 3] = float("nan")  # stays NaN in its element; its row's scale is NaN
        y, s = quantize_fp8(x, off, block)
        yt, st = quantize_fp8(x, off, block, transpose=True)
        yr, sr = quantize_fp8_reference(x, off, block)
        # values compared as floats (the interpreter casts -0.0 to +0.0) with NaN in the same places
        out[name] = {"values": bool(torch.equal(y.float().nan_to_num(7.0), yr.float().nan_to_num(7.0))),
                     "transposed": bool(torch.equal(yt.permute(2, 0, 1).float().nan_to_num(7.0),
                                                    yr.float().nan_to_num(7.0))),
                     "nan_kept": bool(torch.isnan(y[7, 1, 3].float()) and torch.isnan(s[1, 7])
                                      and torch.isfinite(s[0]).all()),
                     "scales": bool(torch.equal(s.nan_to_num(7.0), sr.nan_to_num(7.0)) and torch.equal(
                         st.nan_to_num(7.0), sr.nan_to_num(7.0)))}
    return out


def fp8_poisoned_and_nan() -> dict:
    """Outputs poisoned with NaN before the fp8 forward (every row is written: equal to a fresh launch); a NaN in
    one sequence's q reaches its rows and no other sequence."""
    from gemzoo_jfa import jfa_triton
    from gemzoo_jfa.family import launch_fwd

    gen = torch.Generator().manual_seed(9)
    lens = torch.tensor([5, 0, 37, 16])
    off = lengths_to_offsets(lens)
    q, k, v = (torch.randn(58, 2, 32, generator=gen) for _ in range(3))
    res = {}
    for mode in ("qk", "qkv"):
        opt = KernelOptions(fp8=mode)
        fresh = jfa_triton(q, k, v, off, causal=True, options=opt)
        out = torch.full_like(fresh, float("nan"))
        lse = torch.full((2, 58), float("nan"))
        launch_fwd(q, k, v, off, off, True, 32 ** -0.5, -1, out, lse, options=opt)
        res[f"{mode}-poisoned"] = bool(torch.equal(out, fresh)) and bool(torch.isfinite(lse).all())
        bad = q.clone()
        bad[30, 0, 3] = float("nan")  # sequence 2 (tokens 5..41), row 25
        o = jfa_triton(bad, k, v, off, causal=True, options=opt)
        res[f"{mode}-nan-row"] = bool(torch.isnan(o[30, 0]).all())
        res[f"{mode}-nan-others"] = bool(torch.equal(o[:5], fresh[:5]) and torch.equal(o[42:], fresh[42:])
                                         and torch.equal(o[:, 1], fresh[:, 1]))
    return res


def fp8_long() -> dict:
    """A longer sequence (300 tokens, beside an empty one) of large-magnitude inputs: k and v blocks from 1e-2
    to 1e4 (v past e4m3's 448, so only the scales bring it in range), an all-zero block, q scaled so the logits
    stay of order 1 (fp8's logit error grows with the logits: at order 3 the output was 9% off); and q, k of 1e3
    (logits ~1e6, one-hot rows: finite only)."""
    from gemzoo_jfa import jfa_triton

    gen = torch.Generator().manual_seed(13)
    off = lengths_to_offsets(torch.tensor([300, 0]))
    spread = torch.logspace(-2, 4, 19)[torch.randperm(19, generator=gen)].repeat_interleave(16)[:300, None, None]
    k = torch.randn(300, 2, 32, generator=gen) * spread
    v = torch.randn(300, 2, 32, generator=gen) * spread
    q = torch.randn(300, 2, 32, generator=gen) / spread.max()
    k[32:48] = 0
    v[32:48] = 0
    ref = reference_attention(q.double(), k.double(), v.double(), off, off, causal=True)
    res = {mode: fp8_errors(jfa_triton(q, k, v, off, causal=True, options=KernelOptions(fp8=mode)), ref, v)
           for mode in ("qk", "qkv")}
    big = [torch.randn(300, 2, 32, generator=gen) * 1e3 for _ in range(3)]
    for mode in ("qk", "qkv"):
        res[f"{mode}-huge-finite"] = bool(torch.isfinite(jfa_triton(*big, off, causal=True,
                                                                    options=KernelOptions(fp8=mode))).all())
    return res


def fp8_group() -> dict:
    res = {f"{mode}-{name}": fp8_case(mode, **kw) for name, kw in FP8_CASES.items() for mode in ("qk", "qkv")}
    return {"cases": res, "quantizer": fp8_quantizer(), "poisoned": fp8_poisoned_and_nan(), "long": fp8_long()}


def schedule_cases(trials: int = 300) -> dict:
    """The Triton schedule builder against the torch one on random jagged batches (zero-length sequences, Lq
    above and below Lk, every mask, bucket, order and split): name -> whether every item matches."""
    import random

    from gemzoo_jfa.schedule import _build_triton, build_schedule_torch, schedules_match

    rng = random.Random(0)
    res = {}
    for trial in range(trials):
        batch = rng.choice([1, 2, 3, 7, 20, 70])
        lq = [rng.choice([0, 1, 5, 16, 33, 64, 100, 200]) for _ in range(batch)]
        lk = list(lq) if rng.random() < 0.4 else [rng.choice([0, 3, 17, 64, 150, 300]) for _ in range(batch)]
        over = rng.choice("qk")
        args = (sum(lq) if over == "q" else sum(lk), rng.choice([16, 32, 64]), over, rng.random() < 0.6,
                rng.choice([None, None, 7, 40]), rng.choice(["lpt", "natural"]), rng.choice([None, None, 16, 32]),
                rng.choice([None, None, (0, 64), (64, None), (16, 128)]), rng.choice([0, 0, 2, 3]) if over == "q" else 0)
        qo, ko = lengths_to_offsets(torch.tensor(lq)), lengths_to_offsets(torch.tensor(lk))
        res[f"{trial}: {args}"] = schedules_match(_build_triton(qo, ko, *args), build_schedule_torch(qo, ko, *args))
    return res


def main(which: str) -> None:
    from gemzoo.testing.interpreter import print_group

    print_group({"cases": all_cases, "conformance": conformance, "gqa": gqa_cases, "fp8": fp8_group,
                 "schedule": schedule_cases,
                 "compile": lambda: {"compile": compile_check(), "opcheck": opcheck()}}, which)


if __name__ == "__main__":
    main(sys.argv[1])
