"""Precision conformance over every registered policy that runs on CPU (gemzoo.testing.precision)."""

import pytest

from gemzoo.testing.precision import check_precision_apply, check_precision_linear, precision_linear_cases
from gemzoo.testing.pytest_plugin import registered


@pytest.mark.parametrize("name", registered("precision", device="cpu"))
@pytest.mark.parametrize("case", precision_linear_cases(), ids=str)
def test_linear_matches_fp32(name, case, registry_entry):
    check_precision_linear(registry_entry("precision", name), **case.kwargs())


@pytest.mark.parametrize("name", registered("precision", device="cpu"))
def test_apply_swaps_what_keep_leaves(name, registry_entry):
    check_precision_apply(registry_entry("precision", name))
