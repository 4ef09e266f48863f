"""Plugin selection, hook isolation and install hints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_dists import make_dist

import gemzoo
from gemzoo.cli import main
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


# -- item 9: a plugin's command hook that raises, --plugins=no:x, clashes in `gemzoo plugins` ---------------

class _BadCommands:
    @gemzoo.hookimpl
    def gemzoo_register_commands(self, cli):
        raise RuntimeError("boom in commands")


class _GoodCommands:
    @gemzoo.hookimpl
    def gemzoo_register_commands(self, cli):
        p = cli.add_parser("hello-toy", help="a plugin command")
        p.set_defaults(func=lambda args: print("hello from toy") or 0)


def test_raising_command_hook_is_isolated(fresh_registry, capsys):
    fresh_registry.reset()
    fresh_registry.host().register(_BadCommands(), name="bad-cmds", distribution="gemzoo-bad")
    fresh_registry.host().register(_GoodCommands(), name="good-cmds", distribution="gemzoo-good")
    assert main(["hello-toy"]) == 0
    captured = capsys.readouterr()
    assert "hello from toy" in captured.out
    assert "bad-cmds" in captured.err and "boom in commands" in captured.err
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "boom in commands" in rows["bad-cmds"]["error"] and rows["good-cmds"]["error"] is None


@pytest.mark.parametrize("style", ["--plugins=no:blockcmd", "--plugins no:blockcmd"])
def test_plugins_no_blocks_before_commands_load(tmp_path, fresh_registry, monkeypatch, capsys, style):
    make_dist(monkeypatch, tmp_path, "gemzoo-blockcmd", "gemzoo_blockcmd_mod",
              "import gemzoo\n@gemzoo.hookimpl\ndef gemzoo_register_commands(cli):\n    raise RuntimeError('loaded')\n",
              "blockcmd")
    fresh_registry.reset()
    argv = ["config", "validate", "configs/gem-tiny.toml", *style.split()]
    code = main(argv)
    err = capsys.readouterr().err
    assert "loaded" not in err, err
    assert code == 0, err


def test_name_clash_does_not_stop_gemzoo_plugins(tmp_path, fresh_registry, monkeypatch, capsys):
    make_dist(monkeypatch, tmp_path, "gemzoo-clash", "gemzoo_clash_mod",
              "import gemzoo\nfrom gemzoo.builtin.attention import REFERENCE\n@gemzoo.hookimpl\n"
              "def gemzoo_register_attention(register):\n    register('reference', REFERENCE)\n", "clash")
    fresh_registry.reset()
    with pytest.raises(PluginError, match="registered twice"):
        fresh_registry.names("attention")
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "registered twice" in rows["clash"]["error"] and "gemzoo-clash" in rows["clash"]["error"]
    assert "reference" in rows["gemzoo.builtin.attention"]["registered"]["attention"]
    assert main(["plugins", "--verbose"]) == 0
    assert "registered twice" in capsys.readouterr().out


# -- item 10: install hints ------------------------------------------------------------------------------

def test_typo_gets_a_close_name_never_an_install_name(fresh_registry):
    with pytest.raises(PluginError) as exc:
        fresh_registry.get("attention", "jfaa")
    msg = str(exc.value)
    assert "gemzoo-jfaa" not in msg and "pip install" not in msg
    assert "Did you mean" in msg


def test_first_party_plugin_points_to_its_local_folder(fresh_registry, monkeypatch):
    monkeypatch.setenv("GEMZOO_DISABLE_PLUGIN_AUTOLOAD", "1")
    fresh_registry.reset()
    with pytest.raises(PluginError) as exc:
        fresh_registry.get("attention", "jfa")
    msg = str(exc.value)
    folder = Path(gemzoo.__file__).resolve().parent.parent / "plugins" / "gemzoo-jfa"
    assert f"pip install --no-deps --no-build-isolation -e {folder}" in msg, msg
    assert "pip install gemzoo-jfa" not in msg


@pytest.mark.parametrize("blocked", ["jfa", "gemzoo-jfa"])
def test_disabled_plugin_says_so_instead_of_install(fresh_registry, monkeypatch, blocked):
    monkeypatch.setenv("GEMZOO_DISABLE_PLUGINS", blocked)
    fresh_registry.reset()
    with pytest.raises(PluginError) as exc:
        fresh_registry.get("attention", "jfa")
    msg = str(exc.value)
    assert "disabled by GEMZOO_DISABLE_PLUGINS" in msg and "pip install" not in msg, msg


def test_unknown_plugin_on_the_command_line_has_no_install_name(fresh_registry, capsys):
    assert main(["config", "validate", "configs/gem-tiny.toml", "--plugins", "mxfp88"]) == 2
    err = capsys.readouterr().err
    assert "gemzoo-mxfp88" not in err and "Did you mean 'mxfp8'" in err, err
