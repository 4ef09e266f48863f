"""Run block-attention's Triton path under TRITON_INTERPRET=1 on tiny shapes; print one JSON line of results.

Run as a subprocess by test_interpreter.py, so the variable is set before Triton is first imported.
Every case launches into NaN-poisoned outputs and gradients (unwritten elements fail) and compares
forward and dq/dk/dv against the fp64 reference (which applies the same RoPE rule).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a script run: switch the interpreter on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from gemzoo.api import (  # noqa: E402
    ACTIVATION_CODES,
    lengths_to_offsets,  # noqa: E402
    reference_attention,
)

Q4, K4 = [5, 0, 37, 16], [9, 4, 20, 40]
PARTIAL = [37, 0, 20, 16]  # 37 and 20: last blocks partial for every block size below

# name -> (activation, q lengths, k lengths or None, causal, window, block, rope_theta, norm, D, Dv, dtype)
CASES = {
    "blk1-causal": ("softmax", PARTIAL, None, True, None, 1, None, None, 16, 16, "float32"),
    "blk1-full-asym": ("softmax", Q4, K4, False, None, 1, None, None, 16, 16, "float32"),
    "blk7-causal-partial": ("softmax", PARTIAL, None, True, None, 7, None, None, 16, 16, "float32"),
    "blk7-full-asym": ("softmax", Q4, K4, False, None, 7, None, None, 16, 16, "float32"),
    "blk16-lk<lq-causal": ("softmax", [30, 17], [3, 17], True, None, 16, None, None, 16, 16, "float32"),
    "blk16-lk<lq-full": ("softmax", [30, 17], [3, 17], False, None, 16, None, None, 16, 16, "float32"),
    "blk64-one-seq": ("softmax", [150], None, True, None, 64, None, None, 16, 16, "float32"),
    "blk128-full": ("softmax", [200, 0, 40], None, False, None, 128, None, None, 16, 16, "float32"),
    "blk7-win3-causal": ("softmax", PARTIAL, None, True, 3, 7, None, None, 16, 16, "float32"),
    "blk16-win5-full-asym": ("softmax", Q4, K4, False, 5, 16, None, None, 16, 16, "float32"),
    "win6-alone": ("softmax", PARTIAL, None, True, 6, None, None, None, 16, 16, "float32"),
    "rope-dense-causal": ("softmax", PARTIAL, None, True, None, None, 10000.0, None, 16, 16, "float32"),
    "rope-full-asym": ("softmax", Q4, K4, False, None, None, 100.0, None, 16, 16, "float32"),
    "rope-blk7-asym-causal": ("softmax", Q4, K4, True, None, 7, 100.0, None, 16, 16, "float32"),
    "rope-blk16-win9-full": ("softmax", PARTIAL, None, False, 9, 16, 10000.0, None, 16, 16, "float32"),
    "rope-blk8-d24-dv40": ("softmax", [21, 0, 9], None, True, None, 8, 500.0, None, 24, 40, "float32"),
    "rope-lk<lq": ("softmax", [30, 17], [3, 17], True, None, 4, 50.0, None, 16, 16, "float32"),
    "silu-blk7-rope": ("silu", Q4, K4, True, None, 7, 100.0, 16.0, 16, 16, "float32"),
    "gelu-blk16-win5-full": ("gelu", PARTIAL, None, False, 5, 16, None, None, 16, 16, "float32"),
    "relu2-blk1-asym": ("relu2", Q4, K4, False, None, 1, None, 4.0, 16, 16, "float32"),
    "zero-length": ("softmax", [0, 6, 0, 3], [4, 0, 0, 3], False, None, 2, 100.0, None, 16, 16, "float32"),
    "bf16-blk7-rope": ("softmax", [33, 0, 20], None, True, None, 7, 10000.0, None, 16, 16, "bfloat16"),
    "fp16-blk16-full": ("softmax", [33, 20, 0], None, False, None, 16, None, None, 16, 16, "float16"),
    # dQ inside the dk/dv kernel (fp32 atomics; with RoPE the atomic add un-rotates)
    "fused-dq-rope-blk7-asym-causal": ("softmax", Q4, K4, True, None, 7, 100.0, None, 16, 16, "float32", True),
    "fused-dq-silu-blk7-rope": ("silu", Q4, K4, True, None, 7, 100.0, 16.0, 16, 16, "float32", True),
}
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def run_poisoned(q, k, v, q_off, k_off, causal, window, block, rope, grad, code, scale, inv_norm, options):
    """Launch fwd and bwd (the ops' bodies) into NaN-filled buffers; return out, dq, dk, dv."""
    from gemzoo_jfa.family import launch_bwd, launch_fwd

    win, blk, theta = -1 if window is None else window, -1 if block is None else block, rope or 0.0
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan")) if code == 0 else None
    if q.shape[0]:
        launch_fwd(q, k, v, q_off, k_off, causal, scale, win, out, lse, code, inv_norm, blk, theta, options)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    launch_bwd(grad, q, k, v, out, lse, q_off, k_off, causal, scale, win, dq, dk, dv, code, inv_norm, blk, theta,
               options)
    return out, dq, dk, dv


def run_case(act, q_lens, k_lens, causal, window, block, rope, norm, d, dv, dtype, fused_dq=False):
    from gemzoo_jfa.family import KernelOptions

    gen = torch.Generator().manual_seed(abs(hash((act, tuple(q_lens), causal, window, block, d))) % 2**31)
    q_lens = torch.tensor(q_lens)
    k_lens = q_lens if k_lens is None else torch.tensor(k_lens)
    q_off, k_off = lengths_to_offsets(q_lens), lengths_to_offsets(k_lens)
    h, dt = 2, getattr(torch, dtype)
    tq, tk = int(q_lens.sum()), int(k_lens.sum())
    q, k = torch.randn(tq, h, d, generator=gen).to(dt), torch.randn(tk, h, d, generator=gen).to(dt)
    v, grad = torch.randn(tk, h, dv, generator=gen).to(dt), torch.randn(tq, h, dv, generator=gen).to(dt)
    scale = d ** -0.5 * 2.0
    got = run_poisoned(q, k, v, q_off, k_off, causal, window, block, rope, grad, ACTIVATION_CODES[act], scale,
                       1.0 if norm is None else 1.0 / norm, KernelOptions(fused_dq=fused_dq))
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, q_off, k_off, causal=causal, window=window, block_size=block,
                              rope_theta=rope, activation=act, scale=scale, norm=norm)
    if ref.requires_grad and ref.numel():
        ref.backward(grad.double())
    ref_grads = tuple(torch.zeros_like(r) if r.grad is None else r.grad for r in refs)
    res = {}
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), got, (ref.detach(),) + ref_grads, strict=True):
        # an all-(near-)zero reference (e.g. dq with one key per row): absolute error instead
        res[name] = float((mine.double() - theirs).abs().max()) if theirs.norm() < 1e-3 else _rel(mine, theirs)
        res[name + "_finite"] = bool(torch.isfinite(mine).all())
    res["tol"] = TOL[dtype]
    return res


