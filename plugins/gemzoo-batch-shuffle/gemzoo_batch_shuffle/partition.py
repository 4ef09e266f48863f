"""Multi-way number partitioning of per-sample costs: which data-parallel rank trains which sample.

``partition(costs, world_size, equal_count=..., method=...)`` returns ``world_size`` lists of sample indices,
each sample in exactly one, as a pure function of its inputs (every rank computes it and all must agree):

- ``lpt``: longest processing time first: by decreasing cost, each sample to the least-loaded rank (with
  ``equal_count``, to the least-loaded rank that is not full). ``O(N log W)``; on ``BLOCK_LPT_MIN_W`` ranks
  or more, in blocks of W // 4 samples (numpy), so it scales to 8192 ranks.
- ``kk``: Karmarkar–Karp's largest differencing method for k-way partitioning. Every sample starts as a
  partition of its own (``[c, 0, ..., 0]``); the two partitions with the largest spread (max - min subset
  sum) are merged, the heaviest subset of one with the lightest of the other, until one is left. Free counts.
- ``bldm``: the balanced variant: the samples, sorted by decreasing cost, are cut into rounds of ``W``, each
  round a partition with one sample per subset, merged as above; every rank gets floor(N/W) or ceil(N/W).
- ``auto``: LPT, and while ``N * W <= KK_LIMIT`` also kk (bldm with ``equal_count``); the better one is kept.
- then a local search (``refine``): while it lowers the heaviest rank and that rank is more than
  ``REFINE_TOL`` (1e-4) above the mean, move one sample from the heaviest to the lightest rank (free counts
  only) or swap one pair between them, the exchange that best halves their gap; not at all where its
  ``REFINE_STEPS`` steps cannot lower the heaviest rank by more than that (many ranks just above the mean).
- finally (``keep_local``) subsets are matched to ranks so that as many samples as possible stay on the rank
  that loaded them (rank r loaded the contiguous part ``shard_range(N, r, W)``): fewer bytes in the
  all-to-all; when the loaded parts are already as balanced as the partition, nothing moves at all.

Ties are broken by index everywhere (stable sorts, a counter in the heap), so the answer does not depend on
anything but ``costs`` and ``world_size``.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from gemzoo.errors import PluginError

KK_LIMIT = 1 << 16  # N * W above which method "auto" uses the balanced variant (kk merges N partitions of W lists)
REFINE_STEPS = 1024  # moves/swaps at most after the partition
# the local search stops once the heaviest rank is within this of the mean: what it would still save is below
# timing noise. With gem-bench's cost model it stops there by itself (same groups and times, 2026-12-02, 64 to
# 8192 ranks); on costs ~ L^2 + 1e4 L at 512 ranks it ran all 1024 steps, 57 of 108 ms, for 1.00021 -> 1.00003
REFINE_TOL = 1e-4
BLOCK_LPT_MIN_W = 256  # free counts on this many ranks or more: LPT in blocks (numpy) instead of the heap
METHODS = ("auto", "kk", "bldm", "lpt")


def check_costs(costs, world_size: int) -> np.ndarray:
    """float64 numpy costs; a PluginError naming the bad samples (NaN, infinite, negative) or the bad world."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PluginError(f"base-batch-shuffle: world_size must be an int >= 1, got {world_size!r}")
    c = torch.as_tensor(costs).detach().to("cpu", torch.float64)
    if c.dim() != 1:
        raise PluginError(f"base-batch-shuffle: costs must be 1-D (one number per sample), got shape "
                          f"{tuple(c.shape)}")
    c = c.numpy()
    bad = np.flatnonzero(~np.isfinite(c) | (c < 0))
    if bad.size:
        raise PluginError(f"base-batch-shuffle: samples {bad[:5].tolist()} have costs {c[bad[:5]].tolist()}; "
                          "per-sample costs must be finite and >= 0 (check the model's cost_model)")
    return c


