"""Per-step overhead of base-batch-shuffle on one device (target: <= 1% of the step, overlapped).

    python3 plugins/gemzoo-batch-shuffle/bench/overhead.py --config configs/gem-bench.toml --plugins jfa,bf16 \
        --steps 20 --warmup 5 --worlds 8,64,512 --out results/overhead.json
    .venv/bin/python plugins/gemzoo-batch-shuffle/bench/overhead.py --dry-run --out /tmp/overhead.json   # CPU

One trainer is assembled once (the model is not reduced) and its ``train_step`` is timed over the same steps
``warmup..steps-1`` in every phase (paired: gem-lognormal steps differ in work, so each phase sees the same
batches; a step's time is its whole ``train_step`` call, data included, between CUDA synchronizations):

1. ``none``: batching ``none``; the first ``--warmup`` steps before it (kernel compilation) are not counted.
2. ``base-batch-shuffle``: the policy in the trainer. One rank never calls a batching policy (nothing to
   balance), so this row is the trainer's one-rank path with the policy selected: it must equal ``none``.
3. For each W of ``--worlds``, a realistic world's partition: a global batch of W x ``--per-rank`` samples,
   lengths and candidates drawn like the config's dataset (gem-lognormal), priced by this model's own
   ``cost_model``, one fresh draw per step.
   - ``alone``: ``assign`` and rank 0's route on the main thread with nothing else running (median of the steps' draws): what
     the synchronous path (``overlap = false``) adds to every step, in ms and in % of the ``base-batch-shuffle``
     median step.
   - ``process`` and ``thread`` (``--workers``): what ``overlap = true`` does in a W-rank run with that
     ``worker``: before step t, the partition of the draw goes to a ``gemzoo.data.exchange.PartitionWorker``
     of that kind (what the trainer's ``Lookahead`` submits to), and after step t the main thread waits for
     it (``wait``: what step t+1 would wait before its all-to-all). The step time includes that wait and any
     slowdown of the step beside the worker (a thread shares the GIL with the kernel launches); ``overhead``
     is the median over steps of (this step - the same step in phase 2). ``hidden``: the median wait is
     below 1% of the step; ``within_target``: the overhead is at most 1%.

The collectives of a W-rank run (the cost all-gather, 8 bytes a sample, and the all-to-all of the samples
that move) cannot be measured on one device; they are not in these figures. JSON goes to ``--out`` after
every phase (and phases stop starting once ``--budget-s`` is spent), so a cut-off call still reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[3]
TARGET_PCT = 1.0


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "gem-bench.toml"))
    p.add_argument("--plugins", default="jfa,bf16", help="as gemzoo train --plugins ('' keeps the config's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--worlds", default="8,64,512")
    p.add_argument("--per-rank", type=int, default=64, help="samples per rank of the simulated global batch")
    p.add_argument("--workers", default="process,thread", help="the overlap's workers to measure, in order")
    p.add_argument("--budget-s", type=float, default=80.0, help="start no phase after this many seconds")
    p.add_argument("--depth", type=int, default=1, help="partitions in flight, one worker each (overlap_depth)")
    p.add_argument("--set", action="append", default=[], help="config overrides, as gemzoo train --set")
    p.add_argument("--out", default="overhead.json")
    p.add_argument("--dry-run", action="store_true",
                   help="smoke test on CPU: configs/gem-tiny.toml, its own plugins, 8 steps, warmup 2, worlds 8,64")
    a = p.parse_args(argv)
    if a.dry_run:
        a.config, a.plugins, a.steps, a.warmup, a.worlds = str(ROOT / "configs" / "gem-tiny.toml"), "", 8, 2, "8,64"
        a.set = ["run.device='cpu'", *a.set]
    a.worlds = [int(w) for w in a.worlds.split(",") if w]
    a.workers = [k for k in a.workers.split(",") if k]
    if not set(a.workers) <= {"process", "thread"}:
        p.error(f"--workers must name process and/or thread, got {a.workers}")
    if a.steps - a.warmup < 3 or a.warmup < 1:
        p.error(f"--steps must exceed --warmup (>= 1) by at least 3, got --steps {a.steps} --warmup {a.warmup}")
    if not a.worlds or min(a.worlds) < 2:
        p.error(f"--worlds must be sizes >= 2 (one rank never partitions), got {a.worlds}")
    return a


def build_trainer(a):
    from gemzoo.api import Trainer, load_config, peak_flops

    cfg = load_config(a.config, plugins=a.plugins or None, overrides=[
        f"run.steps={a.steps}", "eval.every=0", "checkpoint.every=0", "plugins.batching='none'", *a.set])
    tr = Trainer(cfg, out_dir=tempfile.mkdtemp(prefix="bench-shuffle-"), progress=False).assemble()
    tr.peak, _ = peak_flops(tr.device, cfg.run.peak_tflops)  # fit() sets it; train_step reads it
    return tr


def use_policy(tr, name: str):
    from gemzoo.api import Lookahead, configured

    tr.cfg.plugins.batching = name
    tr.batching = configured("batching", name, tr.cfg)
    tr.lookahead = Lookahead(tr.batching, name=name)
    return tr.batching


def sync(tr):
    if tr.device.type == "cuda":
        torch.cuda.synchronize(tr.device)


def _runq_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (``/proc/thread-self/schedstat``): it grows
    when another process takes the trainer's core; NaN where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan


def timed_step(tr, step: int, before=None, after=None, host: list | None = None) -> float:
    """One ``train_step`` between synchronizations; ``host`` gets the main thread's CPU and run-queue wait
    seconds, the whole process's CPU seconds (its OpenMP team's included: spinning at barriers shows there) and
    what the step waited for its batch, which a host thread prefetched beside the worker."""
    sync(tr)
    t0, c0, q0, p0 = time.perf_counter(), time.thread_time(), _runq_wait_s(), time.process_time()
    handle = before() if before else None
    tr.train_step(step)
    if after:
        after(handle)
    sync(tr)
    if host is not None:
        load_wait = tr.lookahead.last.get("load_wait_s", math.nan)  # one rank: the trainer's prefetch wait
        host.append((time.thread_time() - c0, _runq_wait_s() - q0, time.process_time() - p0, load_wait))
    return time.perf_counter() - t0


def host_summary(host: list) -> dict:
    """Where the main thread's time went, medians over steps: on a CPU, and runnable but off one."""
    med = lambda k: round(1e3 * statistics.median(h[k] for h in host), 3)  # noqa: E731
    return {"main_cpu_median_ms": med(0), "main_runq_wait_median_ms": med(1), "process_cpu_median_ms": med(2),
            "load_wait_median_ms": med(3), "load_wait_max_ms": round(1e3 * max(h[3] for h in host), 3)}