def nan_stays_in_block():
    """Non-causal and causal block masks with tiles aligned to blocks (block 32, 16-row interpreter tiles):
    NaN in q, k and v of one block reaches no other block's outputs or gradients, so no tile of another
    block is ever loaded (0 * NaN would carry it), in forward, dk/dv and dq; also with window and RoPE."""
    from gemzoo_block_attention import block_attention_triton

    res = {}
    for tag, kw in (("full", dict(causal=False)), ("causal", dict(causal=True)),
                    ("causal-window-rope", dict(causal=True, window=20, rope_theta=100.0))):
        off = lengths_to_offsets(torch.tensor([96, 40]))
        gen = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(136, 2, 16, generator=gen) for _ in range(3))
        q[40, 0, 1] = k[50, 1, 2] = v[33, 0, 3] = float("nan")  # block 1 ([32, 64)) of sequence 0
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = block_attention_triton(*leaves, off, block_size=32, **kw)
        out.backward(torch.ones_like(out))
        blk = torch.zeros(136, dtype=torch.bool)
        blk[32:64] = True
        others = [t[~blk] for t in (out, q.grad, k.grad, v.grad)]
        res[tag] = {"others_finite": bool(all(torch.isfinite(t).all() for t in others)),
                    "own_nan": bool(torch.isnan(out[blk]).any() and torch.isnan(k.grad[blk]).any())}
    return res


