"""Triton kernels that build a work schedule (see ``schedule.py``) in two launches instead of ~40 torch ops.

The torch builder sorts: every item by cost, then by its sequence's length. These kernels compute each item's
final slot directly, as a rank, so they need no sort and no host sync. All index arithmetic is int32 (lengths
and slots fit; int64 division is slow on GPUs).

1. ``_sequence_starts`` (one program per ``TILE_B`` sequences): for sequence i, the end of its items in the
   natural layout (the inclusive cumsum of item counts) and, for the ``lpt`` order, the first slot of its
   items (the item counts of the sequences that sort before it: longer, or as long with a higher index).
   Each program compares its sequences with all B, so the work is O(B^2) and the launcher keeps B bounded.
2. ``_schedule_items`` (one program per ``TILE`` slots of the natural layout; ranking a slot costs O(items of
   its sequence), so the tile is small and many programs share a long sequence): a binary search over the ends
   finds each slot's (sequence, block); its rank among its sequence's items (costlier first, ties by block
   index) plus the sequence's first slot is where it goes. Slots past the real item count keep their place
   with sequence -1. With ``splits`` > 0 every item is written once per key split (a third row).

The result equals the torch builder's, item for item (the plugin's tests compare them under the interpreter).
Item costs follow ``schedule._build``: keys (queries) visited by a query (key) block, plus one block.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _floor_div(a, b):
    """floor(a / b) for b > 0, whichever way the backend's integer division rounds negative quotients."""
    q = a // b
    return tl.where(a - q * b < 0, q - 1, q)


@triton.jit
def _sequence_blocks(q_off, k_off, seq, mask, lo_len, hi_len, BLOCK: tl.constexpr, OVER_Q: tl.constexpr,
                     BUCKET: tl.constexpr, HAS_HI: tl.constexpr):
    """(Lq, Lk, item count), int32, of sequences ``seq``; masked or out-of-bucket sequences have no items."""
    lq = (tl.load(q_off + seq + 1, mask=mask, other=0) - tl.load(q_off + seq, mask=mask, other=0)).to(tl.int32)
    lk = (tl.load(k_off + seq + 1, mask=mask, other=0) - tl.load(k_off + seq, mask=mask, other=0)).to(tl.int32)
    if OVER_Q:
        n = (lq + BLOCK - 1) // BLOCK
    else:
        n = (lk + BLOCK - 1) // BLOCK
    if BUCKET:
        longer = tl.maximum(lq, lk)
        inside = longer > lo_len
        if HAS_HI:
            inside = inside & (longer <= hi_len)
        n = tl.where(inside, n, 0)
    return lq, lk, tl.where(mask, n, 0)


