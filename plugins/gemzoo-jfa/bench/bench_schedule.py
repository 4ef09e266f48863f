#!/usr/bin/env python3
"""Time one work schedule built by the two Triton launches against the torch builder, uncached, on any CUDA
machine: the host time of an eager call and the GPU time as a CUDA-graph replay (where a compiled model in
"reduce-overhead" mode rebuilds every schedule on every replay). The two results are checked equal first.

    python3 plugins/gemzoo-jfa/bench/bench_schedule.py [--reps 200]

Batches: gem-lognormal (B=64), short (B=4096, median 48) and one sequence of 64K; query blocks of 128 (forward,
dQ) and key blocks of 64 (dK/dV), causal, lpt order.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_jfa import gem_lognormal, short_lengths  # noqa: E402
from gemzoo_jfa.schedule import _build_triton, build_schedule_torch, schedules_match  # noqa: E402

from gemzoo.api import lengths_to_offsets  # noqa: E402
from gemzoo.testing import cuda_graph  # noqa: E402


def timed(fn, reps: int) -> tuple[float, float]:
    """(host ms of an eager call, GPU ms of a graph replay), means over ``reps``."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) / reps * 1e3
    graph = cuda_graph(fn)[0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return eager, (time.perf_counter() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_schedule.py times GPU launches: run it on a CUDA machine")
    print("| batch | over | Triton eager / graph ms | torch eager / graph ms |\n|---|---|---:|---:|")
    for name, lens in (("gem-lognormal", gem_lognormal()), ("short", short_lengths(4096)),
                       ("one sequence of 64K", torch.tensor([65536]))):
        off = lengths_to_offsets(lens.cuda())
        for over, block in (("q", 128), ("k", 64)):
            build = (int(lens.sum()), block, over, True, None, "lpt", None, None, 0)
            triton_build, torch_build = (partial(fn, off, off, *build) for fn in (_build_triton, build_schedule_torch))
            if not schedules_match(triton_build(), torch_build()):
                sys.exit(f"{name}, over {over}: the Triton schedule differs from the torch one")
            triton_ms, torch_ms = timed(triton_build, args.reps), timed(torch_build, args.reps)
            print(f"| {name} (B={lens.numel()}) | {over} | {triton_ms[0]:.3f} / {triton_ms[1]:.3f} | "
                  f"{torch_ms[0]:.3f} / {torch_ms[1]:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
