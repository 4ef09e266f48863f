"""One plugin set of an ablation, in its own process: ``python -m gemzoo.cli.ablate_run SPEC.json``.

``gemzoo ablate`` (``gemzoo.cli.ablate.run_one``) writes the spec (config, plugins, steps, warm-up, overrides, run
folder, where the result goes) and starts this module; it trains the set and writes the result JSON, whose peak
memory is this process's own.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from gemzoo import __version__
from gemzoo.config import load_config
from gemzoo.train.trainer import train

MEDIAN_KEYS = ("samples_per_s", "tokens_per_s", "tflops", "mfu", "step_s")


def child_main(spec_path: str) -> int:
    """Train one plugin set (run in its own process by ``run_one``) and write ``result.json``."""
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"plugins": spec["plugins"]}
    try:
        result.update(_train_and_summarise(spec))
    except BaseException as exc:  # noqa: BLE001 - the row must say what failed, whatever it was
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    cuda = torch.cuda.is_initialized()
    if "peak_mem_source" not in result and cuda:  # a GPU run that failed: how far it got before failing
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_mem_source"] = "torch.cuda.max_memory_allocated"
    peak = peak_rss_bytes()
    if "peak_mem_source" not in result and peak is not None:  # CPU: this process's own high-water mark
        result["peak_mem_gib"] = peak / 2**30
        result["peak_mem_source"] = "peak RSS of the run's process"
    Path(spec["result"]).write_text(json.dumps(result, indent=1, default=str))
    return 0 if "error" not in result else 1


def peak_rss_bytes() -> int | None:
    """This process's peak resident set since its exec: VmHWM of /proc/self/status (Linux).

    Not ``getrusage().ru_maxrss``: on Linux that keeps the high-water mark of the address space the process
    replaced at exec, i.e. the parent's resident set at fork, so every run would report at least the
    ablation process's own size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if sys.platform == "darwin":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, and exec resets it there
    return None


def _train_and_summarise(spec: dict) -> dict:
    steps, warmup = spec["steps"], spec["warmup"]
    overrides = [*spec["overrides"], f"run.steps={steps}", "checkpoint.every=0",
                 f"run.out_dir={json.dumps(spec['run_dir'])}"]
    cfg = load_config(spec["config"], overrides=overrides, plugins=spec["plugins"])
    # a row per step; with run.sync = "log" a row (and a wait for the device) per warm-up's worth of steps, so the
    # first stretch is exactly the warm-up and the medians see whole stretches (result.history has every step)
    cfg.run.log_every = 1 if cfg.run.sync == "step" else max(1, warmup)
    cfg.run.warmup = warmup  # the run's own mean over wall-clock time leaves out the same steps
    if cfg.eval.every > 0:  # evaluate once, after the last step: timings stay clean
        cfg.eval.every = steps
    cuda = torch.cuda.is_available() and not cfg.run.device.startswith("cpu")
    if cuda:  # not on a CPU run: that would start CUDA, and the row would report CUDA's peak, not the RSS
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train(cfg, progress=False)
    wall = time.perf_counter() - t0
    history = result.history
    kept = history[warmup:] if len(history) > warmup else history
    out = {"status": "ok", "steps": len(history), "wall_s": wall, "final_loss": result.final_loss,
           "mfu_peak": history[-1]["mfu_peak"], "eval": dict(result.eval), "gemzoo": __version__,
           **{k: statistics.median(r[k] for r in kept) for k in MEDIAN_KEYS},
           **result.throughput}  # mean_samples_per_s, mean_mfu, max_step_s, ...: the steps after warm-up
    if cuda:
        out["peak_mem_gib"] = max(r["peak_mem_gib"] for r in history)
        out["peak_mem_source"] = "torch.cuda.max_memory_allocated"
        out["device"] = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        out["device_memory_gib"] = props.total_memory / 2**30
    else:
        out["device"] = "cpu"
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m gemzoo.cli.ablate_run SPEC.json (written by gemzoo ablate)")
    sys.exit(child_main(sys.argv[1]))
