import os
import sys

import pytest

os.environ.setdefault("GEMZOO_QUIET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))


@pytest.fixture
def fresh_registry():
    """A registry reloaded from scratch, restored afterwards."""
    from gemzoo import registry

    registry.reset()
    yield registry
    registry.reset()
