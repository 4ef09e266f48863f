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


@pytest.fixture
def toy(fresh_registry):
    """A fresh registry with the toy plugin of ``tests/support/toy_plugin.py`` installed (a model and a dataset;
    ``toy_plugin.TOY_CONFIG`` trains them)."""
    from toy_plugin import install

    install(fresh_registry)
    return fresh_registry
