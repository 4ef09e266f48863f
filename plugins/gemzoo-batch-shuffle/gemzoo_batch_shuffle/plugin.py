"""Registers the batching policy ``base-batch-shuffle``: GEM's base batch shuffling.

With jagged histories a rank that draws a few 16K-event users does many times the attention work of one that
draws short ones, and every other rank waits for it at the gradient sync. This policy balances the model's
per-sample cost (``model.cost_model``: attention FLOPs over each sample's allowed pairs at every attention
site plus linear FLOPs per token) across the data-parallel ranks. It only partitions: each rank loads its
own part of the global batch, ``gemzoo.data.exchange.rebalance`` all-gathers the costs (one number per
sample), calls ``assign`` (the same answer on every rank) and moves the samples with one all-to-all of the
jagged batch. The trainer weights each rank's loss by its share of the global loss terms, so the update
does not depend on the split.

Options (``[plugins.options.base-batch-shuffle]``, validated by ``BatchShuffleOptions``)::

    equal_count = false   # true: every rank trains floor(N/W) or ceil(N/W) samples
    method = "auto"       # "lpt" (longest first, O(N log W)), "kk" (Karmarkar-Karp, free counts), "bldm"
                          # (balanced Karmarkar-Karp), "auto": the better of lpt and kk/bldm while
                          # N * W <= 2**16, else lpt
    refine = true         # local search after the partition: moves and swaps between heaviest and lightest
    keep_local = true     # match subsets to ranks so that the most samples stay where they were loaded
    overlap = true        # compute step t+1's partition in a worker while step t trains
    worker = "process"    # where: "process" (a spawned interpreter, no shared GIL) or "thread"
    overlap_depth = 1     # steps partitioned ahead, one worker each: 2 when a partition outlasts a step
                          # (gem-bench at 8192 ranks, H200 host, before 2026-12-02's faster partition: ~0.3 s
                          # against a ~0.26 s step)

``overlap``: ``assign`` is a pure function of its arguments (no state, numpy and torch on CPU), so it is
thread-safe and the policy says so (``overlap`` is what ``gemzoo.interfaces.batching.overlaps`` reads,
``overlap_worker`` what ``gemzoo.interfaces.batching.overlap_worker`` reads). The trainer's
``gemzoo.data.exchange.Lookahead`` then all-gathers step t+1's costs on the main thread right after step t's
samples have arrived and runs ``assign`` in the worker during step t; step t+1 waits for it and does the
all-to-all. The samples, hence the losses, are bit-identical to ``overlap = false``. ``worker = "process"``
(the default) because a thread shares the GIL with the trainer's thread, whose torch ops (kernel launches)
release and retake it at every call (``gemzoo.data.exchange.PartitionWorker``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemzoo.api import WORKERS, ConfigError, TakesOptions, hookimpl
from gemzoo_batch_shuffle.partition import METHODS, partition

GEMZOO_API = ">=1,<2"


@dataclass
class BatchShuffleOptions:
    equal_count: bool = False
    method: str = "auto"
    refine: bool = True
    keep_local: bool = True
    overlap: bool = True  # step t+1's partition computed in a worker while step t trains (same samples)
    worker: str = "process"  # the overlap's worker: "process" (spawned, no shared GIL) or "thread"
    overlap_depth: int = 1  # steps partitioned ahead, each in its own worker: > 1 when a partition outlasts a step

    def __post_init__(self):
        where = "plugins.options.base-batch-shuffle"
        for name in ("equal_count", "refine", "keep_local", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{where}.{name} must be true or false, got {getattr(self, name)!r}")
        if self.method not in METHODS:
            raise ConfigError(f"{where}.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if isinstance(self.overlap_depth, bool) or not isinstance(self.overlap_depth, int) or \
                not 1 <= self.overlap_depth <= 8:
            raise ConfigError(f"{where}.overlap_depth must be an int from 1 to 8 (steps partitioned ahead, one "
                              f"worker each), got {self.overlap_depth!r}")
        if self.worker not in WORKERS:
            raise ConfigError(f"{where}.worker must be one of {', '.join(WORKERS)}, got {self.worker!r}")
        if self.method == "kk" and self.equal_count:
            raise ConfigError(f"{where}: method = \"kk\" gives free counts; with equal_count = true use "
                              "method = \"bldm\", \"lpt\" or \"auto\"")


class BatchShuffle(TakesOptions):
    """Balance the cost model's work across data-parallel ranks (LPT and Karmarkar–Karp, then a local
    search); deterministic, every sample exactly once."""

    options_cls = BatchShuffleOptions
    description = "balance jagged work across dp ranks: LPT / Karmarkar-Karp on the model's per-sample cost"

    @property
    def overlap(self) -> bool:
        """assign is thread-safe; True lets the trainer compute it one step ahead in a worker thread."""
        return self.options.overlap

    @property
    def overlap_worker(self) -> str:
        return self.options.worker

    @property
    def overlap_depth(self) -> int:
        return self.options.overlap_depth

    def assign(self, costs: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        o = self.options
        return partition(costs, world_size, equal_count=o.equal_count, method=o.method, refine=o.refine,
                         keep_local=o.keep_local)

    def __repr__(self) -> str:
        return f"BatchShuffle({self.options})"


@hookimpl
def gemzoo_register_batching(register):
    register("base-batch-shuffle", BatchShuffle())
