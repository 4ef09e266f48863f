"""gem and hstu with model.attention_block_size / attention_window / rope_theta: the sites ask for block,
window and rotary, assembly requires a kernel that declares them, block-attention serves them, FLOPs count
only the allowed pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gemzoo.api import ConfigError, PluginError, attention_pairs, attention_sites, load_config
from gemzoo.testing import select_attention

ROOT = Path(__file__).resolve().parents[3]
OPTS = ["model.attention_block_size=8", "model.attention_window=5", "model.rope_theta=10000.0"]


def _model(family, overrides):
    from gemzoo.api import registry
    from gemzoo.testing import SyntheticGemConfig, SyntheticGemDataset

    cfg = load_config(ROOT / "configs" / "gem-tiny.toml", overrides=overrides)
    if family == "gem":
        data = SyntheticGemDataset(SyntheticGemConfig(batch_size=8, max_len=40, median_len=10, num_items=100,
                                                      max_candidates=4), seed=0)
        info = data.info
    else:
        data, info = None, {"num_items": 100, "max_len": 40, "task": "retrieval"}
    spec = registry.get("model", family)
    model_cfg = spec.config_cls(**{k: v for k, v in vars(cfg.model).items() if hasattr(spec.config_cls, k)}) \
        if family != "gem" else cfg.model
    if family == "hstu":
        model_cfg = spec.config_cls(embedding_dim=16, num_heads=2, num_layers=1, attention_block_size=8,
                                    attention_window=5, rope_theta=10000.0)
    return cfg, spec.build(model_cfg, info), data


@pytest.mark.parametrize("family", ["gem", "hstu"])
def test_sites_request_block_window_rotary(family):
    cfg, model, _ = _model(family, OPTS)
    self_sites = {n: s for n, s in attention_sites(model).items() if "cross" not in n}
    assert self_sites
    for site in self_sites.values():
        assert site.request.block and site.request.window and site.request.rotary
        assert site.options["block_size"] == 8 and site.options["window"] == 5 and site.options["rope_theta"] == 1e4
    cross = [s for n, s in attention_sites(model).items() if "cross" in n]
    assert all(not (s.request.block or s.request.rotary) for s in cross), "cross attention stays dense"


@pytest.mark.parametrize("family", ["gem", "hstu"])
def test_assembly_requires_a_kernel_that_declares_them(family):
    cfg, model, _ = _model(family, OPTS)
    cfg.plugins.attention = "jfa"
    with pytest.raises(PluginError, match="lacks.*(block_size|window|rope).*block-attention"):
        select_attention(model, cfg, torch.device("cpu"), torch.float32)
    cfg.plugins.attention = "block-attention"
    chosen = select_attention(model, cfg, torch.device("cpu"), torch.float32)
    assert set(chosen.values()) == {"block-attention"}


def test_default_is_off():
    _, model, _ = _model("gem", [])
    for site in attention_sites(model).values():
        assert not (site.request.block or site.request.rotary or "block_size" in site.options)


@pytest.mark.parametrize("bad,match", [("model.attention_block_size=-1", "attention_block_size"),
                                       ("model.rope_theta=-5.0", "rope_theta")])
def test_bad_values_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        _model("gem", [bad])


def test_gem_forward_backward_and_flops_on_allowed_pairs():
    cfg, model, data = _model("gem", OPTS)
    cfg.plugins.attention = "block-attention"
    select_attention(model, cfg, torch.device("cpu"), torch.float32)
    model.init_weights()
    batch = data.train_batch(0)
    out = model(batch)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    dense = attention_pairs(batch.lengths, causal=True)
    sparse = attention_pairs(batch.lengths, causal=True, block_size=8, window=5)
    assert sparse < dense
    from gemzoo.api import attention_flops

    _, plain, _ = _model("gem", [])
    c = plain.cfg
    assert plain.flops(batch) - model.flops(batch) == c.num_layers * attention_flops(
        dense - sparse, c.num_heads, c.head_dim or c.d_model // c.num_heads)
