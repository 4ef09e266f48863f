#!/usr/bin/env python3
"""Host time of one attention call of this kernel family (jfa, gdpa, block-attention), kernels stubbed out:
the Python path alone (input check, schedule, autograd, launch arguments), eager autograd path
(gemzoo_jfa.family.run_attention) against calling the custom op, interleaved in one process. Runs on CPU
(no Triton kernel is launched), so it isolates what the H200 runs showed dominating short calls.

    python plugins/gemzoo-jfa/bench/host_overhead.py [--reps 15] [--length 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--length", type=int, default=512)
    args = ap.parse_args()

    import gemzoo_jfa.family as family
    import gemzoo_jfa.kernels as kernels
    import gemzoo_jfa.ops as ops

    from gemzoo.api import lengths_to_offsets

    class Stub:  # kernel[grid](...) does nothing: what is left is the host's path
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    for name in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "attn_bwd_preprocess"):
        setattr(kernels, name, Stub())

    entries = {"jfa": lambda q, k, v, off: ops.jfa_triton(q, k, v, off)}
    members = [ops]  # the modules whose entry calls run_attention
    try:
        import gemzoo_gdpa.ops as gdpa_ops
        entries["gdpa"] = lambda q, k, v, off: gdpa_ops.gdpa_triton(q, k, v, off, activation="silu")
        members.append(gdpa_ops)
    except ImportError:
        pass
    try:
        import gemzoo_block_attention.ops as block_ops
        entries["block-attention"] = lambda q, k, v, off: block_ops.block_attention_triton(q, k, v, off,
                                                                                           block_size=64)
        members.append(block_ops)
    except ImportError:
        pass

    n = args.length
    off = lengths_to_offsets(torch.tensor([n]))
    q, k, v = (torch.randn(n, 4, 128, requires_grad=True) for _ in range(3))
    grad = torch.randn(n, 4, 128)
    eager = family.run_attention

    def via_op(op, fwd, bwd, *a):
        return op(*a)

    def step(call):
        call(q, k, v, off).backward(grad)
        for t in (q, k, v):  # the stubbed kernels leave gradients uninitialised: never accumulate them
            t.grad = None

    print(f"host ms per fwd+bwd (kernels stubbed), one sequence of {n}, H=4, D=128, min / median of {args.reps}")
    for name, call in entries.items():
        times = {"custom op": [], "eager autograd": []}
        for _ in range(args.reps):
            for path, runner in (("custom op", via_op), ("eager autograd", eager)):
                for member in members:
                    member.run_attention = runner
                for _ in range(5):
                    step(call)
                t0 = time.perf_counter()
                for _ in range(100):
                    step(call)
                times[path].append((time.perf_counter() - t0) / 100 * 1e3)
        for member in members:
            member.run_attention = eager
        a, b = times["custom op"], times["eager autograd"]
        print(f"  {name:16s} custom op {min(a):.3f} / {statistics.median(a):.3f}   "
              f"eager autograd {min(b):.3f} / {statistics.median(b):.3f}   ({min(a) / min(b):.2f}x less)")


if __name__ == "__main__":
    main()
