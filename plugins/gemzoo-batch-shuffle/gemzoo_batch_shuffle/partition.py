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
  On ``BLOCK_LPT_MIN_W`` ranks or more, ``REFINE_PAIRS`` such pairs (the heaviest with the lightest, the
  second heaviest with the second lightest, ...) at a time, in numpy (``_refine_pairs``).
- finally (``keep_local``) subsets are matched to ranks so that as many samples as possible stay on the rank
  that loaded them (rank r loaded the contiguous part ``shard_range(N, r, W)``): fewer bytes in the
  all-to-all; when the loaded parts are already as balanced as the partition, nothing moves at all.

On ``BLOCK_LPT_MIN_W`` ranks or more the assignment is one array, the subset of each sample, from the LPT to
the result (no per-rank lists: at 8192 ranks splitting and joining them cost more than the LPT).

Ties are broken by index or position everywhere (stable sorts or sorts of distinct keys, a counter in the
heap; the block LPT's equal loads by how long the rank has gone without a sample), so the answer does not
depend on anything but ``costs`` and ``world_size`` (nor on which sort algorithm numpy picks on a CPU).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from gemzoo.api import PluginError

KK_LIMIT = 1 << 16  # N * W above which method "auto" uses the balanced variant (kk merges N partitions of W lists)
REFINE_STEPS = 1024  # moves/swaps at most after the partition
# the local search stops once the heaviest rank is within this of the mean: what it would still save is below
# timing noise. With gem-bench's cost model it stops there by itself (same groups and times, 2026-12-02, 64 to
# 8192 ranks); on costs ~ L^2 + 1e4 L at 512 ranks it ran all 1024 steps, 57 of 108 ms, for 1.00021 -> 1.00003
REFINE_TOL = 1e-4
BLOCK_LPT_MIN_W = 256  # free counts on this many ranks or more: LPT in blocks (numpy) instead of the heap
BLOCK_DIV = 4  # the block LPT's blocks: W // BLOCK_DIV samples to as many least-loaded ranks
METHODS = ("auto", "kk", "bldm", "lpt")
REFINE_PAIRS = 128  # the refine on many ranks: pairs of ranks searched at once
FIRST_FREE_CHUNK = 64  # keep_local's single-sample matching: subsets whose first free ranks are found at once


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
    """The samples by decreasing cost, ties by index: ``np.argsort(-c, kind="stable")``."""
    return _decreasing_costs(c)[0]


def _decreasing_costs(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the samples by decreasing cost, ties by index, and their costs in that order), the order exactly
    ``np.argsort(-c, kind="stable")``'s. One plain sort of distinct int64 keys: a cost's bits (a float >= 0
    orders as its bit pattern) less the low ``b`` bits, ``2**b >= N``, complemented (larger first), then the
    index. Distinct keys sort the same with any algorithm, so numpy's vectorised sort is safe (~3x faster than
    the stable sort of the costs' 16-bit ranks at 524,288 samples); where two different costs agree in all
    but those low bits (relative 2**(b-52): 1e-10 at 524,288 samples) it falls back to the stable sort."""
    c = np.asarray(c, dtype=np.float64)
    n = c.size
    b = max(1, (n - 1).bit_length())
    if b > 32:
        order = np.argsort(-c, kind="stable")
        return order, c[order]
    hi = (c + 0.0).view(np.int64) >> b  # + 0.0: -0.0 (allowed: not < 0) sorts as 0.0; hi < 2**(63 - b)
    key = (((1 << (63 - b)) - 1 - hi) << b) | np.arange(n)
    key.sort()
    order = key & ((1 << b) - 1)
    cs = c[order]
    hi = key >> b
    if ((hi[1:] == hi[:-1]) & (cs[1:] != cs[:-1])).any():  # two costs told apart only by the bits dropped
        order = np.argsort(-c, kind="stable")
        return order, c[order]
    return order, cs


def _merge(a, b):
    """Merge two partitions (sums sorted descending, members aligned): a's heaviest with b's lightest."""
    sums = a[0] + b[0][::-1]
    members = [x + y for x, y in zip(a[1], reversed(b[1]), strict=False)]
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
    """``_block_owner``'s partition as each rank's members in the order they were placed."""
    order, placed = _block_owner(c, w, equal_count)
    return _by_owner(order, placed, w)


def _block_owner(c: np.ndarray, w: int, equal_count: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """LPT in blocks, for many ranks: the W largest samples one to each rank, then blocks of W // 4 samples (by
    decreasing cost) to the W // 4 least-loaded ranks, the largest to the lightest. With ``equal_count`` only
    ranks holding fewer than floor(N/W) samples take part, and the N % W smallest samples go last, one each to
    the N % W lightest ranks. Within 1e-4 of the heap's LPT at 8192 ranks on gem-lognormal, uniform-8k and
    zipf (with free and equal counts), and numpy-fast (the heap's per-sample loop takes seconds there).

    Returns (the samples in placement order, the rank each went to): one array each, no per-rank lists. The
    ranks that take part are kept sorted by load (``ld``, ``rk``; ties: the longer-untouched first, then the
    block's order); a block takes the first ``k``, and their new loads are merged back with one stable sort
    (the untouched rest is one sorted run, so the sort is mostly a merge): no selection over all W loads."""
    order, cs = _decreasing_costs(c)
    n = c.size
    placed = np.empty(n, dtype=np.int64)  # placed[j]: the rank of order[j]
    base, extra = divmod(n, w) if equal_count else (n, 0)
    loads = np.zeros(w)
    counts = np.zeros(w, dtype=np.int64)
    rk, ld = np.arange(w), np.zeros(w)  # the open ranks by increasing load
    start, block, body = 0, max(1, w // BLOCK_DIV), n - extra
    while start < body:
        k = min(w if start == 0 else block, body - start, rk.size)
        ranks = rk[:k]
        placed[start:start + k] = ranks
        new = ld[:k] + cs[start:start + k]
        if equal_count:  # full ranks (floor(N/W) samples) leave the open list
            loads[ranks] = new
            counts[ranks] += 1
            room = counts[ranks] < base
            ranks, new = ranks[room], new[room]
        merged = np.concatenate((ld[k:], new))
        by_load = np.argsort(merged, kind="stable")
        ld, rk = merged[by_load], np.concatenate((rk[k:], ranks))[by_load]
        start += k
    if extra:  # equal counts: the smallest N % W samples, one to each of the lightest N % W ranks
        placed[start:] = _lightest(loads, extra)
    return order, placed


def _group_by_rank(owner: np.ndarray, w: int) -> np.ndarray:
    """``np.argsort(owner, kind="stable")`` for ranks 0..w-1, as one plain sort of distinct int64 keys (the rank,
    then the index: any sort gives the stable order; ~1.3x numpy's radix sort of 16-bit keys at 524,288
    samples, and 6x the int32 merge sort)."""
    n = owner.size
    b = max(1, (n - 1).bit_length())
    if b + max(1, w - 1).bit_length() > 62:
        return np.argsort(owner, kind="stable")
    key = (owner.astype(np.int64) << b) | np.arange(n)
    key.sort()
    return key & ((1 << b) - 1)


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


def _refine_pays(loads: np.ndarray, max_steps: int, tol: float = REFINE_TOL) -> bool:
    """Whether ``_refine`` may lower the heaviest rank by more than ``tol`` of the mean. Each step lowers one
    rank, so the ranks it never lowers keep at least their load: the heaviest cannot end below the
    (max_steps + 1)-th heaviest load. Where that saves at most tol of the mean, the search is skipped (8192
    ranks: thousands of ranks just above the mean, 1024 steps for ~1e-5, ~50 ms)."""
    w = loads.size
    if w <= max_steps + 1:
        return True
    floor = np.partition(loads, w - max_steps - 1)[w - max_steps - 1]
    return loads.max() - max(floor, loads.mean() * (1 + tol)) > loads.mean() * tol


def _refine(c: np.ndarray, groups, equal_count: bool, max_steps: int, tol: float = REFINE_TOL) -> list[np.ndarray]:
    """Move or swap one sample between the heaviest and the lightest rank while that lowers the heaviest and
    the heaviest is more than ``tol`` above the mean."""
    w = len(groups)
    if w < 2:
        return groups
    arrs = [np.asarray(g, dtype=np.int64) for g in groups]
    loads = _loads(c, arrs)
    enough = loads.mean() * (1 + tol)  # moves keep the total, so the mean
    if not _refine_pays(loads, max_steps, tol):
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


def _refine_pairs(c: np.ndarray, owner: np.ndarray, w: int, equal_count: bool, max_steps: int,
                  tol: float = REFINE_TOL) -> np.ndarray:
    """``_refine``'s search for many ranks, on the owner array and REFINE_PAIRS pairs at a time: the heaviest
    ranks (above ``tol`` of the mean) paired with as many lightest (the heaviest with the lightest, and so on),
    and in each pair at once the exchange that best halves its gap, the same choice as ``_refine``'s (every
    swap of a sample of the heavy rank for one of the light, and with free counts every move of one sample
    of the heavy rank to the light), kept where it lowers the pair's heavier rank. Until the heaviest rank is
    within ``tol`` of the mean, its pair finds no exchange, or ``max_steps`` exchanges are made. Each round is
    a few numpy operations on [pairs, members, members] arrays instead of ~20 per exchange."""
    n = owner.size
    loads = np.bincount(owner, weights=c, minlength=w)
    enough = loads.mean() * (1 + tol)
    sizes = np.bincount(owner, minlength=w)
    by = _group_by_rank(owner, w)
    room = int(sizes.max()) + (0 if equal_count else 8)
    if sizes.min() == room:  # every rank as many samples (equal counts, W divides N)
        members = by.reshape(w, room).copy()
    else:
        members = np.full((w, room), -1, dtype=np.int64)  # each rank's samples, -1 past its size
        rank = np.repeat(np.arange(w), sizes)
        members.ravel()[rank * room + np.arange(n) - (np.cumsum(sizes) - sizes)[rank]] = by
    owner = owner.copy()
    cost = np.append(c, np.nan)  # a member -1 costs NaN: never chosen
    steps = 0
    while steps < max_steps:
        by_load = np.argsort(loads, kind="stable")
        m = min(REFINE_PAIRS, w // 2, max_steps - steps)
        heavy, light = by_load[::-1][:m], by_load[:m]
        if loads[heavy[0]] <= enough:
            break
        on = loads[heavy] > enough
        heavy, light = heavy[on], light[on]
        gap = (loads[heavy] - loads[light])[:, None]
        ch, cl = cost[members[heavy]], cost[members[light]]  # [pairs, room]
        hl, ll = loads[heavy][:, None], loads[light][:, None]
        pairs = np.arange(len(heavy))[:, None]
        # swap x of heavy for y of light (heavy - d, light + d, d = x - y): for each x the y nearest x - gap / 2
        # on either side (one searchsorted over the rows' sorted costs laid end to end, each row offset by
        # ``span``; a NaN pad sorts as ``top``, inside its row, and is never chosen)
        top = float(np.nanmax(cl)) + 1.0 if not np.isnan(cl).all() else 1.0
        span = 2.0 * (top + float(gap.max())) + 1.0
        by_cost = np.argsort(np.where(np.isnan(cl), top, cl), axis=1, kind="stable")
        sl = np.take_along_axis(cl, by_cost, axis=1)  # NaNs last
        keyed = (np.where(np.isnan(sl), top, sl) + pairs * span).ravel()
        want = np.where(np.isnan(ch), 0.0, ch - gap / 2) + pairs * span
        pos = np.searchsorted(keyed, want.ravel()).reshape(want.shape) - pairs * room
        best = np.full(len(heavy), np.inf)
        swap = np.zeros(len(heavy), dtype=np.int64)
        with np.errstate(invalid="ignore"):
            for cand in (np.clip(pos, 0, room - 1), np.clip(pos - 1, 0, room - 1)):
                d = ch - np.take_along_axis(sl, cand, axis=1)
                new = np.where((d > 0) & (d < gap), np.maximum(hl - d, ll + d), np.inf)
                i = np.argmin(new, axis=1)
                got = new[pairs[:, 0], i]
                take = got < best
                best = np.where(take, got, best)
                swap = np.where(take, i * room + by_cost[pairs[:, 0], cand[pairs[:, 0], i]], swap)
            move = np.full(len(heavy), -1)
            if not equal_count:  # or move x of heavy to light, where heavy keeps a sample
                moved = np.maximum(hl - ch, ll + ch)
                moved = np.where((ch > 0) & (ch < gap) & (sizes[heavy] > 1)[:, None], moved, np.inf)
                i = np.argmin(moved, axis=1)
                better = moved[pairs[:, 0], i] <= best  # a move first on ties, as _refine
                move = np.where(better, i, -1)
                best = np.where(better, moved[pairs[:, 0], i], best)
        ok = best < loads[heavy]
        if not ok[0] and not ok.any():
            break
        k = np.flatnonzero(ok)
        h, l = heavy[k], light[k]
        i, j = np.where(move[k] >= 0, move[k], swap[k] // room), swap[k] % room
        x = members[h, i]
        is_move = move[k] >= 0
        y = np.where(is_move, -1, members[l, j])
        delta = c[x] - np.where(is_move, 0.0, c[np.maximum(y, 0)])
        # swaps: exchange in place; moves: x to the light rank's end, the heavy rank's last member into x's slot
        sw = ~is_move
        members[h[sw], i[sw]], members[l[sw], j[sw]] = y[sw], x[sw]
        hm, lm, im = h[is_move], l[is_move], i[is_move]
        if hm.size:
            if int(sizes[lm].max()) >= members.shape[1]:
                members = np.concatenate([members, np.full((w, 8), -1, dtype=np.int64)], axis=1)
                room = members.shape[1]
            members[lm, sizes[lm]] = x[is_move]
            members[hm, im] = members[hm, sizes[hm] - 1]
            members[hm, sizes[hm] - 1] = -1
            sizes[hm] -= 1
            sizes[lm] += 1
        loads[h] -= delta
        loads[l] += delta
        owner[x] = l
        owner[y[sw]] = h[sw]
        steps += k.size
        if not ok[0]:  # the heaviest rank's pair found nothing: as _refine, stop there
            break
    return owner


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


def _owner_of(groups, n: int) -> np.ndarray:
    """The group of each of the ``n`` samples (every sample in exactly one of ``groups``)."""
    owner = np.empty(n, dtype=np.int64)
    if n:
        owner[np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])] = np.repeat(
            np.arange(len(groups)), [len(g) for g in groups])
    return owner


def _keep_local(groups, n: int, w: int) -> list:
    """Give each subset to a rank so that the most samples stay where they were loaded (``_keep_local_owner``'s
    matching, on a list of subsets)."""
    owner = _owner_of(groups, n)
    rank_of = _keep_local_owner(owner, _group_by_rank(owner, w), n, w)
    out = [None] * w
    for s, r in enumerate(rank_of):
        out[r] = groups[s]
    return out


def _keep_local_owner(owner: np.ndarray, by_subset: np.ndarray, n: int, w: int) -> list[int]:
    """The rank of each subset (``owner``: the subset of each sample; ``by_subset``: the samples by subset, then
    index, ``_group_by_rank(owner, w)``), so that the most samples stay where they were loaded: greedy matching
    on the overlap counts, the (subset, rank) pairs sharing two samples or more first, most first, ties by
    subset then rank; then each open subset, in order, its first free rank among those it shares one sample
    with; the rest in order."""
    base, extra = divmod(n, w)
    big = extra * (base + 1)  # rank r loaded shard_range(N, r, W): the first N % W ranks one sample more
    if extra:
        loader = np.where(by_subset < big, by_subset // (base + 1), extra + (by_subset - big) // max(base, 1))
    else:
        loader = by_subset // base
    sizes = np.bincount(owner, minlength=w)
    subset = np.repeat(np.arange(w), sizes)  # of each sample in by_subset's order
    # (subset, loader) is sorted along by_subset, so a pair sharing k samples is a run of k: the runs longer
    # than one, from the (few) places where a sample's pair is its successor's
    same = loader[1:] == loader[:-1]
    ends = (np.cumsum(sizes) - 1)[sizes > 0]
    same[ends[ends < n - 1]] = False  # a subset's last sample and the next one's first
    dup = np.flatnonzero(same)
    starts = dup[np.concatenate([[True], np.diff(dup) > 1])] if dup.size else dup
    counts = np.diff(np.append(np.searchsorted(dup, starts), dup.size)) + 1 if dup.size else dup
    rank_of = [-1] * w  # plain lists: the greedy loops below index them once per pair
    taken = [False] * w
    ranked = np.lexsort((loader[starts], subset[starts], -counts))  # most first, ties by (subset, rank)
    for s, r in zip(subset[starts][ranked].tolist(), loader[starts][ranked].tolist(), strict=False):
        if rank_of[s] < 0 and not taken[r]:
            rank_of[s], taken[r] = r, True
    # then the pairs sharing one sample, in (subset, rank) order: each open subset its first free rank. An open
    # subset's pairs with a free rank all share one sample (a longer one would have been matched above), so
    # these are its samples whose loading rank is free, in order. In chunks of FIRST_FREE_CHUNK subsets: each
    # one's first rank free before the chunk in one pass (numpy); that is its answer unless an earlier subset
    # of the same chunk took it, and then the loop looks further along that subset's pairs
    single = np.flatnonzero((np.array(rank_of) < 0)[subset] & ~np.array(taken)[loader])
    subset, rank = subset[single], loader[single]
    if subset.size:
        heads = np.flatnonzero(np.concatenate([[True], subset[1:] != subset[:-1]]))
        ends = np.append(heads[1:], subset.size)
        is_taken = np.array(taken)
        for lo in range(0, heads.size, FIRST_FREE_CHUNK):
            hs, es = heads[lo:lo + FIRST_FREE_CHUNK], ends[lo:lo + FIRST_FREE_CHUNK]
            free = np.flatnonzero(~is_taken[rank[hs[0]:es[-1]]]) + hs[0]  # positions of pairs still free
            at = free[np.minimum(np.searchsorted(free, hs), max(free.size - 1, 0))] if free.size else es
            at = np.where((at >= hs) & (at < es), at, -1)  # the first free pair of each subset, or none
            got = []
            for s, a, e, r in zip(subset[hs].tolist(), at.tolist(), es.tolist(), rank[np.maximum(at, 0)].tolist(),
                                  strict=False):
                if a < 0:
                    continue
                if taken[r]:  # taken by an earlier subset of this chunk
                    r = next((q for q in rank[a + 1:e].tolist() if not taken[q]), -1)
                    if r < 0:
                        continue
                rank_of[s], taken[r] = r, True
                got.append(r)
            is_taken[got] = True
    rest = iter([r for r in range(w) if not taken[r]])
    return [r if r >= 0 else next(rest) for r in rank_of]


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
    # every try as one array, the subset of each sample (no per-rank lists on many ranks)
    tries = []
    if method in ("auto", "lpt") and w >= BLOCK_LPT_MIN_W:
        order, placed = _block_owner(c, w, equal_count)
        owner = np.empty(n, dtype=np.int64)
        owner[order] = placed
        if refine and _refine_pays(np.bincount(owner, weights=c, minlength=w), REFINE_STEPS):
            owner = _refine_pairs(c, owner, w, equal_count, REFINE_STEPS)
        tries.append(owner)
    elif method in ("auto", "lpt"):
        tries.append(_lpt(c, w, equal_count))
    if method in ("kk", "bldm") or (method == "auto" and n * w <= KK_LIMIT):  # differencing while it is cheap
        tries.append((_bldm if equal_count or method == "bldm" else _kk)(c, w))
    if refine:
        tries = [t if isinstance(t, np.ndarray) else _refine(c, t, equal_count, max_steps=REFINE_STEPS)
                 for t in tries]
    tries = [t if isinstance(t, np.ndarray) else _owner_of(t, n) for t in tries]
    peaks = [np.bincount(t, weights=c, minlength=w).max() for t in tries]
    peak = min(peaks)
    owner = tries[peaks.index(peak)]  # first of the best on ties
    sizes = np.bincount(owner, minlength=w)
    if not equal_count and n >= w and not sizes.all():
        owner = _owner_of(_fill_empty(c, _by_owner(np.arange(n), owner, w)), n)
        sizes = np.bincount(owner, minlength=w)
        peak = np.bincount(owner, weights=c, minlength=w).max()
    if keep_local:
        # what rank r loaded: shard_range, the first N % W ranks one sample more (summed in index order)
        loaded = np.full(w, n // w) + (np.arange(w) < n % w)
        if np.bincount(np.repeat(np.arange(w), loaded), weights=c, minlength=w).max() <= peak:
            return list(torch.arange(n, dtype=torch.int64).split(loaded.tolist()))  # already as balanced
    # each subset's indices in increasing order: one stable sort of the owners, then views of it
    by_subset = _group_by_rank(owner, w)
    parts = torch.from_numpy(by_subset).split(sizes.tolist())
    if not keep_local:
        return list(parts)
    out = [None] * w
    for s, r in enumerate(_keep_local_owner(owner, by_subset, n, w)):
        out[r] = parts[s]
    return out


def imbalance(costs, groups) -> float:
    """max / mean of the ranks' summed costs (1.0: perfectly balanced; the slowest rank sets the step)."""
    c = torch.as_tensor(costs, dtype=torch.float64)
    loads = torch.stack([c[g.long()].sum() if len(g) else torch.zeros((), dtype=torch.float64) for g in groups])
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


__all__ = ["KK_LIMIT", "METHODS", "REFINE_STEPS", "REFINE_TOL", "check_costs", "imbalance", "partition"]
