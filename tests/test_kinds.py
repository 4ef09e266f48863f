"""The kinds table (gemzoo.kinds) agrees with every list that still keeps its own copy: the registry's hooks,
the hookspecs, config's PLUGIN_KINDS and PluginsConfig (the memory-is-a-list rule, the defaults), the CLI's
``list`` choices and the trainer's selected plugins. While they agree, deriving them from the table is safe
(issue #9 item 1)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from types import SimpleNamespace

import pytest

from gemzoo import hookspecs, kinds, registry
from gemzoo.kinds import KINDS


def test_registry_hooks_are_the_kinds_table():
    assert registry.KINDS == kinds.hooks()
    assert list(registry.KINDS) == kinds.names()  # same order: `gemzoo plugins` and entries() list by it


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_each_hook_is_a_hookspec(kind):
    spec = getattr(hookspecs, kind.hook, None)
    assert spec is not None and hasattr(spec, "gemzoo_spec"), f"{kind.hook} is not a hookspec in gemzoo.hookspecs"
    assert kind.hook.startswith("gemzoo_register_")


def test_config_plugin_kinds_and_slots():
    from gemzoo.config import PLUGIN_KINDS, PluginsConfig

    assert list(PLUGIN_KINDS) == [k.name for k in kinds.plugin_kinds()]
    slots = {f.name: f for f in dataclasses.fields(PluginsConfig)}
    defaults = PluginsConfig()
    for kind in kinds.plugin_kinds():
        assert kind.slot in slots, f"PluginsConfig has no field {kind.slot!r} for kind {kind.name}"
        value = getattr(defaults, kind.slot)
        if kind.many:
            assert isinstance(value, list) and tuple(value) == kind.default, kind.name
        else:
            assert isinstance(value, str) and value == kind.default, kind.name


def test_model_and_dataset_are_named_in_their_sections():
    """[model] family and [data] source: no default, the config must name one."""
    for name, section in (("model", "model"), ("dataset", "data")):
        k = kinds.kind(name)
        assert not k.in_plugins and k.default is None and k.config_key.split(".")[0] == section


def test_defaults_are_registered():
    for kind in KINDS:
        wanted = kind.default if isinstance(kind.default, tuple) else (kind.default,) if kind.default else ()
        for name in wanted:
            assert name in registry.names(kind.name), f"default {kind.name} {name!r} is not registered"


def test_cli_list_choices_are_the_kinds():
    from gemzoo.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    kind_arg = next(a for a in sub.choices["list"]._actions if a.dest == "kind")
    assert list(kind_arg.choices) == kinds.names()


def test_trainer_selects_one_name_per_plugin_kind():
    from gemzoo.config import PluginsConfig
    from gemzoo.train.trainer import Trainer

    values = {k.slot: ([f"{k.name}-a", f"{k.name}-b"] if k.many else f"{k.name}-x") for k in kinds.plugin_kinds()}
    fake = SimpleNamespace(cfg=SimpleNamespace(plugins=PluginsConfig(**values)))
    want = {n for v in values.values() for n in (v if isinstance(v, list) else [v])}
    assert Trainer._selected_names(fake) == want


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_conformance_module_exists(kind):
    module = importlib.import_module(kind.conformance)
    assert module.__doc__, f"{kind.conformance} needs a docstring saying what it checks"


def test_unknown_kind_names_the_kinds():
    with pytest.raises(KeyError, match="attention, precision"):
        kinds.kind("attentoin")
