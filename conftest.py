"""Root conftest: tests run with --import-mode=importlib (plugins may reuse test file names), so
each plugin's tests/ folder goes on sys.path for its helper modules.

Test tiers (docs/testing.md). Markers are registered in pyproject.toml; the rules below apply them, so a new
test file needs no marker line of its own for these cases:

- ``multiprocess`` tests are also ``slow`` (a spawned gloo rank or a Python subprocess imports torch: seconds
  on a 2-core CPU before any work);
- every test of a module that names Triton interpreter groups (``INTERPRETER_GROUPS``, see
  ``gemzoo.testing.interpreter``) is ``multiprocess`` and so ``slow``: it waits for a subprocess group;
- the cases listed in ``SLOW_CASES`` are ``slow`` (their parameters come from the registry or from shipped
  files, so no decorator can name them);
- ``gpu`` tests are skipped, with the reason, on a machine without CUDA;
- ``GEMZOO_TEST_TIMEOUT_SCALE`` (``gemzoo.testing.timeouts``) scales the per-test hang guard of pytest-timeout.

The quick tier is ``python -m pytest -q -m "not slow"``.
"""

import glob
import os
import sys

import pytest

pytest_plugins = ["gemzoo.testing.pytest_plugin"]  # <kind>_name parametrisation, registry_entry

HERE = os.path.dirname(os.path.abspath(__file__))
for tests_dir in sorted(glob.glob(os.path.join(HERE, "plugins", "*", "tests"))):
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)

# The one GPU-or-not switch of the test suite (Triton's interpreter on a machine without CUDA), before any test
# module imports triton.
from gemzoo.testing.interpreter import select_triton_backend  # noqa: E402

CUDA = select_triton_backend()

# Cases that take more than about 2 s on a 2-core CPU, of tests parametrised over the registry (``<kind>_name``,
# gemzoo.testing.pytest_plugin) or over shipped files: no decorator names them. The other cases of the same
# tests stay in the quick tier.
SLOW_CASES = frozenset({
    "tests/test_conformance_memory.py::test_memory_policy_keeps_loss_and_gradients[auto-ac]",
    "tests/test_conformance_memory.py::test_memory_policy_keeps_loss_and_gradients[full-ac]",
    "tests/test_conformance_memory.py::test_memory_policy_keeps_loss_and_gradients[act-quant]",
    "tests/test_sync_free_step.py::test_a_gem_step_reads_no_device_value[mxfp8]",
    "tests/test_sync_free_step.py::test_a_gem_step_reads_no_device_value[fp8-rowwise]",
    "tests/test_models.py::test_backward_is_bitwise_repeatable[gem]",
    "tests/test_models.py::test_backward_is_bitwise_repeatable[hstu]",
    "tests/test_ablation.py::test_shipped_ablations_validate[gem-bench]",
})


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `-m "not slow"` sees the markers added here
def pytest_collection_modifyitems(config, items):
    from gemzoo.testing.timeouts import timeout_scale

    scale = timeout_scale()
    per_test = None
    if scale != 1 and config.pluginmanager.hasplugin("timeout"):
        per_test = float(config.getoption("timeout", None) or config.getini("timeout") or 0) * scale or None
    no_cuda = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if getattr(getattr(item, "module", None), "INTERPRETER_GROUPS", None):
            item.add_marker(pytest.mark.multiprocess)
        if item.nodeid in SLOW_CASES or (item.get_closest_marker("multiprocess") and not item.get_closest_marker("slow")):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not CUDA:
            item.add_marker(no_cuda)
        if per_test is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(per_test))
