"""A toy planner and a toy batching policy, registered from a fake installed
distribution, are found by the registry and checked by the same conformance suites as the built-ins; and the
suites do fail a broken entry."""

from __future__ import annotations

import pytest
import torch
from fake_dists import make_dist

from gemzoo.testing.batching import BatchingCase, batching_cases, check_assignment, check_global_loss
from gemzoo.testing.memory import check_memory_policy, tiny_model
from gemzoo.testing.planner import check_planner_local
from gemzoo.testing.pytest_plugin import registered

TOY_DIST = "from toy_kinds import gemzoo_register_batching, gemzoo_register_planners\n"


@pytest.fixture
def toys(tmp_path, monkeypatch, fresh_registry):
    make_dist(monkeypatch, tmp_path, "gemzoo-toy-kinds", "gemzoo_toy_kinds", TOY_DIST, entry_name="toy-kinds")
    fresh_registry.reset()
    return fresh_registry


def test_suites_pick_up_the_toys(toys):
    assert toys.entry("batching", "toy-lpt").distribution == "gemzoo-toy-kinds"
    assert toys.entry("planner", "toy-replicate").distribution == "gemzoo-toy-kinds"
    batching = [p.values[0] for p in registered("batching")]
    planners = [p.values[0] for p in registered("planner")]
    assert {"none", "toy-lpt"} <= set(batching) and {"torchrec", "toy-replicate"} <= set(planners)
    model, batch = tiny_model(0, d_model=16, batch_size=12)
    for name in batching:
        policy = toys.get("batching", name)
        for case in batching_cases():
            check_assignment(policy, case)
        check_global_loss(policy, model, batch, 3, weight=lambda b: b.num_candidates)
    for name in planners:
        check_planner_local(toys.get("planner", name))


def test_toy_lpt_balances_better_than_none(toys):
    costs = BatchingCase(64, 4, seed=3).make_costs()
    worst = {name: max(float(costs[g].sum()) for g in toys.get("batching", name).assign(costs, 4))
             for name in ("none", "toy-lpt")}
    assert worst["toy-lpt"] < worst["none"] and worst["toy-lpt"] <= costs.sum() / 4 + costs.max()


class DropsLast:
    def assign(self, costs, world_size):
        return list(torch.arange(max(costs.numel() - 1, 0)).tensor_split(world_size))


class NudgesWeights:
    """A 'memory policy' that changes the math: the suite must refuse it."""

    def apply(self, model, cfg=None):
        with torch.no_grad():
            next(model.parameters()).mul_(1.001)
        return model

    def step_context(self):
        import contextlib

        return contextlib.nullcontext()


def test_suites_fail_broken_entries():
    with pytest.raises(AssertionError, match="unassigned"):
        check_assignment(DropsLast(), BatchingCase(8, 2))
    with pytest.raises(AssertionError, match="bit-exact"):
        check_memory_policy(NudgesWeights(), model_and_batch=tiny_model(0, d_model=16, batch_size=8))


def test_a_third_party_family_and_dataset_pass_the_model_suite(tmp_path, fresh_registry):
    """tests/support/toy_plugin.py registers model 'toy' and dataset 'toy-data' from outside gemzoo."""
    import toy_plugin

    from gemzoo.testing.models import build_dataset, check_dataset, check_model

    toy_plugin.install(fresh_registry)
    assert "toy" in [p.values[0] for p in registered("model")]
    check_dataset("toy-data", tmp_path)
    check_model("toy", tmp_path, model_cfg={"dropout": 0.0}, dataset=build_dataset("toy-data", tmp_path))
