"""Memory policies: trade compute for activation memory.

A policy is applied in the trainer's step 8, in the order of ``[plugins] memory = [...]``; their
``step_context()`` managers are entered in that order around each forward+backward.

Optional members, looked up with ``getattr`` (the built-ins ``none`` and ``full-ac`` have none of them):

- ``needs_compile: bool``: the policy works through ``torch.compile`` (e.g. ``auto-ac``, the partitioner's
  activation-memory budget); the trainer turns ``run.compile`` on and says so.
- ``report() -> dict``: what the policy did (bytes saved per step, chosen budget, which tensors it touched),
  JSON-serialisable; the trainer logs it (``metrics.jsonl`` event ``memory``) and returns it in
  ``TrainResult.memory``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class MemoryPolicy(Protocol):
    def apply(self, model: nn.Module, cfg) -> nn.Module:
        """Wrap the model (e.g. checkpoint its blocks)."""

    def step_context(self) -> AbstractContextManager:
        """A context entered around each forward+backward (e.g. saved_tensors_hooks)."""


def needs_compile(policy) -> bool:
    """Whether ``policy`` only works under ``torch.compile``."""
    return bool(getattr(policy, "needs_compile", False))


def policy_report(policy) -> dict:
    """``policy.report()``, or ``{}`` for a policy that reports nothing."""
    report = getattr(policy, "report", None)
    return dict(report()) if callable(report) else {}
