"""Work schedules for skewed jagged batches, built on the device without a host sync.

A work item is one (sequence, block) pair: a block of BM queries (forward, dq) or of BN keys (dk/dv).
Sequences contribute ceil(L / block) items each, so no program covers padding. The item count is
at most ceil(T / block) + B, which the host knows from shapes alone; the schedule tensor has that many
slots and slots past the real count hold sequence -1 (their programs exit on the first load).

Orders (GPU blocks are issued in launch order):
  ``lpt``     (default) sequences longest first, and inside each sequence its items costliest first
              (cost = keys or queries visited, plus one block of fixed cost). The longest sequences
              start first and the short ones fill the tail, so no long sequence straggles, while the
              blocks of one sequence still run side by side and share its K/V in L2.
  ``item``    every item by its own cost, longest first, sequences interleaved (pure LPT).
  ``natural`` sequence by sequence, block by block, as laid out in memory.
The bench measures all three (see the README).

Split-K schedules (pointwise activations only, see ``split_items``) add a third row, the key split of
each query block: short query blocks over long key ranges then spread over many programs.

Length buckets (``lengths=(lo, hi)``) keep only the sequences whose longer side, max(Lq, Lk), lies in
(lo, hi]: the kernels then run once per bucket with tiles sized to it (see ``ops.length_buckets``), so a
48-token history is not computed as a 128 x 128 tile.
"""

from __future__ import annotations

import os

import torch

from gemzoo.api import TensorCache

ORDERS = ("lpt", "item", "natural")


