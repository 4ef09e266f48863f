"""Model families and datasets as the trainer sees them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch


@dataclass
class ModelOutput:
    loss: torch.Tensor
    logs: dict[str, float]  # extra scalars to log (per-task losses, ...)


@runtime_checkable
class RecModel(Protocol):
    """A model the trainer can drive. It is an nn.Module with these extra methods."""

    def forward(self, batch: Any) -> ModelOutput: ...

    def flops(self, batch: Any) -> int:
        """Model FLOPs of one forward+backward on ``batch``, over real (unpadded) tokens."""

    def evaluator(self) -> "Evaluator": ...


class Evaluator(Protocol):
    def update(self, batch: Any) -> None: ...

    def compute(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class ModelSpec:
    """Registered by ``gemzoo_register_models``: ``config_cls`` fields are the keys allowed in [model]."""

    config_cls: type
    build: Callable[..., torch.nn.Module]  # build(model_cfg, data_info) -> RecModel
    description: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """Registered by ``gemzoo_register_datasets``: ``config_cls`` fields are the keys allowed in [data]."""

    config_cls: type
    build: Callable[..., Any]  # build(data_cfg, split, seed) -> Dataset (iterable of batches)
    description: str = ""