def conformance():
    """The shared gemzoo conformance suite, run on the Triton path itself (CPU tensors, interpreter)."""
    from gemzoo_block_attention import block_attention_triton
    from gemzoo_block_attention.ops import KERNEL

    from gemzoo.testing.interpreter import conformance_results

    return conformance_results(block_attention_triton, KERNEL.capabilities, quick=True)


def compile_check():
    """torch.compile(fullgraph=True) traces the custom op (fake impl + autograd), then runs it; opcheck."""
    from gemzoo_block_attention import block_attention_triton
    from gemzoo_block_attention.ops import block_fwd

    from gemzoo.testing.interpreter import compiled_matches_eager

    off = lengths_to_offsets(torch.tensor([7, 0, 19]))
    q, k, v = (torch.randn(26, 2, 16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return block_attention_triton(q, k, v, off, block_size=4, rope_theta=100.0).square().sum()

    same = compiled_matches_eager(f, q, k, v)
    for args in ((q, k, v, off, off, True, 0, 0.25, 1.0, -1, 4, 100.0),
                 (q, k, v, off, off, False, 1, 0.25, 0.5, 3, 8, 0.0, 0)):
        torch.library.opcheck(block_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                           "test_autograd_registration"))
    return {"compile": same, "opcheck": True}


# Grouped k/v (GQA 4 over 2 and 6 over 3, MQA 4 over 1) with blocks, windows and fused RoPE, head dims 256 and 50:
# name -> grouped_query_errors keywords
GQA_CASES = {
    "gqa4x2-block8-causal": dict(q_lens=[5, 0, 37, 16], block_size=8),
    "mqa4x1-block7-gelu-asym": dict(q_lens=[5, 0, 37, 16], k_lens=[9, 4, 20, 40], kv_heads=1, block_size=7,
                                    activation="gelu", causal=False, norm=8.0),
    "gqa6x3-block16-window-rope": dict(q_lens=[5, 0, 37, 16], heads=6, kv_heads=3, block_size=16, window=5,
                                       rope_theta=100.0),
    "gqa4x2-block8-d256": dict(q_lens=[5, 0, 20], head_dim=256, block_size=8),
    "mqa4x1-block8-rope-d50": dict(q_lens=[5, 0, 37, 16], kv_heads=1, head_dim=50, block_size=8, rope_theta=500.0),
}


def gqa_cases() -> dict:
    """GQA_CASES through block_attention_triton (``options``: a KernelOptions for it only), against the fp64 reference."""
    from gemzoo_block_attention.ops import block_attention_triton

    from gemzoo.testing.attention import grouped_query_errors

    return {name: grouped_query_errors(block_attention_triton, **kw) for name, kw in GQA_CASES.items()}


def main(which: str) -> None:
    from gemzoo.testing.interpreter import print_group

    print_group({"cases": lambda: {name: run_case(*args) for name, args in CASES.items()},
                 "conformance": conformance, "gqa": gqa_cases,
                 "misc": lambda: {"nan": nan_stays_in_block(), "compile": compile_check()}}, which)


if __name__ == "__main__":
    main(sys.argv[1])
