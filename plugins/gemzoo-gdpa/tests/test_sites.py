"""Per-site kernel choice ([plugins.attention_sites]) and gem's model.cross_activation, on CPU."""

from __future__ import annotations

import pytest
import torch

from gemzoo.api import ConfigError, PluginError, Trainer, load_config, train


def _cfg(tmp_path, *overrides, plugins="jfa", steps=2):
    return load_config(_tiny(), plugins=plugins,
                       overrides=[f"run.steps={steps}", "eval.every=0", "checkpoint.every=0",
                                  f"run.out_dir={tmp_path / 'run'}", *overrides])


def _tiny():
    from pathlib import Path

    return Path(__file__).resolve().parents[3] / "configs" / "gem-tiny.toml"


def test_cross_site_on_gdpa_tower_on_jfa(tmp_path):
    cfg = _cfg(tmp_path, "model.cross_activation=silu", "plugins.attention_sites.cross=gdpa")
    trainer = Trainer(cfg, progress=False)
    trainer.assemble()
    chosen = dict(trainer.attention_plan)
    assert chosen.pop("cross.attn") == "gdpa"
    assert chosen and set(chosen.values()) == {"jfa"}


def test_trains_with_pointwise_cross_attention(tmp_path):
    result = train(_cfg(tmp_path, "model.cross_activation=gelu", "plugins.attention_sites.cross=gdpa"), progress=False)
    assert torch.isfinite(torch.tensor(result.final_loss))


def test_pointwise_cross_needs_a_kernel_that_declares_it(tmp_path):
    with pytest.raises(PluginError, match=r"'jfa' cannot serve cross\.attn.*gdpa.*attention_sites"):
        Trainer(_cfg(tmp_path, "model.cross_activation=silu"), progress=False).assemble()


def test_site_key_must_name_a_site_and_a_kernel(tmp_path):
    with pytest.raises(ConfigError, match="names no attention site"):
        Trainer(_cfg(tmp_path, "plugins.attention_sites.crosss=gdpa"), progress=False).assemble()
    with pytest.raises((ConfigError, PluginError), match="nope"):
        _cfg(tmp_path, "plugins.attention_sites.cross=nope")
    with pytest.raises(ConfigError, match="cross_activation"):
        Trainer(_cfg(tmp_path, "model.cross_activation=tanh"), progress=False).assemble()