def capacity(total: int, batch: int, block: int, lengths: tuple[int, int | None] | None = None) -> int:
    """Slots in a schedule: an upper bound on the number of items, from shapes alone. In a length bucket
    (lo, hi] with an upper bound, a sequence has at most ceil(hi / block) items."""
    cap = (total + block - 1) // block + batch
    if lengths is not None and lengths[1] is not None:
        cap = min(cap, batch * ((lengths[1] + block - 1) // block))
    return cap


# A model's attention layers share one batch's offsets, so a schedule is built once per batch and direction
# instead of once per layer and kernel: with short sequences the launches of building it, not the kernels, were
# the time (the host could not keep the GPU busy).
_cache = TensorCache(32)


def build_schedule(q_offsets: torch.Tensor, k_offsets: torch.Tensor, total: int, block: int, *, over: str,
                   causal: bool, window: int | None, order: str = "lpt", block_size: int | None = None,
                   lengths: tuple[int, int | None] | None = None, splits: int = 0) -> torch.Tensor:
    """int32 [2, cap]: row 0 the sequence of each item (-1 = no item), row 1 its block index. With ``splits`` > 0,
    int32 [3, cap * splits]: each item once per key split, as ``split_items`` makes it.

    ``over="q"`` makes one item per block of ``block`` queries (forward and dq kernels); ``over="k"``
    one per block of keys (dk/dv kernel). ``total`` is Tq or Tk accordingly. ``block_size`` (block
    attention) narrows each item's range, and so its cost, to the attention blocks it touches. ``lengths``
    (lo, hi) keeps only the sequences with lo < max(Lq, Lk) <= hi (hi None: no upper bound). Built once
    per offsets tensors and arguments (gemzoo.jagged.TensorCache); the result is shared, so do not modify it.

    On CUDA (and under the Triton interpreter) two Triton launches build it (``schedule_kernels.py``) for
    batches of up to ``TRITON_MAX_BATCH`` sequences and the ``lpt`` and ``natural`` orders; otherwise torch
    operators do (``build_schedule_torch``), with the same result.
    """
    if order not in ORDERS:
        raise ValueError(f"unknown schedule order {order!r}; choose one of {', '.join(ORDERS)}")
    args = (total, block, over, causal, window, order, block_size, lengths, splits)

    def build():
        builder = _build_triton if _triton_builds(q_offsets, order) else build_schedule_torch
        return builder(q_offsets, k_offsets, *args)

    return _cache.get((q_offsets, k_offsets), args, build)


def schedules_match(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two schedules of the same arguments are the same: every item's sequence (-1 past the real items),
    the real items' block indices and any key-split row. Past the real items the block index is undefined."""
    real = want[0] >= 0
    return (got.shape == want.shape and torch.equal(got[0], want[0]) and torch.equal(got[1][real], want[1][real])
            and torch.equal(got[2:], want[2:]))


# Sequences per batch up to which the Triton builder runs: its first kernel compares every pair of sequences.
TRITON_MAX_BATCH = 16384


def _triton_builds(offsets: torch.Tensor, order: str) -> bool:
    if order == "item" or not 1 < offsets.numel() <= TRITON_MAX_BATCH + 1:
        return False
    return offsets.is_cuda or (offsets.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _build_triton(q_offsets, k_offsets, total, block, over, causal, window, order, block_size, bucket,
                  splits) -> torch.Tensor:
    from gemzoo_jfa.schedule_kernels import _schedule_items, _sequence_starts

    batch = q_offsets.numel() - 1
    cap = capacity(total, batch, block, bucket)
    items = torch.empty((3 if splits else 2, cap * max(splits, 1)), device=q_offsets.device, dtype=torch.int32)
    if cap == 0:
        return items
    starts = torch.empty((2, batch), device=q_offsets.device, dtype=torch.int32)
    lo_len, hi_len = (bucket[0], bucket[1] or 0) if bucket is not None else (0, 0)
    flags = dict(BLOCK=block, OVER_Q=over == "q", BUCKET=bucket is not None,
                 HAS_HI=bucket is not None and bucket[1] is not None)
    tile_b = 32
    _sequence_starts[(-(-batch // tile_b),)](q_offsets, k_offsets, starts, batch, lo_len, hi_len,
                                             LPT=order == "lpt", TILE_B=tile_b, TILE_J=128, **flags)
    tile = 32
    _schedule_items[(-(-cap // tile),)](
        q_offsets, k_offsets, starts, items, batch, cap, batch.bit_length(), lo_len, hi_len, window or 0,
        block_size or 1, splits, CAUSAL=causal, WINDOWED=window is not None, BLOCKED=block_size is not None,
        LPT=order == "lpt", SPLIT=splits > 0, TILE=tile, TILE_R=64, **flags)
    return items


def build_schedule_torch(q_offsets, k_offsets, total, block, over, causal, window, order, block_size, bucket,
                         splits=0) -> torch.Tensor:
    """``build_schedule`` in torch operators (about 40 launches on a GPU): the reference the Triton builder is
    tested against, and the builder for the ``item`` order and for larger batches."""
    items = _build(q_offsets, k_offsets, total, block, over, causal, window, order, block_size, bucket)
    return split_items(items, splits) if splits else items


def _build(q_offsets, k_offsets, total, block, over, causal, window, order, block_size, bucket) -> torch.Tensor:
    lq = q_offsets[1:] - q_offsets[:-1]
    lk = k_offsets[1:] - k_offsets[:-1]
    lengths = lq if over == "q" else lk
    batch = lengths.numel()
    cap = capacity(total, batch, block, bucket)
    nblk = (lengths + block - 1) // block
    if bucket is not None:  # sequences outside the bucket get no items
        longer = torch.maximum(lq, lk)
        inside = longer > bucket[0]
        if bucket[1] is not None:
            inside = inside & (longer <= bucket[1])
        nblk = torch.where(inside, nblk, 0)
    ends = torch.cumsum(nblk, 0)
    slot = torch.arange(cap, device=lengths.device, dtype=ends.dtype)
    seq = torch.searchsorted(ends, slot, right=True)
    valid = seq < batch
    seq_c = seq.clamp(max=max(batch - 1, 0))
    blk = slot - (ends[seq_c] - nblk[seq_c])
    lq_s, lk_s = lq[seq_c], lk[seq_c]
    shift = lk_s - lq_s
    first = blk * block
    if over == "q":  # keys visited by queries [first, last]
        last = torch.minimum(first + block, lq_s) - 1
        hi = torch.minimum(lk_s, last + shift + 1) if causal else lk_s
        lo = (first + shift - window + 1).clamp_min(0) if window is not None else torch.zeros_like(hi)
        if block_size is not None:  # floor division: positions may be negative when Lq > Lk
            lo = torch.maximum(lo, torch.div(first + shift, block_size, rounding_mode="floor") * block_size)
            hi = torch.minimum(hi, (torch.div(last + shift, block_size, rounding_mode="floor") + 1) * block_size)
    else:  # queries that see keys [first, last]
        last = torch.minimum(first + block, lk_s) - 1
        lo = (first - shift).clamp_min(0) if causal else torch.zeros_like(first)
        hi = torch.minimum(lq_s, last - shift + window) if window is not None else lq_s
        if block_size is not None:
            lo = torch.maximum(lo, (first // block_size) * block_size - shift)
            hi = torch.minimum(hi, (last // block_size + 1) * block_size - shift)
    cost = torch.where(valid, (hi - lo).clamp_min(0) + block, -1)
    items = torch.stack([torch.where(valid, seq, -1), blk])
    if order in ("lpt", "item"):
        perm = torch.sort(cost, descending=True, stable=True).indices
        if order == "lpt":  # then group by sequence, longest sequence first (stable: keeps cost order inside)
            seq_key = torch.where(valid, (lq_s + lk_s) * (batch + 1) + seq_c, -1)[perm]
            perm = perm[torch.sort(seq_key, descending=True, stable=True).indices]
        items = items[:, perm]
    return items.to(torch.int32).contiguous()


def split_items(items: torch.Tensor, n_splits: int) -> torch.Tensor:
    """int32 [3, cap * n_splits]: every item of a query-block schedule ``items`` [2, cap] repeated once per
    key split 0..n_splits-1 (third row), in the same (costliest-first) order. Sync-free: the kernel cuts each
    sequence's keys into n_splits chunks of ceil(Lk / n_splits) rounded up to its key block, and a split
    whose chunk holds no allowed key exits at once."""
    seq_blk = items.repeat_interleave(n_splits, dim=1)
    split = torch.arange(n_splits, device=items.device, dtype=items.dtype).repeat(items.shape[1])
    return torch.cat([seq_blk, split.unsqueeze(0)]).contiguous()
