"""Precision policies: swap linears (and attention matmuls) for lower-precision modules."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
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


def is_kept(name: str, cfg: PrecisionConfig) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in cfg.keep)


def swap_linears(model: nn.Module, cfg: PrecisionConfig, make) -> dict[str, str]:
    """Replace every nn.Linear not matched by ``cfg.keep`` with ``make(linear)``; return name -> kind."""
    plan = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear:
                if is_kept(full, cfg):
                    plan[full] = "kept"
                    continue
                setattr(module, child_name, make(child))
                plan[full] = "swapped"
    return plan


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
