"""Model families, datasets and batches as the trainer sees them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@dataclass
class ModelOutput:
    loss: torch.Tensor
    logs: dict[str, float | torch.Tensor]  # extra scalars to log (per-task losses, ...); 0-dim tensors are read
    # after the step's end, so returning them (not float()) keeps the forward free of host syncs


@runtime_checkable
class Batch(Protocol):
    """One batch of jagged samples. Every tensor field moves with ``to``; ``select`` picks samples (a batching
    policy's assignment) and keeps each one whole."""

    @property
    def num_samples(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens of the sequence the model's transformer runs over."""

    @property
    def lengths(self) -> torch.Tensor:
        """int64 ``[num_samples]``: each sample's sequence length."""

    def to(self, device) -> Batch: ...

    def select(self, index) -> Batch:
        """The samples ``index`` (a list or int64 tensor of sample positions), in that order."""


def host_view(batch):
    """The batch with its tensors on the host, read without waiting for the device: ``batch.host_view()`` where
    the batch type has one, else the batch itself.

    A batch moved to a GPU keeps the host batch it was copied from (gemzoo's batches record it as
    ``moved_from``; see ``gemzoo.data.batch``), so what a step needs to know of its shapes (longest sequences,
    per-feature totals, FLOPs, target counts) is read there instead of from device memory. Optional for a batch
    type: one without ``host_view`` is its own host view, and those reads wait for the device."""
    view = getattr(batch, "host_view", None)
    return view() if callable(view) else batch


@runtime_checkable
class Dataset(Protocol):
    """What a ``DatasetSpec.build(data_cfg, seed)`` returns."""

    info: dict  # what models need to build: num_items, max_len, task, sparse_tables, ...

    def train_batch(self, step: int) -> Batch:
        """The global batch of ``step``: deterministic in (seed, step), so a resumed run sees the same data."""

    def eval_batches(self, n: int) -> list[Batch]:
        """``n`` held-out batches, the same on every call."""


@runtime_checkable
class RecModel(Protocol):
    """A model the trainer can drive: an nn.Module (built on ``meta``) with these methods."""

    def forward(self, batch: Any) -> ModelOutput: ...

    def init_weights(self) -> None:
        """Fill every parameter and buffer from torch's global RNG (the trainer seeds it; called after
        ``to_empty``), so two builds with one seed are bitwise equal."""

    def embedding_tables(self) -> list:
        """The tables the planner shards (torchrec ``EmbeddingBagConfig``s, or gemzoo TableConfigs without
        torchrec); ``[]`` for a model without pooled sparse features."""

    def transformer_blocks(self) -> list[nn.Module]:
        """The repeated blocks: what FSDP2 shards and activation checkpointing wraps, in order."""

    def flops(self, batch: Any) -> int:
        """Model FLOPs of one forward+backward on ``batch``, over real (unpadded) tokens (gemzoo.flops)."""

    def cost_model(self, batch: Any) -> torch.Tensor:
        """float64 ``[batch.num_samples]``: each sample's share of ``flops(batch)`` (attention FLOPs of its
        allowed pairs at every attention site plus linear FLOPs of its tokens); sums to ``flops(batch)``.
        Batching policies balance ranks with it."""

    def evaluator(self) -> Evaluator: ...


@runtime_checkable
class Evaluator(Protocol):
    def update(self, batch: Any) -> None: ...

    def compute(self) -> dict[str, float]: ...


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The one scan for transformer blocks: ``model.transformer_blocks()`` when the model declares it, else
    the modules that mark themselves with ``is_transformer_block = True`` (models outside gemzoo)."""
    declared = getattr(model, "transformer_blocks", None)
    if callable(declared):
        return list(declared())
    return [m for m in model.modules() if getattr(m, "is_transformer_block", False)]


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
    build: Callable[..., Any]  # build(data_cfg, seed) -> Dataset
    description: str = ""
    # info_without_data(data_cfg) -> the ``info`` dict a model is built from, with nominal counts, for a dataset
    # whose files are not there yet (``gemzoo config show|validate`` then still build the model on meta)
    info_without_data: Callable[..., dict] | None = None
