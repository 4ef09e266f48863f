"""The relative attention bias (``gemzoo.api.RelativeAttentionBias``) in the jfa family's Triton kernels under
TRITON_INTERPRET=1 on tiny shapes; prints one JSON line of results (run as a subprocess by
test_relative_bias_interpreter.py, so the variable is set before Triton is first imported).

Every case launches into NaN-poisoned outputs and gradients and compares out, dq, dk, dv and the gradients of
both tables against the fp64 reference, on jagged batches with empty sequences.
"""

from __future__ import annotations

import os
import sys
import zlib

if __name__ == "__main__":  # a script run: switch the interpreter on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from rb_cases import errors, make_inputs, reference, rel_err, run_family  # noqa: E402

Q4, K4 = [5, 0, 37, 16], [9, 4, 20, 40]

# name -> (activation, q lengths, k lengths or None, causal, window, norm, timed, n_pos, n_buckets, dtype,
#          KernelOptions fields)
CASES = {
    "silu-causal-pos": ("silu", Q4, None, True, None, 16.0, False, 24, 0, "float32", {}),
    "silu-causal-time": ("silu", Q4, None, True, None, 16.0, True, 24, 40, "float32", {}),
    "silu-asym-causal-time": ("silu", Q4, K4, True, None, 8.0, True, 50, 40, "float32", {}),
    "gelu-asym-full-time": ("gelu", Q4, K4, False, None, None, True, 30, 40, "float32", {}),
    "silu-window-time": ("silu", Q4, None, True, 7, 16.0, True, 24, 40, "float32", {}),
    "relu-lk<lq-causal-time": ("relu", [30, 17], [3, 17], True, None, 4.0, True, 8, 12, "float32", {}),
    "identity-emptyk-window-time": ("identity", [5, 3, 37, 16], [0, 4, 20, 40], False, 9, 3.0, True, 40, 40,
                                    "float32", {}),
    "silu-emptyq-both-time": ("silu", [0, 6, 0], [4, 0, 0], False, None, None, True, 4, 5, "float32", {}),
    "silu-tiny-tables": ("silu", Q4, None, True, None, 16.0, True, 1, 0, "float32", {}),
    "silu-bf16-time": ("silu", [33, 0, 20], None, True, None, 16.0, True, 24, 40, "bfloat16", {}),
    "split-silu-cross-time": ("silu", [3, 0, 8, 5], [70, 9, 0, 45], False, None, None, True, 80, 40, "float32",
                              {"split": 4}),
    "fused-dq-silu-time": ("silu", Q4, K4, True, 5, 4.0, True, 24, 40, "float32", {"fused_dq": True}),
    "tma-silu-time": ("silu", Q4, K4, True, None, 4.0, True, 24, 40, "float32", {"tma": True}),
    "softmax-causal-time": ("softmax", Q4, None, True, None, None, True, 24, 40, "float32", {}),
    "softmax-asym-window-pos": ("softmax", Q4, K4, True, 6, None, False, 10, 0, "float32", {}),
}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def run_case(act, q_lens, k_lens, causal, window, norm, timed, n_pos, n_buckets, dtype, opts) -> dict:
    from gemzoo_jfa.family import KernelOptions

    gen = torch.Generator().manual_seed(zlib.crc32(repr((act, q_lens, k_lens, causal, window, timed)).encode()))
    inputs = make_inputs(gen, q_lens, k_lens, 2, 16, 16, getattr(torch, dtype), n_pos, n_buckets, timed)
    scale = 16 ** -0.5 * 2.0
    got = run_family(*inputs, act, causal, window, scale, norm, KernelOptions(**opts))
    res = errors(got, reference(*inputs, act, causal, window, scale, norm))
    res["tol"] = TOL[dtype]
    return res