@triton.jit
def _item_cost(blk, lq, lk, window, block_size, BLOCK: tl.constexpr, OVER_Q: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOWED: tl.constexpr, BLOCKED: tl.constexpr):
    """Keys (over queries) or queries (over keys) visited by block ``blk`` of a sequence, plus one block."""
    shift = lk - lq
    first = blk * BLOCK
    if OVER_Q:
        last = tl.minimum(first + BLOCK, lq) - 1
        if CAUSAL:
            hi = tl.minimum(lk, last + shift + 1)
        else:
            hi = lk + first * 0
        if WINDOWED:
            lo = tl.maximum(first + shift - window + 1, 0)
        else:
            lo = hi * 0
        if BLOCKED:
            lo = tl.maximum(lo, _floor_div(first + shift, block_size) * block_size)
            hi = tl.minimum(hi, (_floor_div(last + shift, block_size) + 1) * block_size)
    else:
        last = tl.minimum(first + BLOCK, lk) - 1
        if CAUSAL:
            lo = tl.maximum(first - shift, 0)
        else:
            lo = first * 0
        if WINDOWED:
            hi = tl.minimum(lq, last - shift + window)
        else:
            hi = lq + first * 0
        if BLOCKED:
            lo = tl.maximum(lo, (first // block_size) * block_size - shift)
            hi = tl.minimum(hi, (last // block_size + 1) * block_size - shift)
    return tl.maximum(hi - lo, 0) + BLOCK


@triton.jit
def _sequence_starts(q_off, k_off, starts, batch, lo_len, hi_len, BLOCK: tl.constexpr, OVER_Q: tl.constexpr,
                     BUCKET: tl.constexpr, HAS_HI: tl.constexpr, LPT: tl.constexpr, TILE_B: tl.constexpr,
                     TILE_J: tl.constexpr):
    """starts[0, i]: end of sequence i's items in the natural layout; starts[1, i]: its first slot in lpt order
    (sequences sort by Lq + Lk, then by index, both descending)."""
    i = tl.program_id(0) * TILE_B + tl.arange(0, TILE_B)
    mi = i < batch
    lq_i, lk_i, n_i = _sequence_blocks(q_off, k_off, i, mi, lo_len, hi_len, BLOCK, OVER_Q, BUCKET, HAS_HI)
    len_i = (lq_i + lk_i)[:, None]
    end = n_i
    first = n_i * 0
    for j0 in range(0, batch, TILE_J):
        j = j0 + tl.arange(0, TILE_J)
        lq_j, lk_j, n_j = _sequence_blocks(q_off, k_off, j, j < batch, lo_len, hi_len, BLOCK, OVER_Q, BUCKET,
                                           HAS_HI)
        end += tl.sum(tl.where(j[None, :] < i[:, None], n_j[None, :], 0), axis=1)
        if LPT:
            len_j = (lq_j + lk_j)[None, :]
            ahead = (len_j > len_i) | ((len_j == len_i) & (j[None, :] > i[:, None]))
            first += tl.sum(tl.where(ahead, n_j[None, :], 0), axis=1)
    tl.store(starts + i, end, mask=mi)
    tl.store(starts + batch + i, first, mask=mi)


@triton.jit
def _schedule_items(q_off, k_off, starts, items, batch, cap, search_steps, lo_len, hi_len, window, block_size,
                    splits, BLOCK: tl.constexpr, OVER_Q: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOWED: tl.constexpr, BLOCKED: tl.constexpr, BUCKET: tl.constexpr, HAS_HI: tl.constexpr,
                    LPT: tl.constexpr, SPLIT: tl.constexpr, TILE: tl.constexpr, TILE_R: tl.constexpr):
    """Writes the items of natural slots [pid * TILE, (pid + 1) * TILE) at their final slots."""
    t = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mt = t < cap
    lo = t * 0  # the sequence of slot t: the number of sequences whose items end at or before t
    hi = lo + batch
    for _ in range(search_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(starts + mid, mask=active & mt, other=0)
        lo = tl.where(active & (end <= t), mid + 1, lo)
        hi = tl.where(active & (end > t), mid, hi)
    valid = mt & (lo < batch)
    seq = tl.minimum(lo, batch - 1)
    lq, lk, n = _sequence_blocks(q_off, k_off, seq, valid, lo_len, hi_len, BLOCK, OVER_Q, BUCKET, HAS_HI)
    blk = t - (tl.load(starts + seq, mask=valid, other=0) - n)
    slot = t
    if LPT:  # costlier items of the sequence first, ties by block index
        cost = _item_cost(blk, lq, lk, window, block_size, BLOCK, OVER_Q, CAUSAL, WINDOWED, BLOCKED)
        rank = n * 0
        for b0 in range(0, tl.max(n, axis=0), TILE_R):
            other = b0 + tl.arange(0, TILE_R)[None, :]
            c = _item_cost(other, lq[:, None], lk[:, None], window, block_size, BLOCK, OVER_Q, CAUSAL, WINDOWED,
                           BLOCKED)
            ahead = (c > cost[:, None]) | ((c == cost[:, None]) & (other < blk[:, None]))
            rank += tl.sum(tl.where(ahead & (other < n[:, None]), 1, 0), axis=1)
        first = tl.load(starts + batch + seq, mask=valid, other=0)
        slot = tl.where(valid, first + rank, slot)
    seq_out = tl.where(valid, seq, -1)
    blk_out = tl.where(valid, blk, 0)
    if SPLIT:
        width = cap * splits
        for s in range(splits):
            at = slot * splits + s
            tl.store(items + at, seq_out, mask=mt)
            tl.store(items + width + at, blk_out, mask=mt)
            tl.store(items + 2 * width + at, blk_out * 0 + s, mask=mt)
    else:
        tl.store(items + slot, seq_out, mask=mt)
        tl.store(items + cap + slot, blk_out, mask=mt)
