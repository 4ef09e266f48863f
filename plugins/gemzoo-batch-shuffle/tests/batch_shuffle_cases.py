"""Helpers of gemzoo-batch-shuffle's tests (a package-unique module name, imported as ``batch_shuffle_cases``)."""

from __future__ import annotations

import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def gem_lognormal(b: int, median: float = 1024, sigma: float = 1.0, lo: int = 32, hi: int = 16384,
                  seed: int = 1) -> torch.Tensor:
    """BENCHMARKS.md's gem-lognormal lengths."""
    z = torch.randn(b, generator=torch.Generator().manual_seed(seed))
    return (median * torch.exp(sigma * z)).round().clamp(lo, hi).long()


def train_rank(rank: int, world: int, port: int, tmp: str, runs: list) -> None:
    """One rank of the trainer test: gem-tiny (tiny widths, odd batch) under each (label, policy, steps,
    resume, options) of ``runs`` in one process group; writes each run's losses and samples per step."""
    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    import torch.distributed as dist

    import gemzoo
    from gemzoo import registry
    from gemzoo.config import load_config
    from gemzoo.errors import TrainingError
    from gemzoo.train.trainer import train

    seen = []

    class Record:
        @gemzoo.hookimpl
        def gemzoo_step_end(self, trainer, step, metrics):
            seen.append(round(metrics["samples_per_s"] * metrics["step_s"]))

    registry.host().register(Record(), name="record")
    out = {}
    for label, policy, steps, resume, options in runs:
        seen.clear()
        cfg = load_config(os.path.join(ROOT, "configs", "gem-tiny.toml"), overrides=[
            f"run.steps={steps}", "run.device='cpu'", "eval.every=0", "checkpoint.every=5",
            f"run.out_dir='{tmp}/{label.split('@')[0]}'", "data.batch_size=9", "model.d_model=16",
            "model.embedding_dim=8", f"plugins.batching='{policy}'", *options])
        try:
            result = train(cfg, resume=resume, progress=False)
        except TrainingError as e:  # e.g. a world larger than the batch: every rank must raise, none hang
            out[label] = {"error": str(e)}
            continue
        out[label] = {"losses": [h["loss"] for h in result.history], "steps": [h["step"] for h in result.history],
                      "samples": list(seen)}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
