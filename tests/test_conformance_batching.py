"""Batching conformance over every registered batching policy (gemzoo.testing.batching)."""

import pytest
import torch

import gemzoo
from gemzoo.testing.batching import batching_cases, check_assignment, check_global_loss


@pytest.mark.parametrize("case", batching_cases(), ids=str)
def test_every_sample_once_and_deterministic(batching_name, case, registry_entry):
    check_assignment(registry_entry("batching", batching_name), case)


@pytest.fixture(scope="module")
def gem_model_and_batch():
    ds_spec, m_spec = gemzoo.registry.get("dataset", "synthetic-gem"), gemzoo.registry.get("model", "gem")
    ds = ds_spec.build(ds_spec.config_cls(batch_size=12, max_len=24, median_len=8, min_len=0, max_candidates=3,
                                          num_items=60, num_clusters=3, num_sparse_tables=2, sparse_table_size=20), 0)
    model = m_spec.build(m_spec.config_cls(d_model=16, num_layers=1, num_heads=2, embedding_dim=8, mlp_dims=[16, 8]),
                         ds.info).double()
    torch.manual_seed(0)
    model.init_weights()
    batch = ds.train_batch(0)
    return model, batch


@pytest.mark.parametrize("world_size", [2, 3])
def test_global_loss_does_not_depend_on_the_split(batching_name, world_size, registry_entry, gem_model_and_batch):
    model, batch = gem_model_and_batch
    check_global_loss(registry_entry("batching", batching_name), model, batch, world_size,
                      weight=lambda b: b.num_candidates)  # gem's loss is a mean over candidates
