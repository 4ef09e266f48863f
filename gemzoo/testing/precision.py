"""Precision conformance: a policy's linear matches fp32 within the tolerance the policy declares."""

from __future__ import annotations

import torch
from torch import nn


def check_precision_linear(policy, *, in_features: int = 64, out_features: int = 96, tokens: int = 128,
                           device: str = "cpu", seed: int = 0, backward: bool = True) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    ref = nn.Linear(in_features, out_features).to(device)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
        ref.bias.copy_(torch.randn(out_features, generator=gen))
    mine = policy.make_linear(_clone(ref))
    x = torch.randn(tokens, in_features, generator=gen).to(device)
    x_ref, x_mine = x.clone().requires_grad_(backward), x.clone().requires_grad_(backward)
    y_ref, y_mine = ref(x_ref), mine(x_mine)
    tol = policy.capabilities.linear_rtol
    errors = {"y": _rel(y_mine, y_ref)}
    if backward:
        g = torch.randn(y_ref.shape, generator=gen).to(device)
        y_ref.backward(g)
        y_mine.float().backward(g.to(y_mine.dtype).float())
        errors["dx"] = _rel(x_mine.grad, x_ref.grad)
        w_mine = _weight(mine)
        errors["dw"] = _rel(w_mine.grad, ref.weight.grad)
    bad = {k: e for k, e in errors.items() if not e <= tol}
    assert not bad, f"{type(policy).__name__}: relative error over {tol:g}: {bad}"
    return errors


def _clone(linear: nn.Linear) -> nn.Linear:
    new = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None).to(linear.weight.device)
    new.load_state_dict(linear.state_dict())
    return new


def _weight(module: nn.Module) -> torch.Tensor:
    for name, p in module.named_parameters():
        if name.endswith("weight"):
            return p
    raise AssertionError(f"{type(module).__name__} has no weight parameter")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