def _decreasing(c: np.ndarray) -> np.ndarray:
    """The samples by decreasing cost, ties by index: ``np.argsort(-c, kind="stable")``. Costs repeat (they
    follow the lengths), so with at most 2**15 distinct values it sorts their 16-bit ranks instead (numpy
    radix-sorts those: ~2x faster at 524,288 samples), which gives the same order."""
    values, inverse = np.unique(c, return_inverse=True)
    if values.size <= 1 << 15:
        return np.argsort((values.size - 1 - inverse).astype(np.int16), kind="stable")
    return np.argsort(-c, kind="stable")


def _merge(a, b):
    """Merge two partitions (sums sorted descending, members aligned): a's heaviest with b's lightest."""
    sums = a[0] + b[0][::-1]
    members = [x + y for x, y in zip(a[1], reversed(b[1]))]
    order = np.argsort(-sums, kind="stable")
    return sums[order], [members[i] for i in order]


def _differencing(parts) -> list[list[int]]:
    """Largest differencing: merge the two partitions of largest spread until one is left."""
    heap = [(-(s[0] - s[-1]), k, (s, m)) for k, (s, m) in enumerate(parts)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        s, m = _merge(a, b)
        heapq.heappush(heap, (-(s[0] - s[-1]), counter, (s, m)))
        counter += 1
    return heap[0][2][1]


def _kk(c: np.ndarray, w: int) -> list[list[int]]:
    parts = []
    for i in _decreasing(c).tolist():
        s = np.zeros(w)
        s[0] = c[i]
        parts.append((s, [[i]] + [[] for _ in range(w - 1)]))
    return _differencing(parts)


def _bldm(c: np.ndarray, w: int) -> list[list[int]]:
    order = _decreasing(c)
    n = order.size
    rounds = -(-n // w)
    idx = np.full(rounds * w, -1, dtype=np.int64)
    idx[:n] = order
    idx = idx.reshape(rounds, w)
    cost = np.where(idx >= 0, c[np.maximum(idx, 0)], 0.0)
    # the balanced merge on arrays: members[r] is a [W, k] block of indices (-1 = a padding sample of cost 0)
    heap = [(-(cost[r, 0] - cost[r, -1]), r, cost[r].copy(), idx[r][:, None]) for r in range(rounds)]
    heapq.heapify(heap)
    counter = rounds
    while len(heap) > 1:
        _, _, sa, ma = heapq.heappop(heap)
        _, _, sb, mb = heapq.heappop(heap)
        s = sa + sb[::-1]
        m = np.concatenate([ma, mb[::-1]], axis=1)
        o = np.argsort(-s, kind="stable")
        heapq.heappush(heap, (-(s[o[0]] - s[o[-1]]), counter, s[o], m[o]))
        counter += 1
    members = heap[0][3]
    return [row[row >= 0].tolist() for row in members]


def _lpt(c: np.ndarray, w: int, equal_count: bool) -> list[list[int]]:
    """Longest processing time first: by decreasing cost (ties by index), each sample to the least-loaded rank
    (ties to the lowest rank); with ``equal_count`` a rank that holds ceil(N/W) samples takes no more (and
    once N % W ranks are full, the others stop at floor(N/W))."""
    n = c.size
    if w >= BLOCK_LPT_MIN_W:
        return _block_lpt(c, w, equal_count)
    order = _decreasing(c).tolist()
    cost = c.tolist()
    heap = [(0.0, r) for r in range(w)]
    groups: list[list[int]] = [[] for _ in range(w)]
    base, extra = divmod(n, w)
    full_big = 0
    for i in order:
        load, r = heap[0]
        g = groups[r]
        g.append(i)
        cap = base + 1 if full_big < extra else base
        if equal_count and len(g) >= cap:
            heapq.heappop(heap)
            if cap == base + 1:
                full_big += 1
                if full_big == extra:  # the ranks still open now stop at floor(N/W): drop those already there
                    heap = [(l, q) for l, q in heap if len(groups[q]) < base]
                    heapq.heapify(heap)
        else:
            heapq.heapreplace(heap, (load + cost[i], r))
    return groups


def _block_lpt(c: np.ndarray, w: int, equal_count: bool = False) -> list[np.ndarray]:
    """LPT in blocks, for many ranks: the W largest samples one to each rank, then blocks of W // 4 samples (by
    decreasing cost) to the W // 4 least-loaded ranks, the largest to the lightest. With ``equal_count`` only
    ranks holding fewer than floor(N/W) samples take part, and the N % W smallest samples go last, one each to
    the N % W lightest ranks. Within 1e-4 of the heap's LPT at 8192 ranks on gem-lognormal, uniform-8k and
    zipf (with free and equal counts), and numpy-fast (the heap's per-sample loop takes seconds there)."""
    order = _decreasing(c)
    n = c.size
    loads = np.zeros(w)
    owner = np.empty(n, dtype=np.int64)
    base, extra = divmod(n, w) if equal_count else (n, 0)
    counts = np.zeros(w, dtype=np.int64)
    eligible = loads
    start, block, body = 0, max(1, w // 4), n - extra
    while start < body:
        k = min(w if start == 0 else block, body - start)
        if equal_count:
            eligible = np.where(counts < base, loads, np.inf)
            k = min(k, int((counts < base).sum()))  # every chosen rank has room: one sample each per block
        chunk = order[start:start + k]
        ranks = _lightest(eligible, k)
        owner[chunk] = ranks
        np.add.at(loads, ranks, c[chunk])
        counts[ranks] += 1
        start += k
    if extra:  # equal counts: the smallest N % W samples, one to each of the lightest N % W ranks
        chunk = order[start:]
        ranks = _lightest(loads, extra)
        owner[chunk] = ranks
        np.add.at(loads, ranks, c[chunk])
    return _by_owner(order, owner[order], w)


def _group_by_rank(owner: np.ndarray, w: int) -> np.ndarray:
    """``np.argsort(owner, kind="stable")`` for ranks 0..w-1: numpy radix-sorts 16-bit keys (7x faster than the
    int64 merge sort at 524,288 samples), so the keys go to int16 where every rank fits."""
    return np.argsort(owner.astype(np.int16) if w <= np.iinfo(np.int16).max + 1 else owner, kind="stable")


def _by_owner(placed: np.ndarray, owner: np.ndarray, w: int) -> list[np.ndarray]:
    """Rank r's members, in the order they were placed: ``placed`` (sample indices in placement order) split by
    ``owner`` (the rank each went to) with one stable sort."""
    by_rank = _group_by_rank(owner, w)
    counts = np.bincount(owner, minlength=w)
    return np.split(placed[by_rank], np.cumsum(counts)[:-1])


def _loads(c: np.ndarray, groups) -> np.ndarray:
    """Each rank's summed cost (one bincount over all members)."""
    sizes = [len(g) for g in groups]
    if not sum(sizes):
        return np.zeros(len(groups))
    members = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
    return np.bincount(np.repeat(np.arange(len(groups)), sizes), weights=c[members], minlength=len(groups))


def _lightest(loads: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` least-loaded ranks, lightest first, ties by rank: ``np.argsort(loads, kind="stable")[:k]``
    without sorting all of them (a partial selection, then a sort of the ``k``)."""
    if k >= loads.size:
        return np.argsort(loads, kind="stable")
    v = loads[np.argpartition(loads, k - 1)[:k]].max()  # the k-th smallest load
    less = np.flatnonzero(loads < v)
    chosen = np.concatenate([less, np.flatnonzero(loads == v)[:k - less.size]])
    chosen.sort()
    return chosen[np.argsort(loads[chosen], kind="stable")]


def _refine(c: np.ndarray, groups, equal_count: bool, max_steps: int, tol: float = REFINE_TOL) -> list[np.ndarray]:
    """Move or swap one sample between the heaviest and the lightest rank while that lowers the heaviest and
    the heaviest is more than ``tol`` above the mean."""
    w = len(groups)
    if w < 2:
        return groups
    arrs = [np.asarray(g, dtype=np.int64) for g in groups]
    loads = _loads(c, arrs)
    enough = loads.mean() * (1 + tol)  # moves keep the total, so the mean
    if w > max_steps + 1:
        # each step lowers one rank, so the ranks it never lowers keep at least their load: the heaviest cannot
        # end below the (max_steps + 1)-th heaviest load. Where that saves at most tol of the mean, skip the
        # search (8192 ranks: thousands of ranks just above the mean, 1024 steps for ~1e-5, ~50 ms)
        floor = np.partition(loads, w - max_steps - 1)[w - max_steps - 1]
        if loads.max() - max(floor, enough) <= loads.mean() * tol:
            return arrs
    for _ in range(max_steps):
        h, l = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[h] - loads[l]
        if gap <= 0 or loads[h] <= enough:
            break
        ch, cl = c[arrs[h]], c[arrs[l]]
        best, best_move = loads[h], None  # (new max of the pair), (i in h or -1, j in l or -1)
        if not equal_count and ch.size > 1:
            i = int(np.argmin(np.abs(ch - gap / 2)))
            new = max(loads[h] - ch[i], loads[l] + ch[i])
            if 0 < ch[i] < gap and new < best:
                best, best_move = new, (i, -1)
        if ch.size and cl.size:
            ol = np.argsort(cl, kind="stable")
            sl = cl[ol]
            want = ch - gap / 2  # the cost y that makes the swap halve the gap
            pos = np.clip(np.searchsorted(sl, want), 0, sl.size - 1)
            for cand in (pos, np.maximum(pos - 1, 0)):
                d = ch - sl[cand]
                new = np.maximum(loads[h] - d, loads[l] + d)
                ok = (d > 0) & (d < gap)
                if ok.any():
                    i = int(np.argmin(np.where(ok, new, np.inf)))
                    if new[i] < best:
                        best, best_move = new[i], (i, int(ol[cand[i]]))
        if best_move is None:
            break
        i, j = best_move
        x = arrs[h][i]
        moved_in = [x]
        arrs[h] = np.delete(arrs[h], i)
        delta = c[x]
        if j >= 0:
            y = arrs[l][j]
            arrs[l] = np.delete(arrs[l], j)
            arrs[h] = np.append(arrs[h], y)
            delta -= c[y]
        arrs[l] = np.append(arrs[l], moved_in)
        loads[h] -= delta
        loads[l] += delta
    return arrs


def _fill_empty(c: np.ndarray, groups) -> list[np.ndarray]:
    """Free counts with N >= W: no rank is left without samples (its loss would be a mean over nothing);
    an empty rank takes the cheapest sample of the rank with the most samples (ties: the lowest index)."""
    groups = [np.asarray(g, dtype=np.int64) for g in groups]
    for r in range(len(groups)):
        if not groups[r].size:
            donor = max(range(len(groups)), key=lambda k: (groups[k].size, -k))
            if groups[donor].size < 2:
                break
            g = groups[donor]
            j = int(np.lexsort((g, c[g]))[0])
            groups[r] = g[j:j + 1]
            groups[donor] = np.delete(g, j)
    return groups


def _keep_local(groups, n: int, w: int) -> list:
    """Give each subset to a rank so that the most samples stay where they were loaded (greedy matching on
    the overlap counts, largest first, ties by subset then rank)."""
    base, extra = divmod(n, w)
    subset_of = np.empty(n, dtype=np.int64)
    subset_of[np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])] = np.repeat(
        np.arange(w), [len(g) for g in groups])
    by_subset = _group_by_rank(subset_of, w)  # stable: by subset, then by index, so by loading rank too
    big = extra * (base + 1)  # rank r loaded shard_range(N, r, W): the first N % W ranks one sample more
    loader = np.where(by_subset < big, by_subset // (base + 1), extra + (by_subset - big) // max(base, 1))
    pair = subset_of[by_subset] * w + loader  # sorted, so the distinct (subset, rank) pairs are its runs
    cut = np.flatnonzero(np.diff(pair)) + 1
    first = np.concatenate([[0], cut])
    keys, counts = pair[first], np.diff(np.concatenate([first, [n]]))
    rank_of = [-1] * w  # plain lists: the greedy loops below index them once per pair
    taken = [False] * w
    shared = counts >= 2
    ranked = np.lexsort((keys[shared], -counts[shared]))  # most shared samples first, ties by (subset, rank)
    for s, r in zip((keys[shared][ranked] // w).tolist(), (keys[shared][ranked] % w).tolist()):
        if rank_of[s] < 0 and not taken[r]:
            rank_of[s], taken[r] = r, True
    # then the pairs sharing one sample, in (subset, rank) order: each open subset its first free rank (the
    # pairs of subsets or ranks matched above dropped first: the loop then skips only ranks it takes itself)
    single = keys[~shared]
    single = single[(np.array(rank_of)[single // w] < 0) & ~np.array(taken)[single % w]]
    cuts = np.searchsorted(single // w, np.arange(w + 1)).tolist()
    ranks = (single % w).tolist()
    for s in range(w):
        if rank_of[s] < 0:
            for r in ranks[cuts[s]:cuts[s + 1]]:
                if not taken[r]:
                    rank_of[s], taken[r] = r, True
                    break
    out = [None] * w
    rest = iter([r for r in range(w) if not taken[r]])
    for s in range(w):
        out[rank_of[s] if rank_of[s] >= 0 else next(rest)] = groups[s]
    return out


def partition(costs, world_size: int, *, equal_count: bool = False, method: str = "auto", refine: bool = True,
              keep_local: bool = True) -> list[torch.Tensor]:
    """``world_size`` int64 tensors of sample indices (each in increasing order), every sample in one."""
    if method not in METHODS:
        raise PluginError(f"base-batch-shuffle: method must be one of {', '.join(METHODS)}, got {method!r}")
    c = check_costs(costs, world_size)
    n, w = c.size, world_size
    if w == 1 or n == 0:
        return [torch.arange(n, dtype=torch.int64)] + [torch.zeros(0, dtype=torch.int64)] * (w - 1)
    if method == "kk" and equal_count:
        raise PluginError("base-batch-shuffle: method \"kk\" gives free counts; with equal_count = true use "
                          "method \"bldm\", \"lpt\" or \"auto\"")
    differencing = _bldm if equal_count else _kk
    if method == "auto":  # the better of differencing and LPT while differencing is cheap, else LPT
        tries = [_lpt(c, w, equal_count)] + ([differencing(c, w)] if n * w <= KK_LIMIT else [])
    else:
        tries = [{"kk": _kk, "bldm": _bldm}[method](c, w) if method != "lpt" else _lpt(c, w, equal_count)]
    if refine:
        tries = [_refine(c, g, equal_count, max_steps=REFINE_STEPS) for g in tries]
    peaks = [_loads(c, g).max() for g in tries]
    peak = min(peaks)
    groups = tries[peaks.index(peak)]  # first of the best on ties
    if not equal_count and n >= w and any(len(g) == 0 for g in groups):
        groups = _fill_empty(c, groups)
        peak = _loads(c, groups).max()
    if keep_local:
        # what rank r loaded: shard_range, the first N % W ranks one sample more (summed in index order, as _loads)
        sizes = np.full(w, n // w) + (np.arange(w) < n % w)
        if np.bincount(np.repeat(np.arange(w), sizes), weights=c, minlength=w).max() <= peak:
            groups = np.split(np.arange(n), np.cumsum(sizes)[:-1])  # already as balanced: nothing moves
        else:
            groups = _keep_local(groups, n, w)
    # each rank's indices in increasing order: one stable sort of the owners, then views of it
    owner = np.empty(n, dtype=np.int64)
    sizes = [len(g) for g in groups]
    owner[np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])] = np.repeat(np.arange(w), sizes)
    return list(torch.from_numpy(_group_by_rank(owner, w)).split(sizes))


def imbalance(costs, groups) -> float:
    """max / mean of the ranks' summed costs (1.0: perfectly balanced; the slowest rank sets the step)."""
    c = torch.as_tensor(costs, dtype=torch.float64)
    loads = torch.stack([c[g.long()].sum() if len(g) else torch.zeros((), dtype=torch.float64) for g in groups])
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


__all__ = ["KK_LIMIT", "METHODS", "REFINE_STEPS", "REFINE_TOL", "check_costs", "imbalance", "partition"]