def cpu_facts(workers: dict) -> dict:
    """The facts that decide whether a worker can slow the trainer's thread: CPUs, masks, thread counts."""
    from gemzoo.api import available_cpus

    return {"available_cpus": len(available_cpus()),
            "main_thread_cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP_", "MKL_"))},
            "workers": {kind: w.where() for kind, w in workers.items()}}


def global_costs(tr, world: int, per_rank: int, seed: int) -> torch.Tensor:
    """Costs of a simulated global batch of world x per_rank samples: the config's dataset's length and
    candidate distributions, priced by the trained model's cost_model."""
    from gemzoo.testing import gem_lognormal_lengths

    d = tr.cfg.data
    g = torch.Generator().manual_seed(seed)
    n = world * per_rank
    lengths = gem_lognormal_lengths(n, d.median_len, d.len_sigma, d.min_len, d.max_len, g)
    cands = torch.randint(d.min_candidates, d.max_candidates + 1, (n,), generator=g)
    return tr.model.cost_model(SimpleNamespace(lengths=lengths, cand_lengths=cands)).double()


def overlapped(tr, worker, policy, draws: dict, world: int, measured, base: list[float], base_med: float,
               depth: int = 1) -> dict:
    """Each measured step with the partition of ``draws[step]`` over ``world`` ranks submitted to ``worker``
    before it and waited for after it (as step t+1 would, before its all-to-all); with ``depth`` d, waited for
    after step t + d - 1 (the trainer's ``overlap_depth``: d partitions in flight in d workers)."""
    waits, in_worker, times, host = [], [], [], []
    pending: deque = deque()

    def wait(p):
        t = time.perf_counter()
        _, seconds = p.result()
        waits.append(time.perf_counter() - t)
        in_worker.append(seconds)

    def submit(s):
        pending.append(worker.submit(policy, draws[s], [draws[s].numel() // world] * world, 0, "base-batch-shuffle"))

    def after(_):
        if len(pending) >= depth:
            wait(pending.popleft())

    for s in measured:
        times.append(timed_step(tr, s, before=lambda s=s: submit(s), after=after, host=host))
    while pending:  # the last d - 1 finish after the measured steps: not a wait of any step
        pending.popleft().result()
    paired = statistics.median(t - b for t, b in zip(times, base, strict=False))
    wait_med = statistics.median(waits)
    return {"step_ms": ms(times), "median_step_ms": round(1e3 * statistics.median(times), 3),
            "overhead_ms": round(1e3 * paired, 3), "overhead_pct": round(100 * paired / base_med, 3),
            "wait_ms": ms(waits), "wait_median_ms": round(1e3 * wait_med, 3), "wait_max_ms": round(1e3 * max(waits), 3),
            "assign_in_worker_median_ms": round(1e3 * statistics.median(in_worker), 3),
            "hidden": bool(wait_med < 0.01 * base_med), "within_target": bool(paired <= TARGET_PCT / 100 * base_med),
            **host_summary(host)}


def ms(xs) -> list[float]:
    return [round(1e3 * x, 3) for x in xs]


def main(argv=None) -> int:
    a = parse(argv)
    t_start = time.perf_counter()
    from gemzoo.api import PartitionWorker, route_checked

    out = {"config": os.path.relpath(a.config, ROOT), "plugins": a.plugins, "dry_run": a.dry_run,
           "steps": a.steps, "warmup": a.warmup, "per_rank": a.per_rank, "depth": a.depth, "target_pct": TARGET_PCT,
           "torch": torch.__version__, "phases": {}, "worlds": [], "notes": []}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)

    def write():
        out["wall_s"] = round(time.perf_counter() - t_start, 1)
        Path(a.out).write_text(json.dumps(out, indent=1))

    def budget_left(what: str) -> bool:
        spent = time.perf_counter() - t_start
        if spent > a.budget_s:
            out["notes"].append(f"{what}: not run, {spent:.0f} s spent (--budget-s {a.budget_s:g})")
            print(out["notes"][-1], flush=True)
            write()
            return False
        return True

    tr = build_trainer(a)
    workers = {kind: PartitionWorker(kind, a.depth) for kind in a.workers}  # processes start (import torch) meanwhile
    if tr.device.type != "cpu":  # as the trainer's Lookahead does on a GPU run
        for w in workers.values():
            w.leave_a_core()
    out["device"] = torch.cuda.get_device_name(tr.device) if tr.device.type == "cuda" else str(tr.device)
    out["assemble_s"] = round(time.perf_counter() - t_start, 1)
    out["cpu"] = cpu_facts(workers)
    measured = range(a.warmup, a.steps)
    t0 = time.perf_counter()
    for step in range(a.warmup):
        timed_step(tr, step)
    out["warmup_s"] = round(time.perf_counter() - t0, 1)
    print(f"CPUs: {out['cpu']}", flush=True)
    print(f"assembled in {out['assemble_s']} s, {a.warmup} warmup steps in {out['warmup_s']} s", flush=True)

    def phase(label: str, **hooks) -> list[float]:
        host: list = []
        times = [timed_step(tr, s, host=host, **hooks) for s in measured]
        med = statistics.median(times)
        out["phases"][label] = {"step_ms": ms(times), "median_ms": round(1e3 * med, 3), **host_summary(host)}
        print(f"{label:28s} median step {1e3 * med:9.2f} ms", flush=True)
        write()
        return times

    phase("none")
    if not budget_left("base-batch-shuffle"):
        return 0
    policy = use_policy(tr, "base-batch-shuffle")
    base = phase("base-batch-shuffle")
    base_med = statistics.median(base)
    out["phases"]["base-batch-shuffle"]["vs_none_pct"] = round(
        100 * (base_med / out["phases"]["none"]["median_ms"] * 1e3 - 1), 3)
    out["notes"].append("one rank never calls a batching policy: base-batch-shuffle's row is the one-rank path "
                        "with the policy selected (equal to none up to noise); the partition's cost is in worlds")
    try:
        for w in a.worlds:
            if not budget_left(f"world {w}"):
                break
            draws = {s: global_costs(tr, w, a.per_rank, seed=1000 * w + s) for s in measured}
            alone = []
            for s in measured:
                t = time.perf_counter()
                route_checked(policy, draws[s], [a.per_rank] * w, 0, "base-batch-shuffle")
                alone.append(time.perf_counter() - t)
            alone_med = statistics.median(alone)
            row = {"world": w, "samples": w * a.per_rank,
                   "alone": {"assign_ms": ms(alone), "median_ms": round(1e3 * alone_med, 3),
                             "pct_of_step": round(100 * alone_med / base_med, 3)}}
            print(f"W={w:5d} N={w * a.per_rank:7d}  assign alone {1e3 * alone_med:8.2f} ms "
                  f"({100 * alone_med / base_med:6.2f}% of the step)", flush=True)
            out["worlds"].append(row)
            for kind, worker in workers.items():
                if not budget_left(f"world {w}, {kind} worker"):
                    break
                row[kind] = overlapped(tr, worker, policy, draws, w, measured, base, base_med, a.depth)
                r = row[kind]
                print(f"{'':20s}overlapped in a {kind:7s}: wait {r['wait_median_ms']:7.2f} ms (max "
                      f"{r['wait_max_ms']:.2f}), step overhead {r['overhead_ms']:+8.2f} ms ({r['overhead_pct']:+.2f}%); main thread "
                      f"CPU {r['main_cpu_median_ms']:.1f} ms, run-queue wait {r['main_runq_wait_median_ms']:.2f} ms, "
                      f"process CPU {r['process_cpu_median_ms']:.1f} ms, batch wait {r['load_wait_median_ms']:.2f} ms "
                      f"(max {r['load_wait_max_ms']:.2f})",
                      flush=True)
                write()
    finally:
        for worker in workers.values():
            worker.shutdown()
    write()
    print(f"wrote {a.out} ({out['wall_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
