"""gemzoo's public plugin API: the one module a plugin imports.

Everything a plugin needs to implement a kind (the hook marker, the Protocols and capability types of every
kind, the options base, the errors, the jagged helpers, the attention semantics and the registry's lookups)
is re-exported here, and nothing else of gemzoo is promised to stay where it is::

    from gemzoo.api import AttentionCapabilities, FunctionKernel, hookimpl

    @hookimpl
    def gemzoo_register_attention(register):
        register("my-kernel", FunctionKernel(my_attention, AttentionCapabilities(...), "what it is"))

``API_VERSION`` is ``MAJOR.MINOR``: a minor release only adds names, a major one may change or remove them.
A plugin declares the range it was written for in its entry-point module (``GEMZOO_API = ">=1,<2"``); a
plugin whose range excludes this version is refused at load time with a message naming both, and the other
plugins keep working (``gemzoo.plugins`` checks it; ``gemzoo plugins`` lists such a plugin as failed).

The training-level names at the end of ``__all__`` (``Trainer``, ``train``, ``load_config`` and the batching
exchange helpers) are loaded on first use, so importing this module from a plugin never imports the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

from gemzoo import registry
from gemzoo.attention import (
    ACTIVATION_CODES,
    FunctionKernel,
    JaggedAttention,
    allowed_mask,
    apply_activation,
    apply_rope,
    attention_sites,
    check_inputs,
    kernels_that_serve,
    materialize_relative_bias,
    pair_allowed,
    reference_attention,
    relative_bias_block,
    repeat_kv,
    validated_longest,
)
from gemzoo.embedding import TableConfig, torchrec_available
from gemzoo.errors import (
    CheckpointError,
    ConfigError,
    DataNotFound,
    GemzooError,
    JaggedShapeError,
    PluginError,
    TrainingError,
)
from gemzoo.flops import attention_flops, attention_pairs, linear_flops
from gemzoo.interfaces.attention import (
    ACTIVATIONS,
    TIME_BUCKET_DIVISOR,
    AttentionCapabilities,
    AttentionKernel,
    AttentionRequest,
    RelativeAttentionBias,
)
from gemzoo.interfaces.batching import BatchingPolicy, DataParallelGroup, overlap_depth, overlap_worker, overlaps
from gemzoo.interfaces.comms import COLLECTIVES, CommsBackend, CommsCapabilities
from gemzoo.interfaces.memory import MemoryPolicy
from gemzoo.interfaces.models import (
    Batch,
    Dataset,
    DatasetSpec,
    Evaluator,
    ModelOutput,
    ModelSpec,
    RecModel,
    host_view,
    transformer_blocks,
)
from gemzoo.interfaces.options import Configurable, TakesOptions, bounded
from gemzoo.interfaces.planner import Planner, SparseOptimizer, Topology, WholeTables, whole_parameters
from gemzoo.interfaces.precision import (
    BF16Linear,
    OptimizerStepHook,
    PrecisionCapabilities,
    PrecisionConfig,
    PrecisionPolicy,
    precision_report,
    swap_linears,
)
from gemzoo.jagged import (
    TensorCache,
    graph_capturing,
    lengths_to_offsets,
    max_length,
    offsets_to_lengths,
    positions,
    seq_ids,
    validate_offsets,
)
from gemzoo.mx import dequantize_mx_torch, quantize_mx_torch
from gemzoo.ops import (
    dequantize_mx,
    hadamard_transform,
    hadamard_transform_torch,
    jagged_to_padded,
    padded_to_jagged,
    quantize_mx,
)
from gemzoo.plugins import API_VERSION, hookimpl

# Training-level names, imported on first use (they sit above the plugin layer, and the trainer loads plugins).
_LAZY = {
    "Trainer": "gemzoo.train.trainer",
    "train": "gemzoo.train.trainer",
    "TrainingInterrupted": "gemzoo.train.loop",
    "configured": "gemzoo.train.trainer",
    "load_config": "gemzoo.config",
    "peak_flops": "gemzoo.train.flops",
    "Lookahead": "gemzoo.data.lookahead",
    "PartitionWorker": "gemzoo.data.lookahead",
    "WORKERS": "gemzoo.data.lookahead",
    "available_cpus": "gemzoo.data.lookahead",
    "load_shard": "gemzoo.data.exchange",
    "route_checked": "gemzoo.data.exchange",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gemzoo.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "API_VERSION", "hookimpl", "registry",
    # errors
    "GemzooError", "ConfigError", "DataNotFound", "PluginError", "JaggedShapeError", "CheckpointError",
    "TrainingError",
    # options
    "Configurable", "TakesOptions", "bounded",
    # attention: the request, the kernel Protocol, its semantics and input checks
    "ACTIVATIONS", "ACTIVATION_CODES", "AttentionCapabilities", "AttentionKernel", "AttentionRequest",
    "FunctionKernel", "JaggedAttention", "allowed_mask", "apply_activation", "apply_rope", "attention_sites",
    "check_inputs", "kernels_that_serve", "pair_allowed", "reference_attention", "validated_longest",
    "RelativeAttentionBias", "TIME_BUCKET_DIVISOR", "materialize_relative_bias", "relative_bias_block", "repeat_kv",
    # jagged tensors
    "TensorCache", "graph_capturing", "jagged_to_padded", "lengths_to_offsets", "max_length", "offsets_to_lengths",
    "padded_to_jagged", "positions", "seq_ids", "validate_offsets",
    # the other kinds
    "BatchingPolicy", "DataParallelGroup", "overlap_depth", "overlap_worker", "overlaps",
    "COLLECTIVES", "CommsBackend", "CommsCapabilities",
    "MemoryPolicy",
    "Batch", "Dataset", "DatasetSpec", "Evaluator", "ModelOutput", "ModelSpec", "RecModel", "transformer_blocks",
    "host_view",
    "Planner", "SparseOptimizer", "Topology", "WholeTables", "whole_parameters", "TableConfig",
    "torchrec_available",
    "BF16Linear", "OptimizerStepHook", "PrecisionCapabilities", "PrecisionConfig", "PrecisionPolicy",
    "precision_report", "swap_linears",
    # numerics shared by kernels: FLOP counts, MX casts, the Hadamard transform
    "attention_flops", "attention_pairs", "linear_flops",
    "quantize_mx", "dequantize_mx", "quantize_mx_torch", "dequantize_mx_torch",
    "hadamard_transform", "hadamard_transform_torch",
    # training-level, loaded on first use
    *_LAZY,
]
