"""Precision conformance: a policy's linear matches fp32 within the tolerance the policy declares
(``capabilities.linear_rtol``), forward and every gradient, over a few shapes (3-D inputs, a partial block of
tokens, with and without bias); and ``apply`` swaps exactly the linears that ``precision.keep`` does not keep,
keeps every state-dict name, and a small stack of them stays within its tolerance. A policy with
``after_optimizer_step`` gets it called after an optimizer step.

    from gemzoo.testing.precision import check_precision_apply, check_precision_linear, precision_linear_cases
    @pytest.mark.parametrize("case", precision_linear_cases(), ids=str)
    def test_linear(case):
        check_precision_linear(MY_POLICY, **case.kwargs())
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import nn

from gemzoo.interfaces.precision import OptimizerStepHook, PrecisionConfig


@dataclass(frozen=True)
class LinearCase:
    in_features: int = 64
    out_features: int = 96
    tokens: int = 128
    leading: int = 1  # the input is [leading, tokens // leading, in_features] when > 1
    bias: bool = True
    seed: int = 0

    def kwargs(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        shape = f"{self.leading}x{self.tokens // self.leading}" if self.leading > 1 else str(self.tokens)
        return f"{shape}x{self.in_features}-{self.out_features}{'' if self.bias else '-nobias'}-s{self.seed}"


def precision_linear_cases() -> list[LinearCase]:
    """In-features multiples of 32 (MX block scales need them); token counts that are not."""
    return [LinearCase(), LinearCase(64, 48, 111, leading=3, seed=1), LinearCase(96, 64, 40, bias=False, seed=2)]


def check_precision_linear(policy, *, in_features: int = 64, out_features: int = 96, tokens: int = 128,
                           leading: int = 1, bias: bool = True, device: str = "cpu", seed: int = 0,
                           backward: bool = True) -> dict[str, float]:
    """``policy.make_linear(linear)`` against ``linear`` in fp32: y, dx, dw (and db) within ``linear_rtol``."""
    gen = torch.Generator().manual_seed(seed)
    ref = nn.Linear(in_features, out_features, bias=bias).to(device)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
        if bias:
            ref.bias.copy_(torch.randn(out_features, generator=gen))
    mine = policy.make_linear(_clone(ref))
    shape = (leading, tokens // leading, in_features) if leading > 1 else (tokens, in_features)
    x = torch.randn(shape, generator=gen).to(device)
    x_ref, x_mine = x.clone().requires_grad_(backward), x.clone().requires_grad_(backward)
    y_ref, y_mine = ref(x_ref), mine(x_mine)
    assert y_mine.shape == y_ref.shape, f"{type(mine).__name__} returned {tuple(y_mine.shape)}, want {tuple(y_ref.shape)}"
    tol = policy.capabilities.linear_rtol
    errors = {"y": _rel(y_mine, y_ref)}
    if backward:
        g = torch.randn(y_ref.shape, generator=gen).to(device)
        y_ref.backward(g)
        y_mine.float().backward(g.to(y_mine.dtype).float())
        errors["dx"] = _rel(x_mine.grad, x_ref.grad)
        errors["dw"] = _rel(_param(mine, "weight").grad, ref.weight.grad)
        if bias:
            errors["db"] = _rel(_param(mine, "bias").grad, ref.bias.grad)
    bad = {k: e for k, e in errors.items() if not e <= tol}
    assert not bad, f"{type(policy).__name__}: relative error over {tol:g}: {bad}"
    return errors


class _Stack(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.head = nn.Linear(width, 32)

    def forward(self, x):
        h = self.body[0](x).float()
        h = self.body[2](self.body[1](h)).float()
        return self.head(h).float()


def check_precision_apply(policy, *, device: str = "cpu", seed: int = 0) -> dict[str, float]:
    """``apply`` with ``keep = ["head"]``: body linears become ``make_linear``'s type, the head does not (unless
    that type is nn.Linear itself); state-dict names are unchanged; the stack's output and gradients stay within
    3x ``linear_rtol`` of fp32 (three linears, the kept head included); ``after_optimizer_step`` runs."""
    torch.manual_seed(seed)
    ref = _Stack().to(device)
    model = copy.deepcopy(ref)
    swapped_type = type(policy.make_linear(_clone(ref.body[0])))
    names = set(model.state_dict())
    out = policy.apply(model, PrecisionConfig(keep=["head"]))
    model = model if out is None else out
    assert set(model.state_dict()) == names, (
        f"{type(policy).__name__}.apply renamed state-dict entries (checkpoints would not load): "
        f"{sorted(names ^ set(model.state_dict()))}")
    for i in (0, 2):
        assert type(model.body[i]) is swapped_type, f"body.{i} is {type(model.body[i]).__name__}, not {swapped_type.__name__}"
    if swapped_type is not nn.Linear:
        assert type(model.head) is not swapped_type, "precision.keep = ['head'] did not keep the head"
    x = torch.randn(48, 64, device=device)
    y_ref, y = ref(x), model(x)
    y_ref.square().mean().backward()
    y.float().square().mean().backward()
    tol = 3 * policy.capabilities.linear_rtol
    errors = {"y": _rel(y, y_ref)}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient under {type(policy).__name__}"
        errors[f"d{name}"] = _rel(p.grad, ref_params[name].grad)
    bad = {k: e for k, e in errors.items() if not e <= tol}
    assert not bad, f"{type(policy).__name__}: relative error over {tol:g}: {bad}"
    if isinstance(policy, OptimizerStepHook):
        torch.optim.SGD(model.parameters(), lr=1e-3).step()
        policy.after_optimizer_step(model)
        assert torch.isfinite(model(x).float()).all(), "non-finite output after after_optimizer_step"
    return errors


def _clone(linear: nn.Linear) -> nn.Linear:
    new = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None).to(linear.weight.device)
    new.load_state_dict(linear.state_dict())
    return new


def _param(module: nn.Module, which: str) -> torch.Tensor:
    for name, p in module.named_parameters():
        if name.endswith(which):
            return p
    raise AssertionError(f"{type(module).__name__} has no {which} parameter")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
