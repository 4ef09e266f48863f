"""configs/gem-1b.toml: the LLM-scale GEM config validates and builds on meta with >= 0.9e9 dense parameters."""

from pathlib import Path

import pytest

from gemzoo.api import load_config, registry
from gemzoo.train.optim import split_parameters
from gemzoo.train.trainer import build_on_meta

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "gem-1b.toml"
GIB = 2**30


@pytest.fixture(scope="module")
def built():
    if "jfa" not in registry.names("attention") or "auto-ac" not in registry.names("memory"):
        pytest.skip("gem-1b selects jfa and auto-ac: install plugins/gemzoo-jfa and plugins/gemzoo-auto-ac")
    cfg = load_config(CONFIG)
    return cfg, build_on_meta(cfg)  # what `gemzoo config validate` builds: dataset, model on meta, kernels, precision


def test_gem1b_dense_parameters(built):
    cfg, model = built
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated
    dense, sparse = split_parameters(model)  # what the trainer gives AdamW (dense) and the sparse optimizer
    n_dense = sum(p.numel() for p in dense)
    n_blocks = sum(p.numel() for b in model.transformer_blocks() for p in b.parameters())
    n_sparse = sum(p.numel() for p in sparse)
    assert n_dense >= 0.9e9, f"gem-1b has {n_dense / 1e9:.3f}e9 dense parameters, fewer than 0.9e9"
    assert n_blocks >= 0.9e9, f"the transformer blocks alone hold {n_blocks / 1e9:.3f}e9"  # not the embeddings
    assert n_sparse == 16 * 1_000_000 * 128  # the sparse tables stay out of the dense count
    d = cfg.model.d_model
    assert cfg.model.num_layers * 12 * d * d <= n_blocks  # qkv, out, fc1, fc2 (ffn_mult 4) of every block
    # the static state (fp32 weight, grad, AdamW m and v) leaves most of an H200's 139.8 GiB to activations
    assert 16 * n_dense / GIB < 20


def test_gem1b_trains_jfa_bf16_compiled_with_activation_checkpointing(built):
    cfg, model = built
    assert cfg.model.family == "gem" and cfg.data.source == "synthetic-gem"
    assert (cfg.data.median_len, cfg.data.max_len, cfg.data.batch_size) == (1024, 16384, 64)  # gem-bench's histories
    assert cfg.run.compile and cfg.plugins.attention == "jfa" and cfg.plugins.precision == "bf16"
    assert cfg.plugins.memory == ["auto-ac"] and cfg.plugins.options["auto-ac"].budget == 0.5
    blocks = model.transformer_blocks()
    assert len(blocks) == 12 and all(b.attn.attn.kernel_name == "jfa" for b in blocks)


@pytest.mark.parametrize("precision", ["fp8-rowwise", "fp8-tensorwise", "mxfp8"])
def test_gem1b_builds_under_each_fp8_policy(precision):
    if precision not in registry.names("precision") or "jfa" not in registry.names("attention"):
        pytest.skip(f"{precision} or jfa is not installed (plugins/gemzoo-mxfp8, plugins/gemzoo-jfa)")
    from gemzoo.api import precision_report

    model = build_on_meta(load_config(CONFIG, plugins=f"jfa,{precision}"))
    report = precision_report(model)
    low = [name for name, tag in report.items() if tag == precision]
    assert any(name.startswith("tower.blocks.5.") for name in low), sorted(report.items())[:8]
    assert report["head.click"] == "bf16"


# -- configs/ablations/gem-1b.toml ---------------------------------------------------------------------------------
ABLATION = ROOT / "configs" / "ablations" / "gem-1b.toml"
PRECISIONS = ("bf16", "fp8-rowwise", "mxfp8")


def _ablation_rows():
    from gemzoo.config import load_ablation

    ablation = load_ablation(ABLATION)  # every entry's plugin names and set overrides, against the registries
    return ablation, {r.name: load_config(ablation.config, overrides=[*ablation.set, *r.set], plugins=r.plugins)
                      for r in ablation.runs}


def test_gem1b_ablation_rows(built):
    _, rows = _ablation_rows()
    for p in PRECISIONS:
        with_ac, with_aq, without = rows[f"jfa,{p}"], rows[f"jfa,{p},act-quant"], rows[f"jfa,{p} b32"]
        for cfg in (with_ac, with_aq, without):
            assert cfg.plugins.precision == p and cfg.plugins.attention == "jfa" and cfg.run.compile
        assert with_ac.plugins.memory == ["auto-ac"] and with_ac.data.batch_size == 64
        assert with_aq.plugins.memory == ["act-quant", "auto-ac"] and with_aq.data.batch_size == 64
        assert without.plugins.memory == [] and without.data.batch_size == 32


@pytest.mark.slow
def test_gem1b_ablation_every_entry_builds(built):
    """What `gemzoo ablate` checks before the first run trains: every entry builds on meta (about 1 s each)."""
    from gemzoo.cli.ablate import make_plan

    plan = make_plan(str(ABLATION))
    assert len(plan.runs) == len(_ablation_rows()[1])
