"""Memory policies: trade compute for activation memory."""

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
