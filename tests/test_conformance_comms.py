"""Comms conformance over every registered backend that runs on CPU: 2 gloo ranks (gemzoo.testing.comms)."""

import pytest

import gemzoo
from gemzoo.testing.comms import BASE_COLLECTIVES, check_comms_on_gloo

pytestmark = pytest.mark.distributed


def test_every_backend_gives_c10d_answers(tmp_path):
    names = [n for n in gemzoo.registry.names("comms")
             if "cpu" in gemzoo.registry.get("comms", n).capabilities.devices]
    assert "torch" in names
    summary = check_comms_on_gloo(names, tmp_path)  # one spawn for all backends: gloo tests are slow
    for name in names:
        claimed = summary[name]["claimed"]
        assert set(summary[name]["checked"]) == set(BASE_COLLECTIVES) | set(claimed), name