def entry():
    """gdpa_triton(relative_bias=...): eager autograd (tables included) and the no-grad forward against the
    reference; torch.compile(fullgraph) against eager; opcheck of the custom op."""
    from gemzoo_gdpa import gdpa_triton
    from gemzoo_gdpa.ops import gdpa_fwd_rb

    from gemzoo.api import RelativeAttentionBias
    from gemzoo.testing.interpreter import compiled_matches_eager

    gen = torch.Generator().manual_seed(11)
    q, k, v, grad, q_off, k_off, rb = make_inputs(gen, [7, 0, 19], None, 2, 16, 16, torch.float32, 12, 30, True)
    want = reference(q, k, v, grad, q_off, k_off, rb, "silu", True, None, 0.25, 19.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, rb.positions, rb.time_weights)]
    rb_leaf = RelativeAttentionBias(leaves[3], leaves[4], rb.q_times, rb.k_times)
    out = gdpa_triton(*leaves[:3], q_off, causal=True, activation="silu", scale=0.25, norm=19.0,
                      relative_bias=rb_leaf)
    out.backward(grad)
    res = {"eager": {n: rel_err(g, w) for n, g, w in zip(("out", "dq", "dk", "dv", "dpos", "dtw"),
                                                            [out.detach()] + [t.grad for t in leaves], want,
                                                            strict=True)}}
    with torch.no_grad():
        res["no_grad_out"] = rel_err(gdpa_triton(q, k, v, q_off, causal=True, activation="silu", scale=0.25,
                                                 norm=19.0, relative_bias=rb), want[0])
    pos_only = RelativeAttentionBias(leaves[3])
    for t in leaves:
        t.grad = None

    def loss(q, k, v, pos, tw):
        timed = RelativeAttentionBias(pos, tw, rb.q_times, rb.k_times)
        a = gdpa_triton(q, k, v, q_off, causal=True, activation="silu", norm=19.0, relative_bias=timed)
        b = gdpa_triton(q, k, v, q_off, causal=False, activation="gelu", relative_bias=RelativeAttentionBias(pos))
        return a.square().sum() + b.sum()

    res["compile"] = compiled_matches_eager(loss, *leaves)
    torch.library.opcheck(gdpa_fwd_rb, (*leaves[:3], q_off, q_off, leaves[3], leaves[4], rb.q_times, rb.k_times,
                                        True, 1, 0.25, 0.5, -1, 0.301, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(gdpa_fwd_rb, (*leaves[:3], q_off, q_off, pos_only.positions, None, None, None,
                                        False, 2, 0.25, 1.0, 5, 0.301, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    res["opcheck"] = True
    return res


def entry_jfa():
    """jfa_triton(relative_bias=...) (softmax on the same kernels): eager autograd against the reference,
    torch.compile(fullgraph) against eager, opcheck of its custom op."""
    from gemzoo_jfa import jfa_triton
    from gemzoo_jfa.ops import jfa_fwd_rb

    from gemzoo.api import RelativeAttentionBias
    from gemzoo.testing.interpreter import compiled_matches_eager

    gen = torch.Generator().manual_seed(12)
    q, k, v, grad, q_off, k_off, rb = make_inputs(gen, [7, 0, 19], [9, 3, 19], 2, 16, 16, torch.float32, 12, 30,
                                                  True)
    want = reference(q, k, v, grad, q_off, k_off, rb, "softmax", True, None, 0.5, None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, rb.positions, rb.time_weights)]
    out = jfa_triton(*leaves[:3], q_off, k_off, scale=0.5,
                     relative_bias=RelativeAttentionBias(leaves[3], leaves[4], rb.q_times, rb.k_times))
    out.backward(grad)
    res = {"eager": {n: rel_err(g, w) for n, g, w in zip(("out", "dq", "dk", "dv", "dpos", "dtw"),
                                                            [out.detach()] + [t.grad for t in leaves], want,
                                                            strict=True)}}
    for t in leaves:
        t.grad = None

    def loss(q, k, v, pos, tw):
        timed = RelativeAttentionBias(pos, tw, rb.q_times, rb.k_times)
        return (jfa_triton(q, k, v, q_off, k_off, relative_bias=timed).square().sum()
                + jfa_triton(q, k, v, q_off, k_off, causal=False, relative_bias=RelativeAttentionBias(pos)).sum())

    res["compile"] = compiled_matches_eager(loss, *leaves)
    torch.library.opcheck(jfa_fwd_rb, (*leaves[:3], q_off, k_off, leaves[3], leaves[4], rb.q_times, rb.k_times,
                                       True, 0.25, -1, 0.301, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    res["opcheck"] = True
    return res


def main(which: str) -> None:
    from gemzoo.testing.interpreter import print_group

    print_group({"cases": lambda: {name: run_case(*args) for name, args in CASES.items()}, "entry": entry,
                 "entry_jfa": entry_jfa}, which)


if __name__ == "__main__":
    main(sys.argv[1])
