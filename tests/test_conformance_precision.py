"""Precision conformance over every registered policy that runs on CPU (gemzoo.testing.precision)."""

import pytest
import torch

from gemzoo.testing.precision import check_precision_apply, check_precision_linear, precision_linear_cases
from gemzoo.testing.pytest_plugin import registered


@pytest.mark.parametrize("name", registered("precision", device="cpu"))
@pytest.mark.parametrize("case", precision_linear_cases(), ids=str)
def test_linear_matches_fp32(name, case, registry_entry):
    check_precision_linear(registry_entry("precision", name), **case.kwargs())


@pytest.mark.parametrize("name", registered("precision", device="cpu"))
def test_apply_swaps_what_keep_leaves(name, registry_entry):
    check_precision_apply(registry_entry("precision", name))


class _Scaled(torch.nn.Linear):
    """A 'low-precision' linear that is 2% off: within a 6% promise, outside a 1% one."""

    def forward(self, x):
        return super().forward(x) * 1.02


class _ToyPolicy:
    def __init__(self, rtol):
        from gemzoo.interfaces.precision import PrecisionCapabilities

        self.capabilities = PrecisionCapabilities(linear_rtol=rtol)
        self.steps = 0

    def make_linear(self, linear):
        from gemzoo.interfaces.precision import adopt_linear

        return adopt_linear(_Scaled, linear)

    def apply(self, model, cfg):
        from gemzoo.interfaces.precision import swap_linears

        swap_linears(model, self.make_linear, cfg.keep)
        return model

    def after_optimizer_step(self, model):
        self.steps += 1


def test_the_suite_holds_a_policy_to_its_declared_tolerance():
    loose, tight = _ToyPolicy(0.06), _ToyPolicy(0.01)
    check_precision_linear(loose)
    check_precision_apply(loose)
    assert loose.steps == 1  # after_optimizer_step ran
    with pytest.raises(AssertionError, match="relative error over 0.01"):
        check_precision_linear(tight)


def test_swap_linears_keeps_by_pattern_swaps_once_and_shares_parameters():
    from gemzoo.interfaces.precision import BF16Linear, adopt_linear, swap_linears

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    weights = [model[0].weight, model[1][0].weight]
    plan = swap_linears(model, lambda lin: adopt_linear(_Scaled, lin), ["1.*"])
    assert plan == {"0": "swapped", "1.0": "kept"}
    assert type(model[0]) is _Scaled and type(model[1][0]) is torch.nn.Linear  # kept=None: left as it is
    assert model[0].weight is weights[0]
    assert swap_linears(model, lambda lin: adopt_linear(_Scaled, lin), ["1.*"], kept=BF16Linear.from_linear) \
        == {"1.0": "kept"}  # _Scaled is not a plain nn.Linear: never swapped twice
    assert type(model[1][0]) is BF16Linear and model[1][0].weight is weights[1]
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"list of fnmatch patterns, e.g. \['head\.\*'\]"):
        swap_linears(model, lambda lin: lin, "head.*")
