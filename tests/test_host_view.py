"""What a step needs to know of its batch's shapes is read from the host copy, never from the device.

A device here is ``meta``: it holds no data, so any read of a moved tensor raises, which is what a CUDA read
would cost (a host sync) made visible on a CPU machine."""

import pytest
import torch

from gemzoo.attention import check_inputs, validated_longest
from gemzoo.attention.checks import _offsets_cache
from gemzoo.data.batch import to_device
from gemzoo.embedding import TableConfig, TorchEmbeddingBagCollection, key_totals
from gemzoo.errors import JaggedShapeError
from gemzoo.interfaces.models import host_view
from gemzoo.jagged import lengths_to_offsets


@pytest.fixture
def gem_batch():
    from gemzoo import registry
    from gemzoo.config import load_config

    cfg = load_config("configs/gem-tiny.toml")
    return registry.get("dataset", cfg.data.source).build(cfg.data, cfg.run.seed).train_batch(0)


def test_a_batch_moved_off_the_host_keeps_the_host_batch(gem_batch):
    moved = gem_batch.to("meta")
    assert moved.history_offsets.device.type == "meta"
    assert moved.host_view() is gem_batch and host_view(moved) is gem_batch
    assert gem_batch.host_view() is gem_batch and gem_batch.to("cpu").host_view().history_items.device.type == "cpu"
    # a field replaced since the move (another shape): the host copy no longer describes it
    moved.history_offsets = moved.history_offsets[:-1]
    assert moved.host_view() is moved
    assert host_view(object) is object  # a batch type without host_view is its own


def test_only_the_direct_copy_records_its_host_batch(gem_batch):
    """``moved_from`` is an attribute, not a dataclass field: a batch made any other way (replace, select, a
    move between devices, a batch built on the host) records none, so it never vouches for data it does not hold."""
    import dataclasses

    moved = gem_batch.to("meta")
    assert moved.moved_from is gem_batch and gem_batch.moved_from is None
    assert "moved_from" not in {f.name for f in dataclasses.fields(moved)}
    assert dataclasses.replace(moved).moved_from is None
    assert gem_batch.select([0]).moved_from is None
    assert moved.to("meta").moved_from is None  # device to device: no host copy


def test_to_device_on_the_cpu_is_a_plain_move(gem_batch):
    same = to_device(gem_batch, "cpu")
    assert torch.equal(same.history_items, gem_batch.history_items)


def test_validated_longest_measures_the_host_copy_and_the_sites_trust_it():
    host = lengths_to_offsets(torch.tensor([3, 0, 5, 2]))
    device = host.to("meta")
    assert validated_longest(device, 10, device="meta", name="history_offsets", host=host) == 5
    # an attention site given the moved offsets finds them validated: no read of the meta tensor
    assert _offsets_cache.longest(device, 10, "meta", "q_offsets") == 5
    q = torch.empty(10, 2, 4, device="meta")
    check_inputs(q, q, q, device, max_q_len=5, max_k_len=5)


@pytest.mark.parametrize("lengths,total,match", [
    ([3, -1, 5], 7, "non-decreasing"),
    ([3, 2], 9, r"history_offsets\[-1\] must equal"),
])
def test_bad_host_offsets_are_named(lengths, total, match):
    host = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    with pytest.raises(JaggedShapeError, match=match):
        validated_longest(host.to("meta"), total, device="meta", name="history_offsets", host=host)
    with pytest.raises(JaggedShapeError, match="host copy"):
        validated_longest(host.to("meta"), total, device="meta", name="history_offsets", host=host[:-1])


def test_sparse_ids_per_key_come_from_the_host_lengths():
    tables = [TableConfig("t0", 20, 4, ["a", "b"]), TableConfig("t1", 30, 4, ["c"])]
    ebc = TorchEmbeddingBagCollection(tables, sparse_grad=True)
    lengths = torch.tensor([1, 2, 0, 3, 1, 1])  # 3 keys x 2 samples, key-major
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    keys = ["a", "b", "c"]
    assert torch.equal(ebc(keys, values, lengths, [3, 3, 2]), ebc(keys, values, lengths))
    assert key_totals(lengths, 3, 2, lengths.to("meta")) == [3, 3, 2]
    assert key_totals(lengths, 3, 2, lengths) is None  # on the host already: read it there
    with pytest.raises(JaggedShapeError, match="host copy"):
        key_totals(lengths[:-1], 3, 2, lengths.to("meta"))


@pytest.mark.parametrize("engine", ["torch", "torchrec"])
def test_gem_prologue_reads_only_the_host_copy(gem_batch, engine, monkeypatch):
    """gem's forward up to its first attention site (the offsets' checks, the sparse lookups) on a batch whose
    tensors hold no data: every shape it needs comes from the host batch."""
    from gemzoo.config import load_config
    from gemzoo.embedding import torchrec_available
    from gemzoo.errors import PluginError
    from gemzoo.train.trainer import build_on_meta

    if engine == "torch":
        monkeypatch.setenv("GEMZOO_NO_TORCHREC", "1")
    elif not torchrec_available():
        pytest.skip("needs torchrec")
    model = build_on_meta(load_config("configs/gem-tiny.toml", plugins="cpu,fp32", overrides=["run.device=cpu"]))
    assert model.sparse_arch.engine == engine
    with pytest.raises(PluginError, match="does not support device 'meta'"):  # the first attention site
        model(gem_batch.to("meta"))
