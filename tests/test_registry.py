
import pytest
from fake_dists import make_dist

from gemzoo.errors import PluginError
from gemzoo.plugins import PluginHost

GOOD = """
import gemzoo
from gemzoo.builtin.attention import REFERENCE

@gemzoo.hookimpl
def gemzoo_register_attention(register):
    register("toy-attn", REFERENCE)
"""


def test_builtins_are_registered(fresh_registry):
    fresh_registry.reset(PluginHost(autoload=False))  # gemzoo's own entries only, whatever else is installed
    assert {"reference", "sdpa-padded", "flex"} <= set(fresh_registry.names("attention"))
    assert {"fp32", "bf16"} <= set(fresh_registry.names("precision"))
    assert fresh_registry.names("memory") == ["full-ac", "none"]
    assert "torchrec" in fresh_registry.names("planner")
    assert "torch" in fresh_registry.names("comms")
    assert "none" in fresh_registry.names("batching")


def test_names_filters_with_fnmatch(fresh_registry):
    assert fresh_registry.names("attention", "s*") == ["sdpa-padded"]


def test_unknown_name_lists_what_exists(fresh_registry):
    with pytest.raises(PluginError) as exc:
        fresh_registry.get("attention", "nosuch")
    assert "reference" in str(exc.value) and "sdpa-padded" in str(exc.value)


@pytest.mark.parametrize("lookup", ["names", "entries", "get", "find"])
def test_unknown_kind(fresh_registry, lookup):
    call = {"names": lambda: fresh_registry.names("widgets"), "entries": lambda: fresh_registry.entries("widgets"),
            "get": lambda: fresh_registry.get("widgets", "x"), "find": lambda: fresh_registry.find("widgets:x")}
    with pytest.raises(PluginError, match="unknown registry kind 'widgets'; the kinds are: attention, precision"):
        call[lookup]()


def test_entry_point_plugin_loads(tmp_path, fresh_registry, monkeypatch):
    make_dist(monkeypatch, tmp_path, "gemzoo-toy", "gemzoo_toy_good", GOOD, entry_name="toy")
    fresh_registry.reset()
    assert "toy-attn" in fresh_registry.names("attention")
    entry = fresh_registry.entry("attention", "toy-attn")
    assert entry.distribution == "gemzoo-toy"


def test_broken_plugin_is_reported_and_others_load(tmp_path, fresh_registry, monkeypatch):
    make_dist(monkeypatch, tmp_path, "gemzoo-broken", "gemzoo_broken_mod", "raise ImportError('needs libfoo')", "broken")
    fresh_registry.reset()
    assert "reference" in fresh_registry.names("attention")
    failed = fresh_registry.host().failed()
    assert "broken" in failed and "needs libfoo" in failed["broken"].error
    assert failed["broken"].distribution == "gemzoo-broken"
    with pytest.raises(PluginError, match="gemzoo-broken.*needs libfoo"):
        fresh_registry.get("attention", "broken")


def test_duplicate_name_names_both_distributions(tmp_path, fresh_registry, monkeypatch):
    make_dist(monkeypatch, tmp_path, "gemzoo-dup", "gemzoo_dup_mod", GOOD.replace("toy-attn", "reference"), "dup")
    fresh_registry.reset()
    with pytest.raises(PluginError) as exc:
        fresh_registry.names("attention")
    assert "gemzoo-dup" in str(exc.value) and "'gemzoo'" in str(exc.value)


def test_blocking_by_name(tmp_path, fresh_registry, monkeypatch):
    make_dist(monkeypatch, tmp_path, "gemzoo-blockme", "gemzoo_blockme_mod", GOOD.replace("toy-attn", "blockme-attn"), "blockme")
    monkeypatch.setenv("GEMZOO_DISABLE_PLUGINS", "blockme")
    fresh_registry.reset()
    assert "blockme-attn" not in fresh_registry.names("attention")
    fresh_registry.reset(PluginHost(blocked=set()))
    assert "blockme-attn" in fresh_registry.names("attention")


def test_local_registration_and_kind_prefix(fresh_registry):
    from gemzoo.builtin.attention import REFERENCE

    fresh_registry.register("attention", "mine", REFERENCE)
    assert fresh_registry.find("mine").kind == "attention"
    with pytest.raises(PluginError, match="memory:none or batching:none"):
        fresh_registry.find("none")
    assert fresh_registry.find("memory:none").kind == "memory"
    with pytest.raises(PluginError, match="twice"):
        fresh_registry.register("precision", "mine", object())


def test_every_attention_kernel_declares_capabilities(fresh_registry):
    from gemzoo.interfaces import AttentionCapabilities

    for name in fresh_registry.names("attention"):
        assert isinstance(fresh_registry.get("attention", name).capabilities, AttentionCapabilities), name
