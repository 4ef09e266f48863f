"""GEMM slowdown while collective-sized buffers move: ncclx's copy-engine path against SM copy kernels, one GPU.

    python plugins/gemzoo-ncclx/bench/bench_overlap.py --out results/ncclx_overlap.json      # one H200, < 120 s
    python plugins/gemzoo-ncclx/bench/bench_overlap.py --dry-run --out /tmp/ncclx.json    # CPU smoke (tiny sizes)

One process, about 75 s on one H200 (estimate: the C++ build ~20 s, the GEMM rounds ~35 s:
57 timings of ~0.5 s and 6 alone ones of 0.33 s; the 2-process check and the rest ~20 s; the previous version,
with a third of the modes, took 56 s). ``--rounds 2`` or
``--sizes-mb 256`` cut it by a third or a half.

1. Build (or load) the C++/CUDA part (plugins/gemzoo-ncclx/csrc/comms); its build time is reported, and
   whether it has ``copy_batch_async`` (``cudaMemcpyBatchAsync``, CUDA runtime >= 12.8 at build time).
2. A stream of 8192^3 bf16 GEMMs on the default stream, timed with CUDA events, in rounds. Each round runs, in
   order: the GEMMs alone ("alone-before"); then, per buffer size (256 MB and 1 GB), while a side stream moves
   that buffer over and over with
   - ``copy-engine``: ncclx's ``copy_async``, a same-device DtoD ``cudaMemcpyAsync`` (the call its peer pulls
     make; on one device the driver may run it as a kernel: the first H200 run saw 1.5 TB/s);
   - ``copy-batch``: ``copy_batch_async``, the same copy through ``cudaMemcpyBatchAsync`` with
     ``cudaMemcpyFlagPreferOverlapWithCompute`` and ``cudaMemcpySrcAccessOrderStream`` (asks for a copy engine;
     left out, and said in ``copy_batch``, where the build lacks it or the driver refuses it);
   - ``h2d`` / ``d2h``: ``cudaMemcpyAsync`` between pinned host memory and the device: copy engines for certain
     (PCIe, ~50 GB/s), the ground truth for what copy-engine traffic costs the GEMMs;
   - ``sm-copy`` / ``sm-copy-full``: an SM copy kernel (Triton, 32 CTAs like NCCL's channels, and a full grid);
   - ``sm-matched-<ref>``: the same Triton copy on as many CTAs as move the buffer alone at the GB/s of
     copy-engine mode ``<ref>`` (h2d, d2h, copy-batch), picked by a short calibration (``rate_matched``), so
     copy engines and SMs are compared at equal bytes per second (``comparison``);
   then while the reduce-scatter reduction kernel runs on ``reduce_blocks`` blocks; and the GEMMs alone again
   ("alone-after"). The side stream's moves are queued in batches while the GEMMs run, so it is busy from
   before they start until one batch after they end (``beside``; the JSON's ``side_covered_gemms`` says
   whether it was busy over the whole window). Per mode the median
   over rounds; the slowdown is against the mean of the two "alone" medians (both are reported: taking "alone"
   only first has shown a -9% slowdown, a clock artefact). Every row also gives the side stream's GB/s beside
   the GEMMs and alone, and ``slowdown_pct_per_100GBps``: the slowdown per 100 GB/s moved.
3. The reduction kernel's bandwidth by block count (8 chunks of 64 MB bf16 into one).
4. Two processes on this one GPU form a 2-rank ncclx group: CUDA IPC staging, interprocess events and the
   pulls run for real (``pull_path``: ``cudaMemcpyBatchAsync`` where built in, else ``cudaMemcpyAsync``);
   every claimed collective (fp32, bf16, fp16, int64; zero, odd and even sizes; uneven all-to-all) must equal
   the same group's CPU (gloo) transport bit for bit; a 256 MB all-gather is timed.

Writes the JSON to --out and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
for _p in (HERE, HERE.parents[1]):  # gemzoo_ncclx and gemzoo from the checkout, installed or not
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

MB = 1 << 20


# ----------------------------------------------------------------------------------------------- copies
@functools.cache
def _triton_copy():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return triton, _copy


def sm_copy_fn(grid: int | None):
    """An SM copy of ``src`` into ``dst`` (same bytes): Triton with ``grid`` programs (None: enough to cover
    the buffer; one compiled kernel for every grid), else torch's elementwise ``neg`` (a full-grid SM kernel
    moving the same bytes)."""
    try:
        triton, kernel = _triton_copy()
    except ImportError:
        return lambda dst, src: torch.neg(src, out=dst), "torch.neg (full grid)"
    block = 4096

    def run(dst, src):
        s, d = src.view(torch.int32), dst.view(torch.int32)
        n = s.numel()
        g = grid or triton.cdiv(n, block)
        kernel[(g,)](s, d, n, BLOCK=block, num_warps=8)

    return run, f"triton copy, {grid or 'full'} CTAs"


CE_REFS = ("h2d", "d2h", "copy-batch")  # the copy-engine modes an SM copy is rate-matched to
MOVES_ON = {"copy-engine": "driver's choice (same-device DtoD cudaMemcpyAsync)",
            "copy-batch": "copy engine requested (cudaMemcpyBatchAsync, PreferOverlapWithCompute)",
            "h2d": "copy engine (pinned host to device over PCIe)", "d2h": "copy engine (device to pinned host)",
            "sm-copy": "SMs", "sm-copy-full": "SMs", "reduce": "SMs (reduce_blocks)"}
H2D, D2H = 1, 2  # cudaMemcpyKind


class Modes:
    """The side-stream workloads, each a function that queues ``count`` moves of ``nbytes``. ``sm-matched-<ref>``
    is the Triton copy with ``matched[(ref, nbytes)]`` CTAs (set by ``calibrate``)."""

    def __init__(self, device, ext, reduce_blocks: int, dry: bool):
        self.device, self.ext, self.blocks, self.dry = device, ext, reduce_blocks, dry
        self.side = torch.cuda.Stream(device) if not dry else None
        self.bufs, self.host = {}, {}
        self.sm32 = sm_copy_fn(32) if not dry else (lambda d, s: torch.neg(s, out=d), "torch.neg")
        self.smfull = sm_copy_fn(None) if not dry else (lambda d, s: torch.neg(s, out=d), "torch.neg")
        self.matched = {}  # (ref, nbytes) -> CTAs
        self.grids = {}

    def sm_grid(self, grid: int):
        if grid not in self.grids:
            self.grids[grid] = sm_copy_fn(grid)[0] if not self.dry else (lambda d, s: torch.neg(s, out=d))
        return self.grids[grid]

    def buffers(self, nbytes: int):
        if nbytes not in self.bufs:
            n = nbytes // 2
            self.bufs[nbytes] = (torch.randn(n, device=self.device).to(torch.bfloat16),
                                 torch.empty(n, dtype=torch.bfloat16, device=self.device))
            if not self.dry:
                torch.cuda.synchronize()  # the side stream reads them next
        return self.bufs[nbytes]

    def pinned(self, nbytes: int):
        """A pinned host buffer of ``nbytes`` (H2D reads it, D2H writes it; the modes never run together)."""
        if nbytes not in self.host:
            self.host[nbytes] = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=not self.dry).fill_(1)
        return self.host[nbytes]

    def queue(self, mode: str, nbytes: int, count: int):
        """Queue ``count`` moves on the side stream (the dry run: on the host, one after another)."""
        if self.dry:
            return self._queue(mode, nbytes, count)
        with torch.cuda.stream(self.side):
            self._queue(mode, nbytes, count)

    def _queue(self, mode: str, nbytes: int, count: int):
        src, dst = self.buffers(nbytes)
        host = self.pinned(nbytes) if mode in ("h2d", "d2h") else None
        stream = None if self.dry else self.side.cuda_stream
        for _ in range(count):
            if self.dry and mode in ("copy-engine", "copy-batch", "h2d", "d2h"):
                (dst.copy_(host) if mode == "h2d" else host.copy_(src) if mode == "d2h" else dst.copy_(src))
            elif mode == "copy-engine":
                self.ext.copy_async(dst.data_ptr(), src.data_ptr(), nbytes, stream)
            elif mode == "copy-batch":
                self.ext.copy_batch_async(dst.data_ptr(), src.data_ptr(), nbytes, stream)
            elif mode == "h2d":
                self.ext.copy_async(dst.data_ptr(), host.data_ptr(), nbytes, stream, H2D)
            elif mode == "d2h":
                self.ext.copy_async(host.data_ptr(), src.data_ptr(), nbytes, stream, D2H)
            elif mode == "sm-copy":
                self.sm32[0](dst, src)
            elif mode == "sm-copy-full":
                self.smfull[0](dst, src)
            elif mode.startswith("sm-matched-"):
                self.sm_grid(self.matched[(mode.removeprefix("sm-matched-"), nbytes)])(dst, src)
            elif mode == "reduce":
                self._reduce(nbytes)
            else:
                raise ValueError(f"bench mode {mode!r} is not one of {sorted(MOVES_ON)} or sm-matched-<ref>")

    def per_move(self, mode: str, nbytes: int, reps: int = 3) -> float:
        """Seconds one move takes alone on the side stream (after one warm-up move)."""
        self.queue(mode, nbytes, 1)
        return timed(lambda: self.queue(mode, nbytes, reps), self.dry, self.side) / reps

    def _reduce(self, nbytes: int):
        from gemzoo_ncclx import schedule as S

        key = ("reduce", nbytes)
        if key not in self.bufs:
            n = nbytes // 2 // 8
            self.bufs[key] = ([torch.randn(n, device=self.device).to(torch.bfloat16) for _ in range(8)],
                              torch.empty(n, dtype=torch.bfloat16, device=self.device))
            if not self.dry:
                torch.cuda.synchronize()
        parts, out = self.bufs[key]
        if self.dry or self.ext is None:
            S.reduce_parts(out, parts, S.REDUCE_CODES["SUM"], 8)
        else:
            self.ext.reduce(out.data_ptr(), [p.data_ptr() for p in parts], out.numel(), S.DTYPE_CODE[torch.bfloat16],
                            S.REDUCE_CODES["SUM"], 8, self.blocks, self.side.cuda_stream)


def calibrate(modes: Modes, size: int, targets: dict[str, float], max_grid: int) -> dict:
    """Pick, per copy-engine mode, the CTA count whose Triton copy moves ``size`` alone at that mode's alone GB/s:
    a rate table over a few grids, interpolation, then up to two measured corrections; the closest one measured
    wins. -> {ref: {"target_GBps", "ctas", "sm_alone_GBps", "tried"}}."""
    def rate(g: int) -> float:
        modes.matched[("calib", size)] = g
        return size / modes.per_move("sm-matched-calib", size, 2) / 1e9

    table = {g: rate(g) for g in (1, 2, 4, 8, 16, 32, 64) if g <= max_grid}
    out = {}
    for ref, target in targets.items():
        pts = sorted(table.items())
        g = pts[-1][0] * target / pts[-1][1]  # beyond the table: linear in CTAs
        for (g0, r0), (g1, r1) in zip(pts, pts[1:], strict=False):
            if r0 <= target <= r1 and r1 > r0:
                g = g0 + (target - r0) * (g1 - g0) / (r1 - r0)
                break
        else:
            if target < pts[0][1]:
                g = 1
        tried = {}
        g = max(1, min(max_grid, round(g)))
        for _ in range(3):
            if g in tried:
                break
            tried[g] = table.get(g) or rate(g)
            g = max(1, min(max_grid, round(g * target / tried[g])))
        best = min(tried, key=lambda c: abs(math.log(tried[c] / target)))
        out[ref] = {"target_GBps": round(target, 1), "ctas": best, "sm_alone_GBps": round(tried[best], 1),
                    "tried": {str(c): round(r, 1) for c, r in tried.items()}}
    modes.matched.pop(("calib", size), None)
    return out


def timed(fn, dry: bool, stream=None) -> float:
    """Seconds ``fn`` takes on ``stream`` (CUDA events), or on the host in a dry run."""
    if dry:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    fn()
    b.record(stream)
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def beside(modes: Modes, mode: str, size: int, per_move: float, t_gemm: float, gemms) -> tuple:
    """One timing of the GEMMs while the side stream moves ``size`` in ``mode`` without a gap from before they
    start until after they end. The moves go in batches of about a quarter of the GEMMs' alone time; two are
    queued before the GEMMs, and one more whenever the side stream has started its last queued batch, until the
    GEMMs are done. So the side stream stops one batch after the GEMMs however much either slows the other
    (the first version queued 2.5x the GEMMs' time up front). -> (GEMM seconds, side seconds, moves, covered)."""
    side, ev = modes.side, lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    batch = max(1, math.ceil(0.25 * t_gemm / max(per_move, 1e-9)))
    side.wait_stream(torch.cuda.current_stream())  # the side stream starts after the work so far
    s0, s1, g0, g1 = ev(), ev(), ev(), ev()
    s0.record(side)
    ends = []

    def more():
        modes.queue(mode, size, batch)
        ends.append(torch.cuda.Event())
        ends[-1].record(side)

    more()
    more()
    g0.record()
    gemms()
    g1.record()
    while not g1.query():
        if ends[-2].query():
            more()
        else:
            time.sleep(2e-4)
    s1.record(side)
    torch.cuda.synchronize()
    covered = s0.elapsed_time(g0) >= 0 and g1.elapsed_time(s1) >= 0
    return g0.elapsed_time(g1) / 1e3, s0.elapsed_time(s1) / 1e3, batch * len(ends), covered


def per_100(slowdown, gbps):
    """Slowdown (percent) per 100 GB/s that the side stream moved beside the GEMMs."""
    return None if slowdown is None or not gbps else round(100 * slowdown / gbps, 3)


def gemm_rounds(args, device, ext) -> dict:
    dry = args.dry_run
    n, count = (128, 4) if dry else (8192, args.gemms)
    dtype = torch.float32 if dry else torch.bfloat16
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    flops = 2.0 * n ** 3 * count

    def gemms():
        for _ in range(count):
            torch.matmul(a, b, out=c)

    modes = Modes(device, ext, args.reduce_blocks, dry)
    has_batch = dry or bool(getattr(ext, "HAS_COPY_BATCH", False))
    ce_modes = ["copy-engine"] + (["copy-batch"] if has_batch else []) + ["h2d", "d2h"]
    refs = [r for r in CE_REFS if r in ce_modes]
    batch_note = None
    warm_until = time.perf_counter() + (0 if dry else args.warmup_s)
    gemms()
    while time.perf_counter() < warm_until:  # clocks and power settle
        gemms()
        torch.cuda.synchronize()
    t_gemm = timed(gemms, dry)
    sizes = [s * MB for s in args.sizes_mb] if not dry else [1 * MB]
    # how long one move takes alone: it sizes the side stream's batches and is the rate the SM copies match
    per_move = {}
    for size in sizes:
        for mode in ce_modes + ["sm-copy", "sm-copy-full"]:
            try:
                per_move[(mode, size)] = modes.per_move(mode, size)
            except RuntimeError as exc:  # cudaMemcpyBatchAsync built in but refused by this driver
                if mode != "copy-batch":
                    raise
                batch_note = str(exc)[:300]
        if batch_note and "copy-batch" in ce_modes:
            ce_modes.remove("copy-batch")
            refs.remove("copy-batch")
    # the SM copy, throttled (fewer CTAs) to each copy-engine mode's alone GB/s at each size
    matched = {}
    max_grid = ext.sm_count(device.index or 0) if ext is not None else 132
    for size in sizes:
        targets = {r: size / per_move[(r, size)] / 1e9 for r in refs}
        cal = calibrate(modes, size, targets, max_grid) if not dry else \
            {r: {"target_GBps": round(t, 1), "ctas": 1, "sm_alone_GBps": None, "tried": {}} for r, t in targets.items()}
        for r, v in cal.items():
            modes.matched[(r, size)] = v["ctas"]
            per_move[(f"sm-matched-{r}", size)] = modes.per_move(f"sm-matched-{r}", size)
        matched[str(size // MB)] = cal
    red_size = sizes[0]
    per_move[("reduce", red_size)] = modes.per_move("reduce", red_size)
    side_modes = ce_modes + ["sm-copy", "sm-copy-full"] + [f"sm-matched-{r}" for r in refs]
    plan = [("alone-before", None)] + [(m, s) for s in sizes for m in side_modes] \
        + [("reduce", red_size), ("alone-after", None)]
    samples = {p: [] for p in plan}
    side_bw = {p: [] for p in plan}
    covered = {p: [] for p in plan}  # the side stream was busy from before the GEMMs began until after they ended
    for _ in range(1 if dry else args.rounds):
        for mode, size in plan:
            if size is None:
                samples[(mode, size)].append(timed(gemms, dry))
                continue
            if dry:
                modes.queue(mode, size, 2)
                samples[(mode, size)].append(timed(gemms, dry))
                side_bw[(mode, size)].append(size / max(1e-9, per_move[(mode, size)]) / 1e9)
                continue
            gemm_s, side_s, moves, cov = beside(modes, mode, size, per_move[(mode, size)], t_gemm, gemms)
            samples[(mode, size)].append(gemm_s)
            covered[(mode, size)].append(cov)
            side_bw[(mode, size)].append(size * moves * (9 / 8 if mode == "reduce" else 1) / side_s / 1e9)
    med = {p: statistics.median(v) for p, v in samples.items()}
    tf = {p: flops / t / 1e12 for p, t in med.items()}
    alone = (tf[("alone-before", None)] + tf[("alone-after", None)]) / 2
    rows = []
    for (mode, size) in plan:
        slow = round(100 * (1 - tf[(mode, size)] / alone), 2)
        gbps = round(statistics.median(side_bw[(mode, size)]), 1) if side_bw[(mode, size)] else None
        ref = mode.removeprefix("sm-matched-") if mode.startswith("sm-matched-") else None
        ctas = {"sm-copy": 32, "sm-copy-full": "full"}.get(mode, modes.matched.get((ref, size)))
        rows.append({"mode": mode, "bytes": size, "gemm_tflops": round(tf[(mode, size)], 2), "slowdown_pct": slow,
                     "side_GBps": gbps, "side_alone_GBps": round(size / per_move[(mode, size)] / 1e9, 1)
                     if (mode, size) in per_move else None,
                     "slowdown_pct_per_100GBps": per_100(slow, gbps) if size else None,
                     "moves_on": MOVES_ON.get(mode, f"SMs ({ctas} CTAs, rate-matched to {ref})" if ref else None),
                     "ctas": ctas, "matched_to": ref,
                     "side_covered_gemms": all(covered[(mode, size)]) if covered[(mode, size)] else None,
                     "rounds": len(samples[(mode, size)])})
    by = {(r["mode"], r["bytes"]): r for r in rows}
    comparison = []  # the decisive table: each copy-engine mode against the SM copy moving the same GB/s
    for size in sizes:
        for ref in refs:
            ce, sm = by[(ref, size)], by[(f"sm-matched-{ref}", size)]
            comparison.append({"bytes": size, "copy_engine_mode": ref, "ce_slowdown_pct": ce["slowdown_pct"],
                               "ce_GBps": ce["side_GBps"], "sm_ctas": sm["ctas"], "sm_slowdown_pct": sm["slowdown_pct"],
                               "sm_GBps": sm["side_GBps"], "ce_per_100GBps": ce["slowdown_pct_per_100GBps"],
                               "sm_per_100GBps": sm["slowdown_pct_per_100GBps"]})
    names = {"copy-engine": "ncclx copy_async (cudaMemcpyAsync D2D, same device)",
             "copy-batch": "ncclx copy_batch_async (cudaMemcpyBatchAsync D2D, PreferOverlapWithCompute, "
                           "SrcAccessOrderStream)",
             "h2d": "ncclx copy_async, pinned host -> device (cudaMemcpyAsync H2D)",
             "d2h": "ncclx copy_async, device -> pinned host (cudaMemcpyAsync D2H)",
             "sm-copy": modes.sm32[1], "sm-copy-full": modes.smfull[1],
             "reduce": f"ncclx reduction kernel, {args.reduce_blocks} blocks, 8 bf16 chunks"}
    names.update({f"sm-matched-{r}": f"triton copy, CTAs rate-matched to {r}'s alone GB/s" for r in refs})
    return {"gemm": f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}, {count} per timing", "alone_tflops": round(alone, 2),
            "rows": rows, "modes": names, "gemm_alone_s_per_timing": t_gemm, "rate_matched": matched,
            "comparison": comparison,
            "copy_batch": {"built_in": bool(getattr(ext, "HAS_COPY_BATCH", False)) if ext is not None else None,
                           "cudart_version": getattr(ext, "CUDART_VERSION", None), "ran": "copy-batch" in ce_modes,
                           "refused": batch_note}}


def reduce_sweep(args, device, ext) -> list[dict]:
    from gemzoo_ncclx import schedule as S

    if args.dry_run or ext is None:
        return []
    n = 64 * MB // 2
    parts = [torch.randn(n, device=device).to(torch.bfloat16) for _ in range(8)]
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    want = torch.empty_like(out)
    S.reduce_parts(want, parts, S.REDUCE_CODES["SUM"], 8)
    rows = []
    stream = torch.cuda.current_stream()
    for blocks in (1, 2, 4, 8, 16, 32, ext.sm_count(device.index or 0)):
        run = lambda b=blocks: ext.reduce(out.data_ptr(), [p.data_ptr() for p in parts], n, S.DTYPE_CODE[torch.bfloat16],  # noqa: E731
                                          S.REDUCE_CODES["SUM"], 8, b, stream.cuda_stream)
        run()
        t = timed(lambda run=run: [run() for _ in range(5)], False, stream) / 5
        rows.append({"blocks": blocks, "ms": round(t * 1e3, 3), "GBps": round(9 * n * 2 / t / 1e9, 1),
                     "bit_identical_to_cpu_order": bool(torch.equal(out.view(torch.int16), want.view(torch.int16)))})
    return rows


# ------------------------------------------------------------------------------- 2 ranks on one device
def smoke_rank(rank: int, world: int, port: int, device_kind: str, out_dir: str, big_mb: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    import torch.distributed as dist
    from gemzoo_ncclx import NcclxComms

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        NcclxComms().install()
        dist.init_process_group("ncclx", rank=rank, world_size=world)
        dev = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        bad, checked = [], 0

        def both(fn):
            """The collective on ``dev`` and on CPU (the gloo transport) -> (device result on CPU, CPU result)."""
            return fn(dev).cpu(), fn(torch.device("cpu"))

        for seed, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.int64)):
            for n in (0, 5, 4098):
                g = torch.Generator().manual_seed(seed * 100 + n + rank)
                x = (torch.randn(world * n, generator=g) * 100).to(dtype)

                def ag(d, x=x, n=n):
                    o = torch.empty(world * n, dtype=x.dtype, device=d)
                    dist.all_gather_into_tensor(o, x[:n].to(d))
                    return o

                def rs(d, x=x, n=n):
                    o = torch.empty(n, dtype=x.dtype, device=d)
                    dist.reduce_scatter_tensor(o, x.to(d))
                    return o

                send = [(rank + 2 * p + n) % 3 * (n > 0) for p in range(world)]
                recv = [(p + 2 * rank + n) % 3 * (n > 0) for p in range(world)]

                def a2a(d, x=x, send=send, recv=recv):
                    o = torch.empty(sum(recv), dtype=x.dtype, device=d)
                    dist.all_to_all_single(o, x[:sum(send)].to(d), recv, send)
                    return o

                for name, fn in (("all_gather_into_tensor", ag), ("reduce_scatter_tensor", rs),
                                 ("all_to_all_single", a2a)):
                    got, want = both(fn)
                    checked += 1
                    if got.dtype != want.dtype or not torch.equal(got, want):
                        bad.append(f"{name} {dtype} n={n}")
        pg = dist.distributed_c10d._get_default_group()
        transport = type(pg._cuda).__name__ if dev.type == "cuda" else "GlooTransport"
        pull = getattr(pg._cuda, "pull_path", None) if dev.type == "cuda" else None
        timing = None
        if dev.type == "cuda" and pg._cuda:
            n = big_mb * MB // 2
            x = torch.randn(n, device=dev).to(torch.bfloat16)
            o = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
            dist.all_gather_into_tensor(o, x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                dist.all_gather_into_tensor(o, x)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / 5
            timing = {"all_gather_MB_per_rank": big_mb, "ms": round(dt * 1e3, 2),
                      "GBps_received_per_rank": round((world - 1) * n * 2 / dt / 1e9, 1)}
    Path(out_dir, f"smoke{rank}.json").write_text(json.dumps({
        "checked": checked, "mismatches": bad, "transport": transport, "timing": timing, "pull_path": pull,
        "pull_fallback": getattr(pg._cuda, "pull_fallback", None) if dev.type == "cuda" else None,
        "said": [str(w.message) for w in said if "ncclx" in str(w.message)]}))
    dist.destroy_process_group()


def smoke(args, out_dir: Path) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kind = "cpu" if args.dry_run else "cuda"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=smoke_rank, args=(r, 2, port, kind, str(out_dir), 1 if args.dry_run else 256))
             for r in range(2)]
    previous = os.environ.get("GEMZOO_NCCLX_PULL")
    os.environ["GEMZOO_NCCLX_PULL"] = args.pull  # the spawned ranks read it: which pull path this check runs
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.pop("GEMZOO_NCCLX_PULL") if previous is None else os.environ.update(GEMZOO_NCCLX_PULL=previous)
    for p in procs:
        p.join(timeout=args.smoke_timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    ranks = []
    for r in range(2):
        f = out_dir / f"smoke{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else None)
    return {"exit_codes": codes, "ranks": ranks,
            "ok": codes == [0, 0] and all(r and not r["mismatches"] for r in ranks)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test with tiny sizes (no GPU needed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gemms", type=int, default=200, help="GEMMs per timing")
    ap.add_argument("--sizes-mb", type=lambda v: [int(x) for x in v.split(",")], default=[256, 1024],
                    help="buffer sizes in MB, comma-separated (default 256,1024)")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    from gemzoo_ncclx.plugin import NcclxOptions

    ap.add_argument("--reduce-blocks", type=int, default=NcclxOptions().reduce_blocks, help="the plugin's default")
    ap.add_argument("--no-smoke", action="store_true", help="skip the 2-process check on this device")
    ap.add_argument("--smoke-timeout", type=float, default=45)
    ap.add_argument("--pull", choices=("batch", "memcpy"), default="batch",
                    help="the 2-process check's pull path (GEMZOO_NCCLX_PULL); default batch, the path that is "
                         "opt-in until checked here (memcpy, the default of training runs, passed on the H200)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU smoke test", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    result = {"dry_run": args.dry_run, "torch": torch.__version__,
              "device": "cpu" if args.dry_run else torch.cuda.get_device_name(0)}
    ext = None
    if not args.dry_run:
        from gemzoo_ncclx._ext import load

        t = time.perf_counter()
        ext, why = load()
        result["extension"] = {"loaded": ext is not None, "why": why, "load_s": round(time.perf_counter() - t, 1)}
        if ext is None:
            print(f"ncclx C++ part unavailable: {why}", file=sys.stderr)
        else:
            result["sm_count"] = ext.sm_count(0)
    save = lambda: out.write_text(json.dumps(result, indent=1))  # noqa: E731  (after each part: a cut-off run keeps what it measured)
    save()
    result.update(gemm_rounds(args, device, ext) if (args.dry_run or ext is not None) else {"rows": []})
    save()
    result["reduce_sweep"] = reduce_sweep(args, device, ext)
    save()
    if not args.no_smoke:
        result["two_ranks_one_device"] = smoke(args, out.parent)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, torch {result['torch']}; GEMM {result.get('gemm')}; alone "
          f"{result.get('alone_tflops')} TFLOP/s (mean of before/after)")
    print(f"{'mode':<22} {'MB':>6} {'CTAs':>5} {'GEMM TFLOP/s':>13} {'slowdown %':>11} {'side GB/s':>10} "
          f"{'%/100GB/s':>10} {'covered':>8}")
    for r in result["rows"]:
        mb = "" if r["bytes"] is None else r["bytes"] // MB
        cov = "" if r["side_covered_gemms"] is None else ("yes" if r["side_covered_gemms"] else "NO")
        per = "" if r.get("slowdown_pct_per_100GBps") is None else r["slowdown_pct_per_100GBps"]
        print(f"{r['mode']:<22} {mb:>6} {r.get('ctas') or '':>5} {r['gemm_tflops']:>13} {r['slowdown_pct']:>11} "
              f"{r['side_GBps'] or '':>10} {per:>10} {cov:>8}")
    for c in result.get("comparison", []):
        print(f"rate-matched, {c['bytes'] // MB} MB: {c['copy_engine_mode']} {c['ce_slowdown_pct']}% at {c['ce_GBps']} GB/s "
              f"({c['ce_per_100GBps']} %/100GB/s) vs SM copy on {c['sm_ctas']} CTAs {c['sm_slowdown_pct']}% at "
              f"{c['sm_GBps']} GB/s ({c['sm_per_100GBps']} %/100GB/s)")
    if "copy_batch" in result:
        print(f"cudaMemcpyBatchAsync: {result['copy_batch']}")
    for r in result["reduce_sweep"]:
        print(f"reduce 8x64MB bf16, {r['blocks']:>3} blocks: {r['ms']} ms, {r['GBps']} GB/s, "
              f"bit-identical {r['bit_identical_to_cpu_order']}")
    if "two_ranks_one_device" in result:
        s = result["two_ranks_one_device"]
        print(f"2 ranks on one device: ok={s['ok']} exit={s['exit_codes']} "
              + "; ".join(f"rank {i}: {r['transport']} ({r.get('pull_path')}) checked {r['checked']} mismatches {r['mismatches']} "
                          f"{r['timing'] or ''}" for i, r in enumerate(s["ranks"]) if r))
    print(f"wrote {out} ({result['wall_s']} s)")
    return 0 if result.get("two_ranks_one_device", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
