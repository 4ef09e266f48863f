"""Batching policies: redistribute a step's samples across data-parallel ranks before the step.

Each rank loads only its own contiguous part of the global batch (``gemzoo.data.exchange.load_shard``). The
trainer gives the policy that part, the per-sample costs of it from the model's ``cost_model`` (attention
FLOPs of each sample's allowed pairs plus linear FLOPs of its tokens) and the data-parallel group, and trains
on the batch the policy returns: this rank's samples.

Most policies only partition. They implement ``assign(costs, world_size)`` over the *global* costs, and
``gemzoo.data.exchange.rebalance`` does the rest: it all-gathers the costs (one number per sample), calls
``assign`` (every rank computes the same answer), and moves each sample to its rank with one all-to-all of
the jagged batch. A policy that moves samples itself (e.g. one that knows
that nothing has to move) also defines ``rebalance(batch, costs, dp) -> Batch``; its answer must be
the same as the default one (the batching conformance suite checks it on gloo).

A policy whose ``assign`` may run in a worker thread (thread-safe: a pure function of its arguments, no
shared mutable state) says so with ``overlap = True``; the trainer (``gemzoo.data.exchange.Lookahead``) then
computes step t+1's partition while step t trains. Every collective stays on the trainer's thread.
``overlap_worker = "process"`` runs ``assign`` in a spawned process instead of a thread (no shared GIL; the
policy must then be picklable). ``overlap_depth = d`` (default 1) partitions steps t+1..t+d ahead, each in one
of d workers, for partitions longer than a step (many ranks): each then has d steps' time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class DataParallelGroup:
    """The ranks that split a batch between them: this rank's index in it, how many there are, and their
    process group (``None``: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup
    # the same ranks, in the same order, over a group that runs CPU tensors (gloo): with one, the trainer's
    # Lookahead loads, prices and moves the samples on the host and then copies them to the device, so a GPU
    # step waits for no device value; None: the batching collectives run on ``group``, on the batch's device
    host: DataParallelGroup | None = None

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"DataParallelGroup needs 0 <= rank < size, got rank={self.rank}, size={self.size}")
        if self.host is not None and (self.host.rank, self.host.size) != (self.rank, self.size):
            raise ValueError(f"DataParallelGroup's host group is rank {self.host.rank} of {self.host.size}, the group "
                             f"rank {self.rank} of {self.size}: they must be the same ranks in the same order")


@runtime_checkable
class BatchingPolicy(Protocol):
    def assign(self, costs: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        """Partition the global batch: ``costs`` (float64 ``[N]``) is the work of global sample i (samples are
        numbered rank by rank: rank 0's part first); return ``world_size`` int64 tensors of sample indices,
        each sample in exactly one, in the order that rank trains them. Deterministic: a pure function of
        ``costs`` and ``world_size``, since every rank computes it and all must agree."""


def overlaps(policy) -> bool:
    """Whether ``policy.assign`` may run one step ahead in a worker thread: the policy sets ``overlap = True``
    (absent: False, synchronous) and leaves the moving to gemzoo (no ``rebalance`` of its own)."""
    return getattr(policy, "overlap", False) is True and custom_rebalance(policy) is None


def overlap_worker(policy) -> str:
    """Where an overlapping policy's ``assign`` runs: ``"thread"`` (the default) or ``"process"``."""
    return getattr(policy, "overlap_worker", "thread")


def overlap_depth(policy) -> int:
    """How many steps ahead an overlapping policy's partitions run (``overlap_depth``, default 1), in as many
    workers."""
    depth = getattr(policy, "overlap_depth", 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"{type(policy).__name__}.overlap_depth must be an int >= 1, got {depth!r}")
    return depth


def custom_rebalance(policy):
    """The policy's own ``rebalance(batch, costs, dp)``, or None when it leaves the moving to gemzoo."""
    fn = getattr(policy, "rebalance", None)
    return fn if callable(fn) else None
