import copy
import re

import pytest
from toy_plugin import TOY_CONFIG

from gemzoo.config import load_config, parse_override
from gemzoo.errors import ConfigError, PluginError


def raw(**sections):
    r = copy.deepcopy(TOY_CONFIG)
    for k, v in sections.items():
        r.setdefault(k, {}).update(v)
    return r


def test_defaults_and_family_fields(toy):
    cfg = load_config(raw=raw())
    assert cfg.model.d_model == 16 and cfg.data.batch_size == 8
    assert cfg.plugins.attention == "reference" and cfg.plugins.memory == []


@pytest.mark.parametrize("section,key,hint", [
    ("run", "stepz", "run.steps"),
    ("model", "d_modle", "model.d_model"),
    ("data", "batchsize", "data.batch_size"),
    ("optim", "learning_rate", None),
])
def test_unknown_key_is_named(toy, section, key, hint):
    r = raw()
    r.setdefault(section, {})[key] = 1
    with pytest.raises(ConfigError) as exc:
        load_config(raw=r)
    assert f"{section}.{key}" in str(exc.value)
    if hint:
        assert f"Did you mean {hint}" in str(exc.value)


def test_unknown_section(toy):
    with pytest.raises(ConfigError, match=r"unknown section \[optimizer\].*Did you mean \[optim\]"):
        load_config(raw=raw(optimizer={"lr": 1}))


def test_wrong_type_is_named(toy):
    with pytest.raises(ConfigError, match="run.steps must be int"):
        load_config(raw=raw(run={"steps": "many"}))


def test_overrides(toy):
    cfg = load_config(raw=raw(), overrides=["run.steps=7", "optim.lr=0.5", "run.name=abc", "precision.keep=['head']"])
    assert (cfg.run.steps, cfg.optim.lr, cfg.run.name, cfg.precision.keep) == (7, 0.5, "abc", ["head"])
    assert parse_override("model.d_model=32") == (["model", "d_model"], 32)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("run.steps")


def test_plugin_list_sets_each_kind(toy):
    cfg = load_config(raw=raw(), plugins="sdpa-padded,bf16,full-ac")
    assert (cfg.plugins.attention, cfg.plugins.precision, cfg.plugins.memory) == ("sdpa-padded", "bf16", ["full-ac"])


def test_unknown_plugin_names_the_attention_kernels(toy):
    with pytest.raises(PluginError) as exc:
        load_config(raw=raw(), plugins="nosuch")
    assert "nosuch" in str(exc.value) and "reference" in str(exc.value) and "sdpa-padded" in str(exc.value)


def test_unknown_plugin_in_config_file(toy):
    with pytest.raises(PluginError, match="unknown attention 'nosuch'"):
        load_config(raw=raw(plugins={"attention": "nosuch"}))


def test_block_removes_memory_policy(toy):
    cfg = load_config(raw=raw(plugins={"memory": ["full-ac"]}), plugins="no:full-ac")
    assert cfg.plugins.memory == []


def test_missing_file_and_bad_toml(tmp_path, toy):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_plugin_options_validated_by_plugin_dataclass(toy):
    from dataclasses import dataclass

    @dataclass
    class Opts:
        factor: int = 1

    class Configurable:
        options_cls = Opts
        capabilities = None

        def configure(self, options):
            return self

    toy.register("batching", "configurable", Configurable())
    cfg = load_config(raw=raw(plugins={"batching": "configurable", "options": {"configurable": {"factor": 3}}}))
    assert cfg.plugins.options["configurable"].factor == 3
    with pytest.raises(ConfigError, match=r"plugins.options.configurable.fctor"):
        load_config(raw=raw(plugins={"options": {"configurable": {"fctor": 3}}}))
    with pytest.raises(ConfigError, match="takes no options"):
        load_config(raw=raw(plugins={"options": {"reference": {"x": 1}}}))


def test_plugin_list_with_empty_memory_list(toy):
    cfg = load_config(raw=raw(plugins={"memory": []}), plugins="sdpa-padded,bf16")
    assert cfg.plugins.memory == [] and cfg.plugins.precision == "bf16"


@pytest.mark.parametrize("plugins", [None, "full-ac", "no:nothing"])
def test_one_memory_name_is_a_list(toy, plugins):
    """memory = "NAME" (a list kind given one name) is [NAME], with or without --plugins."""
    cfg = load_config(raw=raw(plugins={"memory": "full-ac"}), plugins=plugins)
    assert cfg.plugins.memory == ["full-ac"]


def test_plugin_list_appends_to_memory_and_drops_none(toy):
    toy.register("memory", "second-ac", toy.get("memory", "full-ac"))
    cfg = load_config(raw=raw(plugins={"memory": ["none"]}), plugins="full-ac,second-ac")
    assert cfg.plugins.memory == ["full-ac", "second-ac"]


def test_plugin_list_refuses_two_of_a_one_entry_kind(toy):
    with pytest.raises(PluginError, match="names two attention plugins, 'reference' and 'sdpa-padded'"):
        load_config(raw=raw(), plugins="reference,sdpa-padded")


def test_plugin_list_refuses_a_model_family(toy):
    family = raw()["model"]["family"]
    with pytest.raises(PluginError, match=rf"'{family}' is a model, which a config names in model.family"):
        load_config(raw=raw(), plugins=family)


@pytest.mark.parametrize("section,key,name", [("model", "family", "toy"), ("data", "source", "toy-data")])
def test_model_and_data_must_name_a_registered_entry(toy, section, key, name):
    r = raw()
    del r[section][key]
    with pytest.raises(ConfigError, match=rf"\[{section}\] needs {key} = one of .*{name}"):
        load_config(raw=r)


def test_blocking_the_default_a_config_relies_on(toy):
    """[plugins] without attention takes the table's default, reference; --plugins no:reference blocks it."""
    r = raw()
    r.get("plugins", {}).pop("attention", None)
    with pytest.raises(PluginError, match="no:reference blocks the attention the config selects"):
        load_config(raw=r, plugins="no:reference")


@pytest.mark.parametrize("section,key,value,message", [
    ("run", "steps", -5, "run.steps must be >= 1, got -5"),
    ("run", "steps", 0, "run.steps must be >= 1"),
    ("run", "log_every", 0, "run.log_every must be >= 1"),
    ("run", "device", "tpu", "run.device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ("run", "dense_parallel", "zero3", "run.dense_parallel must be one of 'fsdp', 'ddp'"),
    ("run", "peak_tflops", 0.0, "run.peak_tflops must be > 0"),
    ("optim", "lr", -1e-3, "optim.lr must be >= 0"),
    ("optim", "lr", float("nan"), "optim.lr must be a finite number"),
    ("optim", "warmup_steps", -1, "optim.warmup_steps must be >= 0"),
    ("eval", "batches", 0, "eval.batches must be >= 1"),
    ("checkpoint", "keep", -1, "checkpoint.keep must be >= 0"),
])
def test_out_of_range_values_are_named(toy, section, key, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(raw=raw(**{section: {key: value}}))


@pytest.mark.parametrize("override", ["run.device='cuda:1'", "run.device='cpu'", "checkpoint.every=0",
                                      "eval.every=0", "optim.grad_clip=0", "run.peak_tflops=989"])
def test_in_range_edge_values_load(toy, override):
    load_config(raw=raw(), overrides=[override])
