"""Every registered entry satisfies its kind's Protocol (runtime_checkable isinstance), the options pair is
complete wherever ``options_cls`` is declared, and each model family's ``cost_model`` sums to its ``flops``."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch import nn

import gemzoo
from gemzoo.interfaces import Batch, Configurable, Dataset, OptimizerStepHook, RecModel, transformer_blocks
from gemzoo.interfaces.options import TakesOptions, check_configurable
from gemzoo.interfaces.precision import after_optimizer_step
from gemzoo.kinds import KINDS, kind


def _all_entries():
    return [pytest.param(k.name, n, id=f"{k.name}-{n}") for k in KINDS for n in gemzoo.registry.names(k.name)]


@pytest.mark.parametrize("kind_name,name", _all_entries())
def test_entry_satisfies_its_protocol(kind_name, name):
    obj = gemzoo.registry.get(kind_name, name)
    protocol = kind(kind_name).protocol
    assert isinstance(obj, protocol), f"{kind_name} {name!r} ({type(obj).__name__}) is not a {protocol.__name__}"


@pytest.mark.parametrize("kind_name,name", _all_entries())
def test_options_pair_is_complete(kind_name, name):
    obj = gemzoo.registry.get(kind_name, name)
    check_configurable(obj, name)
    cls = getattr(obj, "options_cls", None)
    if cls is None:
        return
    assert isinstance(obj, Configurable)
    try:
        options = cls()
    except TypeError:
        pytest.skip(f"{cls.__name__} has required fields")
    configured = obj.configure(options)
    assert configured is not obj, f"{name}.configure must return a copy, not change the registered entry"
    assert isinstance(configured, kind(kind_name).protocol)


def test_options_pair_errors_name_the_fix():
    class NoConfigure:
        options_cls = dataclasses.make_dataclass("Opts", [("x", int, dataclasses.field(default=1))])

    class NotADataclass:
        options_cls = dict

        def configure(self, options):
            return self

    with pytest.raises(gemzoo.errors.PluginError, match="no configure"):
        check_configurable(NoConfigure(), "p")
    with pytest.raises(gemzoo.errors.PluginError, match="must be a dataclass"):
        check_configurable(NotADataclass(), "p")


def test_takes_options_gives_defaults_copies_and_a_typed_error():
    @dataclasses.dataclass
    class Opts:
        x: int = 1

    class Entry(TakesOptions):
        options_cls = Opts

    entry = Entry()
    assert entry.options == Opts()
    configured = entry.configure(Opts(x=3))
    assert type(configured) is Entry and configured is not entry and configured.options.x == 3
    assert entry.options.x == 1
    check_configurable(entry, "entry")
    with pytest.raises(gemzoo.errors.ConfigError, match="Entry options must be Opts, got dict"):
        entry.configure({"x": 3})


def test_protocols_reject_what_lacks_a_member():
    class Half:
        def forward(self, batch): ...

        def flops(self, batch): ...

    assert not isinstance(Half(), RecModel)
    assert not isinstance(object(), Dataset) and not isinstance(object(), Batch)


def test_after_optimizer_step_is_optional():
    calls = []

    class WithHook:
        def after_optimizer_step(self, model):
            calls.append(model)

    model = nn.Linear(2, 2)
    after_optimizer_step(object(), model)  # nothing to call
    after_optimizer_step(WithHook(), model)
    assert isinstance(WithHook(), OptimizerStepHook) and calls == [model]


def test_transformer_blocks_prefers_the_model_and_falls_back_to_the_marker():
    class Block(nn.Module):
        is_transformer_block = True

    class Marked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Block(), nn.Sequential(Block())

    class Declared(Marked):
        def transformer_blocks(self):
            return [self.a]

    m, d = Marked(), Declared()
    assert transformer_blocks(m) == [m.a, m.b[0]]
    assert transformer_blocks(d) == [d.a]


# ------------------------------------------------------------------------------------------ model families
def _small(family, tmp_path):
    from gemzoo.data.movielens import MovieLensConfig, MovieLensDataset
    from gemzoo.data.synthetic import SyntheticGemConfig, SyntheticGemDataset

    if family == "gem":
        ds = SyntheticGemDataset(SyntheticGemConfig(batch_size=8, max_len=16, median_len=6, min_len=0,
                                                    max_candidates=3, num_items=50, num_clusters=3,
                                                    num_sparse_tables=2, sparse_table_size=20), seed=0)
        cfg = dict(d_model=16, num_layers=2, num_heads=2, embedding_dim=8, mlp_dims=[16, 8])
    else:
        rng = random.Random(0)
        lines = [f"{u}::{rng.randrange(30) + 1}::3::{1000 + 10 * i}"
                 for u in range(1, 13) for i in range(rng.randrange(0, 12))]
        (tmp_path / "ratings.dat").write_text("\n".join(lines) + "\n")
        ds = MovieLensDataset(MovieLensConfig(path=str(tmp_path / "ratings.dat"), batch_size=8, max_len=8), seed=0)
        cfg = dict(embedding_dim=16, num_layers=2, num_heads=2, num_negatives=8, dropout=0.0)
    spec = gemzoo.registry.get("model", family)
    with torch.device("meta"):
        model = spec.build(spec.config_cls(**cfg), ds.info)
    return model, ds


@pytest.mark.parametrize("family", ["gem", "hstu", "sasrec"])
def test_cost_model_sums_to_flops(family, tmp_path):
    model, ds = _small(family, tmp_path)
    assert isinstance(model, RecModel) and isinstance(ds, Dataset)
    for step in range(3):
        batch = ds.train_batch(step)
        assert isinstance(batch, Batch)
        cost = model.cost_model(batch)
        assert cost.dtype == torch.float64 and cost.shape == (batch.num_samples,)
        assert (cost >= 0).all()
        assert float(cost.sum()) == pytest.approx(model.flops(batch), rel=1e-12)
        # each sample's cost is the FLOPs of that sample alone
        for i in (0, batch.num_samples - 1):
            assert float(cost[i]) == pytest.approx(model.flops(batch.select([i])), rel=1e-12)
    longest = int(batch.lengths.argmax())
    shortest = int(batch.lengths.argmin())
    assert cost[longest] > cost[shortest] or batch.lengths[longest] == batch.lengths[shortest]


@pytest.mark.parametrize("family", ["gem", "hstu", "sasrec"])
def test_transformer_blocks_are_the_marked_blocks(family, tmp_path):
    model, _ = _small(family, tmp_path)
    marked = [m for m in model.modules() if getattr(m, "is_transformer_block", False)]
    assert model.transformer_blocks() == marked and len(marked) == 2
