"""A plugin's GEMZOO_API range against gemzoo.api.API_VERSION: a plugin whose range excludes this version (or
whose range is malformed) is refused as a load failure of that plugin, the others keep working, and
``gemzoo plugins`` lists it as failed; a plugin without a range loads."""

from __future__ import annotations

import json
import types

import pytest
from fake_dists import make_dist

import gemzoo.api
from gemzoo import plugins
from gemzoo.builtin.attention import REFERENCE
from gemzoo.errors import PluginError
from gemzoo.plugins import PluginHost

PLUGIN = """
import gemzoo.api
from gemzoo.builtin.attention import REFERENCE

{declaration}

@gemzoo.api.hookimpl
def gemzoo_register_attention(register):
    register("{name}", REFERENCE)
"""


def _plugin_module(name: str, declared=None) -> types.ModuleType:
    """A plugin module registering the attention kernel ``name``, declaring ``declared`` as GEMZOO_API."""
    module = types.ModuleType(f"fake_{name.replace('-', '_')}")

    @gemzoo.api.hookimpl
    def gemzoo_register_attention(register):
        register(name, REFERENCE)

    module.gemzoo_register_attention = gemzoo_register_attention
    if declared is not None:
        module.GEMZOO_API = declared
    return module


def test_api_version_is_public_and_one_dot_zero():
    assert gemzoo.api.API_VERSION == "1.1" == plugins.API_VERSION
    assert "API_VERSION" in gemzoo.api.__all__


@pytest.mark.parametrize("declared", [None, ">=1,<2", ">=1.0", "==1.*", "~=1.0"])
def test_a_range_that_includes_this_version_loads(fresh_registry, declared):
    host = PluginHost(autoload=False)
    assert host.register(_plugin_module("in-range", declared), "in-range", "gemzoo-in-range")
    fresh_registry.reset(host)
    assert "in-range" in fresh_registry.names("attention")
    assert "in-range" not in host.failed()


@pytest.mark.parametrize("declared", [">=2,<3", "<1", "==0.9"])
def test_a_range_that_excludes_this_version_is_refused(fresh_registry, declared):
    host = PluginHost(autoload=False)
    assert not host.register(_plugin_module("too-new", declared), "too-new", "gemzoo-too-new")
    host.register(_plugin_module("fine"), "fine", "gemzoo-fine")
    fresh_registry.reset(host)
    error = host.failed()["too-new"].error
    assert declared in error and f"API {plugins.API_VERSION}" in error  # its range, gemzoo's API version
    assert "upgrade the plugin (pip install -U gemzoo-too-new)" in error and "install a gemzoo" in error
    names = fresh_registry.names("attention")
    assert "too-new" not in names and {"fine", "reference"} <= set(names)  # the others keep working
    with pytest.raises(PluginError, match=f"too-new.*failed to load.*API {plugins.API_VERSION}"):
        fresh_registry.get("attention", "too-new")


@pytest.mark.parametrize("declared,what", [("version one", "not a valid PEP 440"), (">=1,<<2", "not a valid PEP 440"),
                                           (1, "not a PEP 440 version specifier")])
def test_a_malformed_range_is_a_load_error_naming_it(fresh_registry, declared, what):
    host = PluginHost(autoload=False)
    assert not host.register(_plugin_module("garbled", declared), "garbled", "gemzoo-garbled")
    error = host.failed()["garbled"].error
    assert what in error and repr(declared) in error and 'GEMZOO_API = ">=1,<2"' in error
    fresh_registry.reset(host)
    assert "reference" in fresh_registry.names("attention")


def test_builtins_are_exempt(monkeypatch):
    """gemzoo's own plugins follow its API version by construction: a range is never read from them."""
    monkeypatch.setattr(plugins, "API_VERSION", "99.0")
    host = PluginHost(autoload=False)
    assert not host.failed() and "gemzoo.builtin.attention" in host.infos


def test_installed_plugin_out_of_range_shows_as_failed_in_gemzoo_plugins(tmp_path, monkeypatch, fresh_registry,
                                                                         capsys):
    from gemzoo.cli import main

    make_dist(monkeypatch, tmp_path, "gemzoo-future", "gemzoo_future_mod",
              PLUGIN.format(declaration='GEMZOO_API = ">=2,<3"', name="future-attn"), "future")
    make_dist(monkeypatch, tmp_path / "ok", "gemzoo-current", "gemzoo_current_mod",
              PLUGIN.format(declaration='GEMZOO_API = ">=1,<2"', name="current-attn"), "current")
    make_dist(monkeypatch, tmp_path / "plain", "gemzoo-plain", "gemzoo_plain_mod",
              PLUGIN.format(declaration="", name="plain-attn"), "plain")
    fresh_registry.reset()
    names = fresh_registry.names("attention")
    assert {"current-attn", "plain-attn"} <= set(names) and "future-attn" not in names
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["future"]["distribution"] == "gemzoo-future"
    assert ">=2,<3" in rows["future"]["error"] and f"API {plugins.API_VERSION}" in rows["future"]["error"]
    assert rows["current"]["error"] is None and rows["plain"]["error"] is None


def test_installed_plugin_with_a_malformed_range_names_it(tmp_path, monkeypatch, fresh_registry):
    make_dist(monkeypatch, tmp_path, "gemzoo-garbled", "gemzoo_garbled_mod",
              PLUGIN.format(declaration='GEMZOO_API = "one or two"', name="garbled-attn"), "garbled")
    fresh_registry.reset()
    assert "garbled-attn" not in fresh_registry.names("attention")
    error = fresh_registry.host().failed()["garbled"].error
    assert "'one or two'" in error and "not a valid PEP 440 version specifier" in error


def test_first_party_names_come_from_the_plugin_distributions_metadata():
    """The source tree's plugins/*/pyproject.toml name each distribution and its entry points; their modules
    name what they register (no hand-kept table)."""
    found = plugins.first_party_plugins()
    root = plugins.source_tree_plugins_dir()
    if root is None:
        pytest.skip("not run from a gemzoo source tree")
    assert found["jfa"][0] == "gemzoo-jfa" and found["jfa"][1] == root / "gemzoo-jfa"
    assert found["fp8-rowwise"][0] == "gemzoo-mxfp8"  # a second name of one distribution
    assert found["base-batch-shuffle"][0] == "gemzoo-batch-shuffle"
    assert "install it with pip install --no-deps --no-build-isolation -e" in plugins.install_hint("gdpa")
    assert plugins.install_hint("not-a-plugin-anyone-ships") is None
