"""Per-step metrics (loss, throughput, TFLOP/s, MFU, peak memory) and the metrics.jsonl log."""

from __future__ import annotations

import json
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


def step_metrics(*, loss: float, seconds: float, samples: int, tokens: int, flops: int,
                 peak_flops: float, device: torch.device) -> dict[str, float]:
    achieved = flops / seconds if seconds > 0 else 0.0
    return {
        "loss": loss,
        "step_s": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tflops": achieved / 1e12,
        "mfu": achieved / peak_flops,
        "peak_mem_gib": peak_memory_bytes(device) / 2**30,
    }


class MetricsLog:
    """Appends one JSON object per line to ``<out_dir>/metrics.jsonl`` (flushed every write)."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps({"time": time.time(), **record}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
