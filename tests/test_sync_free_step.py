"""A training step reads nothing back from the device, checked on the CPU with the meta device.

``Trainer.launch_step`` must only queue work: under ``run.sync = "log"`` the host then runs ahead of the GPU.
A read of a device value (``.item()``, ``int(t)``, a boolean mask, ``nonzero``, a ``repeat_interleave``
without ``output_size``) would stall the host until the GPU's queue drains. On the meta device a tensor has a
shape and no data, so every such read raises, while the batch's host copy (``host_view``) stays on the CPU,
as it does beside a GPU: here the whole step (prefetched batch, embeddings, every block, the loss, backward,
clipping, the optimizers, precision and memory policies) runs on meta, for every model family and precision
policy. The attention kernels are swapped for a shape-only probe that runs the shared input check (the kernels
run on no meta device; the jfa family's launch path has its own meta check in its plugin's tests, and
``test_a_gem_step_queues_on_cuda_without_a_host_sync`` covers the real step on a GPU).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gemzoo
from gemzoo import registry
from gemzoo.attention import FunctionKernel, check_inputs
from gemzoo.config import load_config
from gemzoo.interfaces.attention import AttentionCapabilities
from gemzoo.testing.models import _ratings

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL_RETRIEVAL = ["model.embedding_dim=16", "model.num_layers=1", "model.num_heads=2", "data.batch_size=8"]


def _shape_probe(q, k, v, q_offsets, k_offsets=None, **kw):
    """[Tq, H, Dv] from q's rows and v's width; every input reaches the output, so gradients flow to each.
    First the shared input check every kernel runs: an offsets tensor the model did not validate from its host
    copy would be validated here, from the device (a sync), and raises on meta."""
    check_inputs(q, k, v, q_offsets, k_offsets, capabilities=PROBE.capabilities, kernel=PROBE, **kw)
    return (q[..., :1] * 0 + k.sum() * 0 + v.sum() * 0).expand(*q.shape[:-1], v.shape[-1]) + 0


PROBE = FunctionKernel(_shape_probe, AttentionCapabilities(
    activations=frozenset({"softmax", "silu"}), window=True, block=True, bias=True, relative_bias=True, rotary=True,
    devices=frozenset({"meta"}), backward_devices=frozenset({"meta"})), "shapes only, for meta-device steps")


def _launch_on_meta(monkeypatch, tmp_path, config: str, plugins: str, extra=()):
    import gemzoo.train.trainer as trainer_mod

    registry.host().register(SimpleNamespace(gemzoo_register_attention=gemzoo.hookimpl(
        lambda register: register("meta-probe", PROBE))), name="meta-probe")
    monkeypatch.setattr(trainer_mod, "pick_device", lambda name, world: torch.device("meta"))
    cfg = load_config(CONFIGS / config, plugins=f"meta-probe,{plugins}", overrides=[
        *extra, "run.steps=4", "eval.every=0", "checkpoint.every=0", "run.sync='log'",
        f"run.out_dir='{tmp_path / 'run'}'"])
    trainer = trainer_mod.Trainer(cfg, progress=False).assemble()
    assert trainer.device.type == "meta"
    real = [n for n, p in trainer.model.named_parameters() if p.device.type != "meta"]
    assert not real, f"parameters off the meta device: {real[:3]}"
    with trainer.lookahead:
        launched = [trainer.launch_step(step) for step in range(3)]  # steps 1 and 2: prefetched batches
    assert all(s.loss.device.type == "meta" and s.sums["flops"] > 0 for s in launched)
    return trainer


def _retrieval(name: str, tmp_path) -> tuple[str, list[str]]:
    return f"{name}-ml1m.toml", [f"data.path='{_ratings(tmp_path / 'ratings.dat', users=48)}'", *SMALL_RETRIEVAL]


@pytest.mark.parametrize("precision", registry.names("precision"))
def test_a_gem_step_reads_no_device_value(fresh_registry, monkeypatch, tmp_path, precision):
    _launch_on_meta(monkeypatch, tmp_path, "gem-tiny.toml", precision)


# auto-ac compiles the blocks it checkpoints (Inductor has no meta backend); run.compile likewise
@pytest.mark.parametrize("memory", [n for n in registry.names("memory") if n not in ("none", "auto-ac")])
def test_a_gem_step_with_a_memory_policy_reads_no_device_value(fresh_registry, monkeypatch, tmp_path, memory):
    _launch_on_meta(monkeypatch, tmp_path, "gem-tiny.toml", f"bf16,{memory}")


@pytest.mark.slow
def test_the_gem_bench_step_reads_no_device_value(fresh_registry, monkeypatch, tmp_path):
    """gem-bench's own model and data (16 tables of 1M rows cost nothing on meta), eager."""
    _launch_on_meta(monkeypatch, tmp_path, "gem-bench.toml", "bf16", ["run.compile=false"])


@pytest.mark.parametrize("family", ["hstu", "sasrec"])
def test_a_retrieval_step_reads_no_device_value(fresh_registry, monkeypatch, tmp_path, family):
    """The positions with a target are counted on the host copy (a boolean mask was a sync), and hstu's time
    buckets pad without one (``ops.jagged_to_padded``'s torch path)."""
    config, extra = _retrieval(family, tmp_path)
    _launch_on_meta(monkeypatch, tmp_path, config, "bf16", extra)


def test_a_device_read_in_the_step_is_caught(fresh_registry, monkeypatch, tmp_path):
    """The check can fail: a model that reads a device value in its forward raises on meta."""
    from gemzoo.models.gem import GemModel

    plain = GemModel.forward

    def reads(self, batch):
        out = plain(self, batch)
        if float(out.loss) > 0:  # what a stray loss check would do
            pass
        return out

    monkeypatch.setattr(GemModel, "forward", reads)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        _launch_on_meta(monkeypatch, tmp_path, "gem-tiny.toml", "bf16")
