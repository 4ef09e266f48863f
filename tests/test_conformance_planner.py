"""Planner conformance over every registered planner (gemzoo.testing.planner): one process always; 2 gloo ranks
for the torchrec planner (the only planner a clean install has): the protocol call by call with a checkpoint
round trip, with torchrec and on its no-torchrec path (the GPU image's), and the trainer resuming bit-exact."""

import pytest
from toy_kinds import ReplicatePlanner

from gemzoo import registry
from gemzoo.errors import ConfigError
from gemzoo.interfaces import WholeTables
from gemzoo.testing import skip_unless_torchrec
from gemzoo.testing.planner import check_planner_local, check_planner_on_gloo, check_planner_protocol_on_gloo


def test_plan_shard_step_round_trip(planner_name, registry_entry):
    check_planner_local(registry_entry("planner", planner_name))


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", ["table_wise", "data_parallel"])
def test_torchrec_planner_protocol_on_gloo(tmp_path, sharding):
    """table-wise tables carry fused Adagrad (the planner's state); data-parallel ones are replicated parameters."""
    skip_unless_torchrec()
    from gemzoo.builtin.planner import TorchrecPlannerOptions

    planner = registry.get("planner", "torchrec").configure(TorchrecPlannerOptions([sharding]))
    reports = check_planner_protocol_on_gloo(planner, tmp_path)
    assert all(r["sharded"] and (r["planner_keys"] > 0) == (sharding == "table_wise") for r in reports)


@pytest.mark.multiprocess
def test_torchrec_planner_without_torchrec_keeps_tables_whole_on_gloo(tmp_path):
    reports = check_planner_protocol_on_gloo(registry.get("planner", "torchrec"), tmp_path,
                                             env={"GEMZOO_NO_TORCHREC": "1"})
    assert not any(r["sharded"] or r["planner_keys"] for r in reports)


@pytest.mark.multiprocess
def test_torchrec_planner_on_gloo_resumes_bit_exact(tmp_path):
    skip_unless_torchrec()
    check_planner_on_gloo("torchrec", tmp_path)


@pytest.mark.multiprocess
def test_a_third_party_planner_with_replica_groups_on_gloo(tmp_path):
    """tests/support/toy_kinds.py's planner: a 2-D mesh (replica x shard), its own table optimizer and sync."""
    reports = check_planner_protocol_on_gloo(ReplicatePlanner(), tmp_path)
    assert all(r["planner_keys"] > 0 for r in reports)  # the tables' Adagrad accumulators went through the file


class ForgetsTables(WholeTables):
    """Keeps the tables whole but lists only the dense parameters as replicated: nothing trains the tables."""

    def replicated_parameters(self, model):
        tables = {id(p) for p in model.sparse_arch.parameters()}
        return [p for p in super().replicated_parameters(model) if id(p) not in tables]


class LosesItsState(ReplicatePlanner):
    """The toy planner whose state_dict drops one accumulator: a resume would restart it from zero."""

    def state_dict(self, model):
        return dict(list(super().state_dict(model).items())[1:])


class BadMesh(WholeTables):
    def mesh_dims(self, topology):
        return {"replica": 2, "shard": topology.world_size}


@pytest.mark.parametrize("planner,problem", [(ForgetsTables(), "unchanged"), (LosesItsState(), "lacks"),
                                             (BadMesh(), "but the world has 1")], ids=lambda x: type(x).__name__)
def test_the_suite_fails_broken_planners(planner, problem):
    with pytest.raises((AssertionError, ConfigError), match=problem):
        check_planner_local(planner)
