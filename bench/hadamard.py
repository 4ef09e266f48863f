"""Check and time gemzoo.ops.hadamard_transform: the C++/CUDA kernels against the torch definition.

On a GPU: the CUDA kernel (warp-shuffle butterflies) for blocks 16/32, with and without signs, forward and
inverse, fp32/bf16/fp16, against ``hadamard_transform_torch``; opcheck; then bandwidth (bytes read + written)
with triton's do_bench against the torch matmul version and a plain copy. On CPU: the same checks, timed with
perf_counter. Prints a table, and writes JSON when --json names a file.

    python bench/hadamard.py [--json hadamard.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gemzoo import ops


def bench_ms(fn, device):
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description="check and time gemzoo.ops.hadamard_transform")
    ap.add_argument("--json", default=None, help="write the checks and timings as JSON to this file")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = ops.extension_info()
    print("# extension:", json.dumps(info))
    assert device in info["ops"]["hadamard_transform"]["extension"], f"no {device} kernel for hadamard_transform"
    checks = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        for block in (16, 32):
            signs = (torch.randint(0, 2, (block,)) * 2 - 1).float().to(device)
            for use_signs in (False, True):
                for inverse in (False, True):
                    x = torch.randn(1000, 3, 96, device=device).to(dtype)  # not a multiple of 256 threads
                    s = signs if use_signs else None
                    got = ops.hadamard_transform(x, block, s, inverse)
                    want = ops.hadamard_transform_torch(x.float(), block, s, inverse)
                    err = float((got.float() - want).norm() / want.norm())
                    checks.append(dict(dtype=str(dtype), block=block, signs=use_signs, inverse=inverse, rel_err=err))
                    assert err < tol, checks[-1]
    x = torch.randn(64, 64, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.gemzoo.hadamard_transform.default, (x, 32, None, False))
    y = ops.hadamard_transform(x, 32, signs)
    y.backward(torch.ones_like(y))
    assert torch.allclose(x.grad, ops.hadamard_transform_torch(torch.ones_like(x), 32, signs, inverse=True),
                          atol=1e-5)
    print(f"correctness: {len(checks)} configurations, max rel err {max(c['rel_err'] for c in checks):.2e}; "
          "opcheck and backward ok")

    rows = []
    shape = (65536, 4096) if device == "cuda" else (1024, 1024)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(*shape, device=device).to(dtype)
        signs = (torch.randint(0, 2, (32,)) * 2 - 1).float().to(device)
        nbytes = 2 * x.numel() * x.element_size()
        for name, fn in (("gemzoo", lambda x=x, signs=signs: ops.hadamard_transform(x, 32, signs)),
                         ("torch-matmul", lambda x=x, signs=signs: ops.hadamard_transform_torch(x, 32, signs)),
                         ("copy", lambda x=x: x.clone())):
            ms = bench_ms(fn, device)
            rows.append(dict(dtype=str(dtype), shape=list(shape), kernel=name, ms=ms, tb_s=nbytes / ms / 1e9))
    print(f"{'dtype':16} {'kernel':14} {'ms':>8} {'TB/s':>7}")
    for r in rows:
        print(f"{r['dtype']:16} {r['kernel']:14} {r['ms']:8.3f} {r['tb_s']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, extension=info, checks=checks, timings=rows), f, indent=1)


if __name__ == "__main__":
    main()
