"""Precision policies: swap linears (and attention matmuls) for lower-precision modules.

The helpers every policy uses (the built-in ``bf16``, the plugins' ``mxfp8`` and ``fp8-rowwise``, a third
party's): :func:`swap_linears` walks the model once and honours ``precision.keep``; :func:`adopt_linear` wraps
a linear's own parameters in your ``nn.Linear`` subclass; :class:`BF16Linear` is the bf16 linear that kept
modules run as under policies that keep them in bf16."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrecisionConfig:
    keep: list[str] = field(default_factory=list)  # fnmatch patterns of module names kept in bf16


@dataclass(frozen=True)
class PrecisionCapabilities:
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    linear_rtol: float = 1e-5  # ||y - y_fp32|| / ||y_fp32|| the policy's linear promises
    compute_dtype: torch.dtype = torch.float32


@runtime_checkable
class PrecisionPolicy(Protocol):
    """Required members below. Optional: ``after_optimizer_step(model)`` (see ``OptimizerStepHook``) and the
    ``options_cls``/``configure`` pair (gemzoo.interfaces.options)."""

    capabilities: PrecisionCapabilities

    def apply(self, model: nn.Module, cfg: PrecisionConfig) -> nn.Module: ...

    def make_linear(self, linear: nn.Linear) -> nn.Module:
        """The module this policy puts in place of ``linear`` (used by the conformance suite)."""
        ...


@runtime_checkable
class OptimizerStepHook(Protocol):
    """Optional on a precision policy: called by the trainer with the model after every optimizer step,
    e.g. to refresh low-precision weight copies or amax histories from the updated master weights."""

    def after_optimizer_step(self, model: nn.Module) -> None: ...


def after_optimizer_step(policy, model: nn.Module) -> None:
    """Run ``policy.after_optimizer_step(model)`` when the policy has one."""
    if isinstance(policy, OptimizerStepHook):
        policy.after_optimizer_step(model)


def adopt_linear(cls: type, linear: nn.Linear) -> nn.Module:
    """An instance of the nn.Linear subclass ``cls`` that shares ``linear``'s parameters (no copy)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    return new


def is_kept(name: str, keep: Iterable[str]) -> bool:
    """Whether the module ``name`` matches one of the fnmatch patterns ``keep`` (``precision.keep``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in keep)


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], keep: Iterable[str] = (), *,
                 kept: Callable[[nn.Linear], nn.Module] | None = None) -> dict[str, str]:
    """Replace every plain ``nn.Linear`` of ``model`` in place (its type exactly, so modules a policy made are
    never swapped again): one whose name matches a pattern of ``keep`` becomes ``kept(linear)`` (stays as it is
    when ``kept`` is None), every other one ``make(linear)``. Returns module name -> ``"kept"`` or ``"swapped"``."""
    if isinstance(keep, str):
        raise TypeError(f"keep must be a list of fnmatch patterns, e.g. [{keep!r}], not the string {keep!r}")
    keep = list(keep)
    plan = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear:
                if is_kept(full, keep):
                    plan[full] = "kept"
                    if kept is None:
                        continue
                    setattr(module, child_name, kept(child))
                else:
                    setattr(module, child_name, make(child))
                    plan[full] = "swapped"
    return plan


class BF16Linear(nn.Linear):
    """nn.Linear whose matmul runs in bf16 with fp32 master weights; returns bf16."""

    precision = "bf16"

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BF16Linear:
        return adopt_linear(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), bias)


def precision_report(model: nn.Module) -> dict[str, str]:
    """Module name -> the precision it runs in (``precision`` attribute, else its weight dtype)."""
    out = {}
    for name, module in model.named_modules():
        tag = getattr(module, "precision", None)
        if tag is None and isinstance(module, nn.Linear):
            tag = str(module.weight.dtype).removeprefix("torch.")
        if tag is not None:
            out[name] = tag
    return out
