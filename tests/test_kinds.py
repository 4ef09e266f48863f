"""The kinds table (gemzoo.kinds) is the one list of kinds: the registry's hooks, config's PluginsConfig (the
memory-is-a-list rule, the defaults) and ``--plugins``, the CLI's ``list`` choices and the trainer's selected
plugins all derive from it. The last test adds a kind to the table in a subprocess, touching
nothing else of gemzoo, and uses it end to end."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from gemzoo import hookspecs, kinds, registry
from gemzoo.errors import PluginError
from gemzoo.kinds import KINDS
from gemzoo.testing.timeouts import hang_guard


def test_registry_kinds_are_the_table():
    for name in kinds.names():
        assert registry.names(name), f"no {name} is registered"  # every kind of the table is a registry kind
    assert list(dict.fromkeys(e.kind for e in registry.entries())) == kinds.names()  # listed in table order
    with pytest.raises(PluginError, match="the kinds are: attention, precision"):
        registry.names("attentoin")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_each_hook_is_a_hookspec(kind):
    spec = getattr(hookspecs, kind.hook, None)
    assert spec is not None and hasattr(spec, "gemzoo_spec"), f"{kind.hook} is not a hookspec in gemzoo.hookspecs"
    assert kind.hook.startswith("gemzoo_register_")


def test_plugins_config_slots_are_the_plugin_kinds():
    from gemzoo.config import PluginsConfig

    names = [f.name for f in dataclasses.fields(PluginsConfig)]
    assert names == [k.slot for k in kinds.plugin_kinds()] + ["options", "attention_sites"]
    defaults = PluginsConfig()
    for kind in kinds.plugin_kinds():
        value = getattr(defaults, kind.slot)
        if kind.many:
            assert isinstance(value, list) and tuple(value) == kind.default, kind.name
        else:
            assert isinstance(value, str) and value == kind.default, kind.name
    assert PluginsConfig().memory is not PluginsConfig().memory  # a fresh list each time


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


def test_selected_gives_every_plugin_kind_its_names():
    from gemzoo.config import PluginsConfig
    from gemzoo.train.trainer import Trainer

    values = {k.slot: ([f"{k.name}-a", f"{k.name}-b"] if k.many else f"{k.name}-x") for k in kinds.plugin_kinds()}
    plugins = PluginsConfig(**values)
    assert kinds.selected(plugins) == {k.name: [values[k.slot]] if not k.many else values[k.slot]
                                       for k in kinds.plugin_kinds()}
    want = {n for v in values.values() for n in (v if isinstance(v, list) else [v])}
    assert Trainer._selected_names(SimpleNamespace(cfg=SimpleNamespace(plugins=plugins))) == want


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_conformance_module_exists(kind):
    module = importlib.import_module(kind.conformance)
    assert module.__doc__, f"{kind.conformance} needs a docstring saying what it checks"


def test_unknown_kind_names_the_kinds():
    with pytest.raises(KeyError, match="attention, precision"):
        kinds.kind("attentoin")


# A new kind "toys" (a list kind, like memory): its hookspec, its Protocol and its row of the table, and nothing
# else. Everything below the marked line is ordinary use of gemzoo.
NEW_KIND = textwrap.dedent('''
    import argparse, dataclasses, json, sys
    from typing import Protocol, runtime_checkable

    import pluggy
    from gemzoo import hookspecs, kinds

    @hookspecs.hookspec
    def gemzoo_register_toys(register):
        """Register toys."""

    @runtime_checkable
    class Toy(Protocol):
        def play(self) -> str: ...

    hookspecs.gemzoo_register_toys = gemzoo_register_toys
    kinds.KINDS = kinds.KINDS + (kinds.Kind("toys", "gemzoo_register_toys", Toy, True, "plugins.toys",
                                            ("ball",), "gemzoo.testing.memory", description="toys"),)
    # ---------------------------------------------------------------------------- nothing patched below
    from gemzoo import registry
    from gemzoo.cli import build_parser
    from gemzoo.config import PluginsConfig, load_config
    from gemzoo.errors import PluginError
    from gemzoo.plugins import hookimpl
    from gemzoo.train.trainer import Trainer

    class Ball:
        def play(self): return "bounce"

    class ToyBox:
        @hookimpl
        def gemzoo_register_toys(self, register):
            register("ball", Ball())
            register("kite", Ball())

    registry.host().register(ToyBox(), "toybox", distribution="gemzoo-toybox")
    out = {"names": registry.names("toys"), "play": registry.get("toys", "kite").play(),
           "fields": [f.name for f in dataclasses.fields(PluginsConfig)], "default": PluginsConfig().toys}
    cfg = load_config("configs/gem-tiny.toml", plugins="kite,reference")
    out["toys"], out["attention"] = cfg.plugins.toys, cfg.plugins.attention
    out["one_name"] = load_config("configs/gem-tiny.toml", overrides=['plugins.toys="kite"']).plugins.toys
    out["selected"] = sorted(Trainer._selected_names(argparse.Namespace(cfg=cfg)))
    try:
        load_config("configs/gem-tiny.toml", overrides=['plugins.toys=["kyte"]'])
    except PluginError as exc:
        out["error"] = str(exc)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out["cli"] = list(next(a for a in sub.choices["list"]._actions if a.dest == "kind").choices)
    out["new_plugin"] = list(next(a for a in sub.choices["new-plugin"]._actions if a.dest == "kind").choices)
    print(json.dumps(out))
''')


@pytest.mark.multiprocess
def test_a_new_kind_needs_only_its_hookspec_and_table_row():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", NEW_KIND], capture_output=True, text=True, cwd=root, timeout=hang_guard(300))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["names"] == ["ball", "kite"] and out["play"] == "bounce"
    assert out["fields"][-3:] == ["toys", "options", "attention_sites"] and out["default"] == ["ball"]
    assert out["toys"] == ["ball", "kite"] and out["attention"] == "reference"  # --plugins appends to a list kind
    assert out["one_name"] == ["kite"]  # a list kind given one name
    assert {"ball", "kite", "reference"} <= set(out["selected"])
    assert "unknown toys 'kyte'" in out["error"] and "kite" in out["error"]
    assert out["cli"][-1] == "toys"
    # new-plugin offers the table's kinds that have a scaffold template: not yet the new one, and nothing breaks
    assert out["new_plugin"] == [k for k in kinds.names() if k != "toys"]
