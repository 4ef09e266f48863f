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
}


def gqa_cases() -> dict:
    from functools import partial

    from gemzoo_jfa import jfa_triton

    from gemzoo.testing.attention import grouped_query_errors

    out = {}
    for name, kw in GQA_CASES.items():
        kw = dict(kw)
        fn = partial(jfa_triton, options=kw.pop("options", None))
        out[name] = grouped_query_errors(fn, **kw)
    return out


def main(which: str) -> None:
    from gemzoo.testing.interpreter import print_group

    print_group({"cases": all_cases, "conformance": conformance, "gqa": gqa_cases,
                 "compile": lambda: {"compile": compile_check(), "opcheck": opcheck()}}, which)


if __name__ == "__main__":
    main(sys.argv[1])
