"""Protocols and capability dataclasses for every registry kind: declarations only (the attention sites and
semantics that run them are :mod:`gemzoo.attention`)."""

from gemzoo.interfaces.attention import AttentionCapabilities, AttentionKernel, AttentionRequest
from gemzoo.interfaces.batching import BatchingPolicy
from gemzoo.interfaces.comms import CommsBackend, CommsCapabilities
from gemzoo.interfaces.memory import MemoryPolicy
from gemzoo.interfaces.models import (
                                      Batch,
                                      Dataset,
                                      DatasetSpec,
                                      Evaluator,
                                      ModelOutput,
                                      ModelSpec,
                                      RecModel,
                                      transformer_blocks,
)
from gemzoo.interfaces.options import Configurable
from gemzoo.interfaces.planner import Planner, SparseOptimizer, Topology, WholeTables
from gemzoo.interfaces.precision import OptimizerStepHook, PrecisionCapabilities, PrecisionConfig, PrecisionPolicy

__all__ = [
    "AttentionCapabilities", "AttentionKernel", "AttentionRequest", "BatchingPolicy",
    "CommsBackend", "CommsCapabilities", "MemoryPolicy", "DatasetSpec", "Evaluator", "ModelOutput",
    "ModelSpec", "RecModel", "Planner", "SparseOptimizer", "Topology", "WholeTables", "PrecisionCapabilities",
    "PrecisionConfig", "PrecisionPolicy",
    "Batch", "Dataset", "transformer_blocks", "Configurable", "OptimizerStepHook",
]
