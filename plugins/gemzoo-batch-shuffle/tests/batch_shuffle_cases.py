"""Helpers of gemzoo-batch-shuffle's tests (a package-unique module name, imported as ``batch_shuffle_cases``)."""

from __future__ import annotations

import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def gem_lognormal(b: int, median: float = 1024, sigma: float = 1.0, lo: int = 32, hi: int = 16384,
                  seed: int = 1) -> torch.Tensor:
    """The gem-lognormal lengths of docs/benchmarks.md."""
    z = torch.randn(b, generator=torch.Generator().manual_seed(seed))
    return (median * torch.exp(sigma * z)).round().clamp(lo, hi).long()


def sample_keys(batch) -> list[str]:
    """One string per sample of a GemBatch: its history and candidate items (identifies a synthetic sample)."""
    h, c = batch.history_offsets.tolist(), batch.cand_offsets.tolist()
    hi, ci = batch.history_items.tolist(), batch.cand_items.tolist()
    return [f"{hi[h[i]:h[i + 1]]}|{ci[c[i]:c[i + 1]]}" for i in range(len(h) - 1)]


def train_rank(rank: int, world: int, port: int, tmp: str, runs: list) -> None:
    """One rank of the trainer test: gem-tiny (tiny widths, odd batch) under each (label, policy, steps,
    resume, options) of ``runs`` in one process group; writes each run's losses, samples per step, whether each
    step's partition was computed ahead (the Lookahead's worker) and the keys of the samples this rank trained
    at each step (``loaded``: the keys of the part it loaded, the contiguous split)."""
    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    import torch.distributed as dist

    from gemzoo.api import Lookahead, TrainingError, hookimpl, load_config, load_shard, registry, train

    seen, ahead, keys, loaded = [], [], [], []

    class Record:
        @hookimpl
        def gemzoo_step_end(self, trainer, step, metrics):
            seen.append(round(metrics["samples_per_s"] * metrics["step_s"]))
            ahead.append(trainer.lookahead.last["ahead"])

    original = Lookahead.batch

    def recording(self, dataset, step, dp, *args, **kwargs):
        mine = original(self, dataset, step, dp, *args, **kwargs)
        keys.append(sample_keys(mine))
        loaded.append(sample_keys(load_shard(dataset, step, dp.rank, dp.size)))
        return mine

    Lookahead.batch = recording
    registry.host().register(Record(), name="record")
    out = {}
    for label, policy, steps, resume, options in runs:
        for got in (seen, ahead, keys, loaded):
            got.clear()
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
                      "samples": list(seen), "ahead": list(ahead), "keys": list(keys), "loaded": list(loaded)}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
