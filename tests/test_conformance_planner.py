"""Planner conformance over every registered planner (gemzoo.testing.planner): one process always; 2 gloo ranks
with a checkpoint round trip for the torchrec planner (the only planner a clean install has)."""

import pytest

from gemzoo.testing import skip_unless_torchrec
from gemzoo.testing.planner import check_planner_local, check_planner_on_gloo


def test_plan_shard_step_round_trip(planner_name, registry_entry):
    check_planner_local(registry_entry("planner", planner_name))


@pytest.mark.distributed
def test_torchrec_planner_on_gloo_resumes_bit_exact(tmp_path):
    skip_unless_torchrec()
    check_planner_on_gloo("torchrec", tmp_path)
