"""Plugin selection, hook isolation and install hints (issue #10, items 7, 9 and 10)."""

from __future__ import annotations

import pytest

from gemzoo.config import load_config
from gemzoo.errors import PluginError

RAW = {"run": {"steps": 1}, "model": {"family": "gem"}, "data": {"source": "synthetic-gem"}}


@pytest.mark.parametrize("plugins,kind,first,second", [
    ("reference,cpu", "attention", "reference", "cpu"),
    ("sdpa-padded,fp32,bf16", "precision", "fp32", "bf16"),
])
def test_two_plugins_of_one_kind_are_an_error(fresh_registry, plugins, kind, first, second):
    with pytest.raises(PluginError) as exc:
        load_config(raw=dict(RAW), plugins=plugins)
    msg = str(exc.value)
    assert kind in msg and repr(first) in msg and repr(second) in msg


def test_one_plugin_per_kind_and_repeats_are_fine(fresh_registry):
    cfg = load_config(raw=dict(RAW), plugins="cpu,bf16,cpu,full-ac")
    assert (cfg.plugins.attention, cfg.plugins.precision, cfg.plugins.memory) == ("cpu", "bf16", ["full-ac"])
