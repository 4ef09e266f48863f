"""Per-step metrics (loss, throughput, TFLOP/s, MFU, peak memory) and the metrics.jsonl log."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return int(rss_kib * (1 if sys.platform == "darwin" else 1024))


def step_metrics(*, loss: float, seconds: float, samples: int, tokens: int, flops: float,
                 peak_flops: float, device: torch.device, peak_mem_bytes: float | None = None) -> dict[str, float]:
    """One step's numbers; ``peak_flops`` is the peak of every device the step ran on."""
    achieved = flops / seconds if seconds > 0 else 0.0
    if peak_mem_bytes is None:
        peak_mem_bytes = peak_memory_bytes(device)
    return {
        "loss": loss,
        "step_s": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tflops": achieved / 1e12,
        "mfu": achieved / peak_flops,
        "peak_mem_gib": peak_mem_bytes / 2**30,
    }


def stretch_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """The throughput of several consecutive steps as one: their samples, tokens and FLOPs over their summed
    time (a metrics row that stands for the steps since the last one reports what those steps did, not the
    last step's count over the stretch's mean time)."""
    seconds = sum(m["step_s"] for m in steps)
    if seconds <= 0:
        return {}
    out = {k: sum(m[k] * m["step_s"] for m in steps) / seconds for k in ("samples_per_s", "tokens_per_s",
                                                                          "tflops", "mfu")}
    out["step_s"] = seconds / len(steps)
    return out


class Throughput:
    """A run's throughput over wall-clock time after warm-up: every step after the first ``warmup`` counts, with
    its samples, tokens and FLOPs, over the summed time of those steps (each step timed from the end of the one
    before it, so loading, stalls and compiles count; evaluation and checkpoint writes between steps do not).

    ``summary()`` gives ``mean_samples_per_s``, ``mean_tokens_per_s``, ``mean_tflops``, ``mean_mfu`` (those
    steps' model FLOPs over their time and the peak), ``mean_step_s``, ``median_step_s`` and ``max_step_s`` (with
    ``run.sync = "log"``, a step's time is its stretch's mean), and ``measured_steps``."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.seen = 0
        self.seconds = 0.0
        self.samples = self.tokens = self.flops = self.peak = 0.0
        self.step_s: list[float] = []

    def add(self, metrics: dict[str, float]) -> None:
        self.seen += 1
        if self.seen <= self.warmup:
            return
        s = metrics["step_s"]
        self.seconds += s
        self.samples += metrics["samples_per_s"] * s
        self.tokens += metrics["tokens_per_s"] * s
        self.flops += metrics["tflops"] * 1e12 * s
        if metrics["mfu"] > 0:
            self.peak = metrics["tflops"] * 1e12 / metrics["mfu"]
        self.step_s.append(s)

    @property
    def warmed_up(self) -> bool:
        return self.seen >= self.warmup

    def summary(self) -> dict[str, float]:
        if not self.step_s or self.seconds <= 0:
            return {}
        ordered = sorted(self.step_s)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        tflops = self.flops / self.seconds / 1e12
        return {"mean_samples_per_s": self.samples / self.seconds, "mean_tokens_per_s": self.tokens / self.seconds,
                "mean_tflops": tflops, "mean_mfu": tflops * 1e12 / self.peak if self.peak else 0.0,
                "mean_step_s": self.seconds / len(ordered), "median_step_s": median, "max_step_s": ordered[-1], "measured_steps": len(ordered),
                "warmup_steps": self.warmup}


def reduce_across_ranks(values: dict[str, float], op: str, device: torch.device, group=None) -> dict[str, float]:
    """All-reduce a few numbers at once (``op`` "sum" or "max"), in float64, over ``group`` (default: every
    rank) with the tensor on ``device``; every rank of the group must call it. Host numbers reduced over a gloo
    group on the CPU (``World.host_group``) need no wait for the GPU's queue; on the GPU the read-back does."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return dict(values)
    t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return dict(zip(values, t.tolist(), strict=True))


def json_safe(value):
    """NaN and infinities become None (JSON null): ``json.dumps`` would write NaN, which is not JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def last_step_row(path: str | Path, step: int) -> dict | None:
    """The row of ``metrics.jsonl`` logged at ``step`` (the last one if several), or None."""
    path = Path(path)
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "event" not in record and record.get("step") == step:
            found = record
    return found


class MetricsLog:
    """Appends one JSON object per line to ``<out_dir>/metrics.jsonl`` (flushed every write)."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(json_safe({"time": time.time(), **record}), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
