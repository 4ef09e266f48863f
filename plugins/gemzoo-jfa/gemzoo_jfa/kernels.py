"""Triton kernels for jagged attention, forward and backward: one family for softmax (jfa) and the
pointwise activations of GDPA (gdpa).

Layout: q [Tq, H, D], k [Tk, HKV, D], v [Tk, HKV, DV] with unit stride on the last dim; int64 offsets [B+1]
with unit stride. Every program takes one work item, a (sequence, block[, key split]) entry of a
schedule built on the device (see ``schedule.py``), and one head: ``pid = item * heads + head`` so the
heads of the costliest items start first. Items past the real count carry sequence -1 and exit at once.

GROUP (constexpr) = H / HKV query heads share one k/v head (grouped-query attention; 1: multi-head, MQA:
HKV = 1): query head h reads k/v head h // GROUP. The forward and dq kernels run one program per query head;
the dk/dv kernel one per k/v head, looping over the GROUP query heads of its group (``_dkdv_q_head``) and
accumulating dK and dV in registers, so no atomics are needed.

Key j is allowed for query i iff (not CAUSAL or j <= i + s) and (not WINDOWED or i + s - j < window),
with s = Lk - Lq (bottom-right causal), and, with BLOCKED, (i + s) // block == j // block (blocks of
``block`` positions from each sequence's start). Key ranges are cut into fully-allowed blocks (no mask
arithmetic) and boundary blocks (masked); every bound narrows the range, so no tile without an allowed
pair is loaded.

ROPE (constexpr) rotates q and k tiles on load (half-split RoPE, pairs (d, d + D/2), query i at position
i + s, key j at j; ``rope_c`` = -2 log2(theta) / D) and un-rotates dq and dk before the store, so no
rotated copy is written. A rotated tile holds its two halves at columns [0, D/2) and [BD/2, BD/2 + D/2).

ACT (constexpr) picks the activation, a code of gemzoo's one table (``gemzoo.api.ACTIVATION_CODES``):
  * 0, softmax: online max/rescale in base 2; the saved logsumexp is base 2 and +inf for rows with no
    allowed key, so their probabilities are 0 in the backward pass (which needs delta = rowsum(dO*O)).
  * otherwise pointwise: P = act(scale * S) on allowed pairs, 0 elsewhere, times ``inv_norm``; no max,
    no rescale, no logsumexp. Backward uses the exact derivative dS = dP * act'(scale * S) and needs
    no preprocess. Because the sum over keys is plain addition, a query block's key range may be split
    across programs (SPLIT: items carry a key-split index) whose fp32 partials are added atomically.

REL (constexpr) adds a relative attention bias (``gemzoo.api.RelativeAttentionBias``) to the scaled scores,
computed in the tiles from two small tables: 1 positions[clamp(i + s - j, 0, P - 1)], 2 that plus
time_weights[bucket of |q_times[i] - k_times[j]|] (int64 gap, at least 1, natural log in fp32 (libdevice's
on CUDA), divided by ``rb_div``, truncated, clamped to [0, NB]); 0 (the default) compiles as without it.
Softmax adds it times log2(e) (its scores are base 2). The dk/dv kernel also adds dS per table entry
into row ``pid % rb_slots`` of an fp32 [slots, P + NB + 1] buffer (``RB_GRAD``), one row per program up
to the slot count, which the launcher sums over rows: no table-wide atomics across programs.

DOT (constexpr) is the input precision of the dots on fp32 operands: "ieee" (full fp32) or "tf32", chosen by
the launcher from ``torch.get_float32_matmul_precision()`` as torch.matmul chooses ("highest": ieee). 16-bit
and e4m3 operands ignore it.

UPCAST converts loaded tiles to fp32 before any arithmetic: the Triton interpreter gets bf16 wrong.
With TMA, rows past a sequence's end belong to the next sequence; boundary blocks zero them, so a NaN
there never reaches this sequence (0 * NaN would).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _ceil_to(x, m):
    return ((x + m - 1) // m) * m


@triton.jit
def _blk_start(p, block):
    """First position of the block holding position ``p`` (floor semantics, also for p < 0)."""
    return p - ((p % block) + block) % block


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh; FAST (CUDA): the one-instruction tanh.approx.f32 (max abs error ~5e-4, far below bf16 P)."""
    if FAST:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
    return y


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    """sigmoid; FAST: 0.5 tanh(x / 2) + 0.5 (one MUFU op, no IEEE division)."""
    if FAST:
        y = 0.5 * _tanh(0.5 * x, FAST) + 0.5
    else:
        y = 1.0 / (1.0 + tl.exp(-x))
    return y


@triton.jit
def _erf_and_gauss(x, FAST: tl.constexpr):
    """(erf(x / sqrt 2), exp(-x^2 / 2)). FAST: Abramowitz-Stegun 7.1.26 (max abs error 1.5e-7) with one
    approximate reciprocal and one exp2, sharing the exp with the Gaussian (libdevice's erf is ~3x dearer)."""
    e = tl.math.exp2(-0.7213475204444817 * x * x)  # exp(-x^2 / 2)
    if FAST:
        a = tl.abs(x) * 0.7071067811865476
        t = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + 0.3275911 * a],
                                      dtype=tl.float32, is_pure=True, pack=1)
        poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        erf_a = 1.0 - poly * e
        erf = tl.where(x < 0, -erf_a, erf_a)
    else:
        erf = tl.math.erf(x * 0.7071067811865476)
    return erf, e


@triton.jit
def _act(x, ACT: tl.constexpr, FAST: tl.constexpr):
    """Pointwise activation (gemzoo.api.ACTIVATION_CODES 1..8); FAST uses approximate MUFU forms (CUDA)."""
    if ACT == 1:  # silu
        y = x * _sigmoid(x, FAST)
    elif ACT == 2:  # gelu (erf): libdevice's erf here (the forward measured faster with it than with A&S)
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 5:  # gelu_tanh
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x), FAST))
    elif ACT == 3:  # relu
        y = tl.where(x > 0, x, 0.0)
    elif ACT == 6:  # relu2
        r = tl.where(x > 0, x, 0.0)
        y = r * r
    elif ACT == 7:  # leaky_relu(0.01)
        y = tl.where(x > 0, x, 0.01 * x)
    elif ACT == 8:  # hardswish
        y = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) * 0.16666666666666666
    else:  # identity
        y = x
    return y


@triton.jit
def _act_fwd_grad(x, ACT: tl.constexpr, FAST: tl.constexpr):
    """(act(x), act'(x)) with shared subexpressions."""
    if ACT == 1:
        sg = _sigmoid(x, FAST)
        y = x * sg
        g = sg * (1.0 + x * (1.0 - sg))
    elif ACT == 2:
        erf, gauss = _erf_and_gauss(x, FAST)
        cdf = 0.5 * (1.0 + erf)
        y = x * cdf
        g = cdf + x * 0.3989422804014327 * gauss
    elif ACT == 5:
        x2 = x * x
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x2 * x), FAST)
        y = 0.5 * x * (1.0 + t)
        g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x2)
    elif ACT == 3:
        y = tl.where(x > 0, x, 0.0)
        g = tl.where(x > 0, 1.0, 0.0)
    elif ACT == 6:
        r = tl.where(x > 0, x, 0.0)
        y = r * r
        g = 2.0 * r
    elif ACT == 7:
        y = tl.where(x > 0, x, 0.01 * x)
        g = tl.where(x > 0, 1.0, 0.01)
    elif ACT == 8:
        y = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) * 0.16666666666666666
        g = tl.where(x < -3.0, 0.0, tl.where(x <= 3.0, x * 0.3333333333333333 + 0.5, 1.0))
    else:
        y = x
        g = tl.full(x.shape, 1.0, tl.float32)
    return y, g


@triton.jit
def _rel_times(base, start, idx, L, REL: tl.constexpr):
    """[len(idx)] int64 timestamps at ``base + start + idx`` (0 at idx >= L); zeros without time buckets."""
    if REL == 2:
        t = tl.load(base + start + idx, mask=idx < L, other=0)
    else:
        t = tl.zeros(idx.shape, tl.int64)
    return t


@triton.jit
def _rel_slots(dist, q_t, k_t, n_pos, n_tw, rb_div, REL: tl.constexpr, FAST: tl.constexpr):
    """Table indices of the relative bias for pairs at distance ``dist`` = i + s - j, with query and key
    timestamps ``q_t`` and ``k_t`` (broadcast against it): (position index, time bucket; the position index
    again without time buckets). FAST (CUDA): libdevice's logf, the same as torch's on CUDA."""
    pidx = tl.minimum(tl.maximum(dist, 0), n_pos - 1)
    tidx = pidx
    if REL == 2:
        gap = tl.maximum(tl.abs(q_t - k_t), 1).to(tl.float32)
        if FAST:
            lg = libdevice.log(gap)
        else:
            lg = tl.log(gap)
        # log(gap) >= 0, so truncation is the floor; clamping in fp32 first keeps the conversion in range
        tidx = tl.minimum(tl.math.div_rn(lg, rb_div), (n_tw - 1) * 1.0).to(tl.int32)
    return pidx, tidx


@triton.jit
def _rel_bias(RB_POS, RB_TW, pidx, tidx, ACT: tl.constexpr, REL: tl.constexpr):
    """The relative bias at table indices (pidx, tidx) in fp32, in the scores' units (base 2 for softmax)."""
    b = tl.load(RB_POS + pidx).to(tl.float32)
    if REL == 2:
        b += tl.load(RB_TW + tidx).to(tl.float32)
    if ACT == 0:
        b = b * 1.4426950408889634
    return b


@triton.jit
def _rel_grad(G, ds, ok, pidx, tidx, n_pos, REL: tl.constexpr):
    """Add dS of the allowed pairs ``ok`` to this program's row ``G`` of the table-gradient buffer."""
    tl.atomic_add(G + pidx, ds, mask=ok, sem="relaxed")
    if REL == 2:
        tl.atomic_add(G + n_pos + tidx, ds, mask=ok, sem="relaxed")


@triton.jit
def _work(ITEMS, n_items_cap, QOFF, KOFF, H: tl.constexpr, SPLIT: tl.constexpr):
    """This program's head and work item: (b, h, block, key split, q_start, Lq, k_start, Lk); b < 0 marks
    an empty slot (the caller returns). ``split`` is 0 without SPLIT."""
    pid = tl.program_id(0)
    item = pid // H
    h = pid % H
    b = tl.load(ITEMS + item)
    blk = tl.load(ITEMS + n_items_cap + item)
    split = 0
    if SPLIT:
        split = tl.load(ITEMS + 2 * n_items_cap + item)
    bs = tl.maximum(b, 0)
    q_start = tl.load(QOFF + bs)
    Lq = (tl.load(QOFF + bs + 1) - q_start).to(tl.int32)
    k_start = tl.load(KOFF + bs)
    Lk = (tl.load(KOFF + bs + 1) - k_start).to(tl.int32)
    return b, h, blk, split, q_start, Lq, k_start, Lk


@triton.jit
def _q_block(mblk, Lq, BM: tl.constexpr):
    """First and last query of block ``mblk``, the block's row offsets and its rows."""
    m_lo = mblk * BM
    offs_m = tl.arange(0, BM)
    return m_lo, tl.minimum(m_lo + BM, Lq) - 1, offs_m, m_lo + offs_m


@triton.jit
def _load_block(base, offs, stride, rows, L, offs_d, D: tl.constexpr):
    """[len(offs), len(offs_d)] tile at ``base`` (rows ``stride`` apart); rows >= L and columns >= D are 0."""
    return tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=(rows[:, None] < L) & (offs_d[None, :] < D),
                   other=0.0)


@triton.jit
def _rope_cos_sin(pos, rope_c, D: tl.constexpr, BD: tl.constexpr, EXACT: tl.constexpr):
    """cos and sin [len(pos), BD/2] of RoPE's angles pos * theta^(-2f/D), f < D/2. Without EXACT (CUDA): the
    angle reduced to [-pi, pi] (two-constant Cody-Waite), then one MUFU cos.approx / sin.approx each (abs
    error ~1e-6, below the fp32 angle's own rounding at long positions) instead of libdevice's range reduction."""
    ang = pos.to(tl.float32)[:, None] * tl.exp2(tl.arange(0, BD // 2).to(tl.float32) * rope_c)[None, :]
    if EXACT:
        c = tl.cos(ang)
        s = tl.sin(ang)
    else:
        turns = tl.floor(ang * 0.15915494309189535 + 0.5)
        r = ang - turns * 6.28125
        r = r - turns * 0.0019353071795864769
        c = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True,
                                      pack=1)
        s = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return c, s


@triton.jit
def _rope_load(base, offs, stride, rows, L, pos, rope_c, D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr,
               EXACT: tl.constexpr):
    """[R, BD] fp32 tile at ``base`` (rows ``stride`` apart, rows >= L are 0) rotated by RoPE at positions
    ``pos``, in the rotated layout (halves at columns 0 and BD/2)."""
    offs_h = tl.arange(0, BD // 2)
    mask = (rows[:, None] < L) & (offs_h[None, :] < D // 2)
    ptrs = base + offs[:, None] * stride + offs_h[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + D // 2, mask=mask, other=0.0).to(tl.float32)
    c, s = _rope_cos_sin(pos, rope_c, D, BD, EXACT)
    return tl.reshape(tl.permute(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), (0, 2, 1)), (R, BD))


@triton.jit
def _rope_store(base, offs, stride, rows, L, pos, rope_c, g, D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr,
                ATOMIC: tl.constexpr, EXACT: tl.constexpr):
    """Store (or, with ATOMIC, add) the gradient of an unrotated tile from ``g``, the fp32 gradient of its
    rotated tile (rotated layout): the transpose of the rotation, i.e. rotation by -angle."""
    g1, g2 = tl.split(tl.permute(tl.reshape(g, (R, 2, BD // 2)), (0, 2, 1)))
    c, s = _rope_cos_sin(pos, rope_c, D, BD, EXACT)
    offs_h = tl.arange(0, BD // 2)
    mask = (rows[:, None] < L) & (offs_h[None, :] < D // 2)
    ptrs = base + offs[:, None] * stride + offs_h[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, g1 * c + g2 * s, mask=mask, sem="relaxed")
        tl.atomic_add(ptrs + D // 2, g2 * c - g1 * s, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, (g1 * c + g2 * s).to(base.dtype.element_ty), mask=mask)
        tl.store(ptrs + D // 2, (g2 * c - g1 * s).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _key_range(m_lo, m_last, Lk, shift, window, split, split_n, BN: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOWED: tl.constexpr, SPLIT: tl.constexpr, block=1, BLOCKED: tl.constexpr = False):
    """Keys that queries [m_lo, m_last] may see, as [lo, full_lo) masked, [full_lo, full_hi) fully
    allowed, [full_hi, hi) masked; with SPLIT only those inside key split ``split`` of ``split_n``."""
    hi = Lk
    if CAUSAL:
        hi = tl.minimum(hi, m_last + shift + 1)
    lo = 0
    full_lo = 0
    if WINDOWED:
        lo = tl.maximum(m_lo + shift - window + 1, 0)
        full_lo = _ceil_to(tl.maximum(m_last + shift - window + 1, 0), BN)
    if BLOCKED:  # the first row's block to the last row's
        lo = tl.maximum(lo, _blk_start(m_lo + shift, block))
        hi = tl.minimum(hi, _blk_start(m_last + shift, block) + block)
        full_lo = tl.maximum(full_lo, _ceil_to(tl.maximum(_blk_start(m_last + shift, block), 0), BN))
    lo = (lo // BN) * BN
    if SPLIT:  # split_n splits per sequence, ceil(Lk / split_n) keys each, rounded up to BN
        chunk = _ceil_to((Lk + split_n - 1) // split_n, BN)
        lo = tl.maximum(lo, split * chunk)
        hi = tl.minimum(hi, split * chunk + chunk)
    hi = tl.maximum(hi, lo)
    full_hi = Lk
    if CAUSAL:
        full_hi = tl.minimum(full_hi, m_lo + shift + 1)
    if BLOCKED:
        full_hi = tl.minimum(full_hi, _blk_start(m_lo + shift, block) + block)
    full_hi = (tl.maximum(full_hi, 0) // BN) * BN
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(n_lo, n_last, Lq, shift, window, BM: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                 block=1, BLOCKED: tl.constexpr = False):
    """Queries that may see a key of [n_lo, n_last]: [lo, full_lo) masked, [full_lo, full_hi) fully
    allowed, [full_hi, hi) masked."""
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = tl.maximum(n_lo - shift, 0)
        full_lo = _ceil_to(tl.maximum(n_last - shift, 0), BM)
    if BLOCKED:  # queries whose position shares a block with a key of the tile
        lo = tl.maximum(lo, _blk_start(n_lo, block) - shift)
        full_lo = tl.maximum(full_lo, _ceil_to(tl.maximum(_blk_start(n_last, block) - shift, 0), BM))
    lo = (lo // BM) * BM
    hi = Lq
    full_hi = Lq
    if WINDOWED:
        hi = tl.minimum(hi, n_last - shift + window)
        full_hi = tl.minimum(full_hi, n_lo - shift + window)
    if BLOCKED:
        hi = tl.minimum(hi, _blk_start(n_last, block) + block - shift)
        full_hi = tl.minimum(full_hi, _blk_start(n_lo, block) + block - shift)
    hi = tl.maximum(hi, lo)
    full_hi = (tl.maximum(full_hi, 0) // BM) * BM
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _has_key(rows, Lk, shift, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, block=1,
             BLOCKED: tl.constexpr = False):
    """[BM] whether query row i has any allowed key. Rows without one output exactly 0 (and get dq = 0):
    their masked products 0 * x would carry a NaN of a key they never see."""
    p = rows + shift
    hi = Lk - 1  # the largest key the row could see
    ok = hi >= 0
    if BLOCKED:
        b0 = _blk_start(p, block)
        hi = tl.minimum(hi, b0 + block - 1)
        ok = ok & (hi >= tl.maximum(b0, 0))
    if CAUSAL:
        hi = tl.minimum(hi, p)
        ok = ok & (p >= 0) & (hi >= 0)
    if WINDOWED:
        ok = ok & (p - hi < window)
    return ok


@triton.jit
def _allowed(rows, cols, Lk, shift, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, block=1,
             BLOCKED: tl.constexpr = False):
    """[BM, BN] allowed pairs of query rows and key cols inside one sequence (cols < Lk included)."""
    ok = cols[None, :] < Lk
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + shift)
    if WINDOWED:
        ok = ok & (rows[:, None] + shift - cols[None, :] < window)
    if BLOCKED:
        b0 = _blk_start(rows + shift, block)
        ok = ok & (cols[None, :] >= b0[:, None]) & (cols[None, :] < b0[:, None] + block)
    return ok


@triton.jit
def _load_kv_t(base, n, stride, offs_n, offs_d, desc, row0, h, limit,
               D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr,
               USE_TMA: tl.constexpr, TRANS: tl.constexpr):
    """Rows [n, n + BN) of one head of a [T, H, D] tensor as [BN, BD] (or [BD, BN] with TRANS); rows
    at or past ``limit`` (the sequence end) are 0 in MASKED blocks."""
    if USE_TMA:
        x = desc.load([row0 + n, h, 0]).reshape(BN, BD)
        if MASKED:
            x = tl.where((n + offs_n)[:, None] < limit, x, 0.0)
        if TRANS:
            x = tl.trans(x)
    elif TRANS:
        ptrs = base + n.to(tl.int64) * stride + offs_n[None, :] * stride + offs_d[:, None]
        if MASKED:
            x = tl.load(ptrs, mask=((n + offs_n)[None, :] < limit) & (offs_d[:, None] < D), other=0.0)
        elif BD != D:
            x = tl.load(ptrs, mask=offs_d[:, None] < D, other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        ptrs = base + n.to(tl.int64) * stride + offs_n[:, None] * stride + offs_d[None, :]
        if MASKED:
            x = tl.load(ptrs, mask=((n + offs_n)[:, None] < limit) & (offs_d[None, :] < D), other=0.0)
        elif BD != D:
            x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _load_rows_t(base, n, stride, offs, offs_d, desc, row0, h, limit, pos, rope_c, like,
                 D: tl.constexpr, BD: tl.constexpr, B: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                 UPCAST: tl.constexpr, ROPE: tl.constexpr):
    """Rows [n, n + B) of one head of a [T, H, D] tensor, transposed to [BD, B]: with ROPE rotated at
    positions ``pos`` (then in ``like``'s dtype), else as stored (the keys of the query-block kernels, the
    queries of the key-block one)."""
    if ROPE:
        x = tl.trans(_rope_load(base + n.to(tl.int64) * stride, offs, stride, n + offs, limit, pos, rope_c,
                                D, BD, B, UPCAST)).to(like.dtype)
    else:
        x = _load_kv_t(base, n, stride, offs, offs_d, desc, row0, h, limit, D, BD, B, MASKED, USE_TMA, True)
    return x


@triton.jit
def _e4m3(x, EXACT: tl.constexpr):
    """fp32 ``x`` (within +-448) as float8 e4m3, rounded to nearest even. EXACT (the interpreter): x is first
    rounded on the e4m3 grid in fp32 (the bit pattern's 20 low mantissa bits for normals, multiples of 2^-9
    below 2^-6), because Triton 3.x's interpreter rounds its fp32 -> e4m3 cast half-up without carrying into
    the exponent (127.9 becomes 64) and truncates subnormals; the cast of a value on the grid is exact there.
    The GPU's cast (cvt.rn.satfinite) rounds correctly by itself."""
    if EXACT:
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        sub = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        r = tl.where(tl.abs(x) < 0.015625, tl.where(x < 0, -sub, sub), normal)  # -0.0 for tiny negatives
        # the interpreter casts NaN to 384: put e4m3's NaN (0x7f) back
        y = tl.where(x != x, tl.full(x.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True), r.to(tl.float8e4nv))
    else:
        y = x.to(tl.float8e4nv)
    return y


@triton.jit
def _load_scales(base, cols, L, MASKED: tl.constexpr):
    """[len(cols)] fp32 per-row fp8 scales at ``base + cols`` (0 at cols >= L in MASKED blocks)."""
    if MASKED:
        s = tl.load(base + cols, mask=cols < L, other=0.0)
    else:
        s = tl.load(base + cols)
    return s


@triton.jit
def _load_vt(base, n, stride_vd, offs_n, offs_dv, L, DV: tl.constexpr, BDV: tl.constexpr, MASKED: tl.constexpr):
    """Rows [n, n + BN) of one head of a V stored transposed ([H, DV, T], unit stride along T) as [BN, BDV]
    (rows at or past ``L`` are 0 in MASKED blocks): the B operand of P V with its contraction dim contiguous.
    Pointer loads only: a TMA box's start along its contiguous dim must be 16-byte aligned, and a sequence's
    keys start anywhere along T."""
    ptrs = base + (n + offs_n)[:, None] + offs_dv[None, :].to(tl.int64) * stride_vd
    if MASKED:
        x = tl.load(ptrs, mask=((n + offs_n)[:, None] < L) & (offs_dv[None, :] < DV), other=0.0)
    elif BDV != DV:
        x = tl.load(ptrs, mask=offs_dv[None, :] < DV, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, start, end, rows, Lk, shift, window,
               qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h,
               D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr,
               USE_TMA: tl.constexpr, ACT: tl.constexpr, block, rope_c, BLOCKED: tl.constexpr, ROPE: tl.constexpr,
               RB_POS, RB_TW, rb_qt, RB_KT, rb_k0, n_pos, n_tw, rb_div, REL: tl.constexpr,
               FP8: tl.constexpr = 0, q_s=None, ks_base=None, vs_base=None, stride_vd=1, DOT: tl.constexpr = "tf32"):
    for n in range(start, end, BN):
        n = tl.multiple_of(n, BN)
        cols = n + offs_n
        kt = _load_rows_t(k_base, n, stride_kt, offs_n, offs_d, KD, k_row0, h, Lk, cols, rope_c, q, D, BD, BN,
                          MASKED, USE_TMA, UPCAST, ROPE)
        if FP8 > 0:  # e4m3 q and k, fp32 accumulate; rows scaled by q_s (qk_scale folded in), columns by k_s
            k_s = _load_scales(ks_base, cols, Lk, MASKED)
            qk = tl.dot(q, kt) * q_s[:, None] * k_s[None, :]
        else:
            if not ROPE:  # the rotated keys come in q's dtype already
                if UPCAST:
                    kt = kt.to(tl.float32)
            qk = tl.dot(q, kt, input_precision=DOT) * qk_scale
        if REL > 0:
            pidx, tidx = _rel_slots(rows[:, None] + shift - cols[None, :], rb_qt[:, None],
                                    _rel_times(RB_KT, rb_k0, cols, Lk, REL)[None, :], n_pos, n_tw, rb_div, REL, not UPCAST)
            qk += _rel_bias(RB_POS, RB_TW, pidx, tidx, ACT, REL)
        if ACT == 0:
            if MASKED:
                qk = tl.where(_allowed(rows, cols, Lk, shift, window, CAUSAL, WINDOWED, block, BLOCKED), qk,
                              float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked rows so far: keep p = 0
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            p = _act(qk, ACT, not UPCAST)
            if MASKED:
                p = tl.where(_allowed(rows, cols, Lk, shift, window, CAUSAL, WINDOWED, block, BLOCKED), p, 0.0)
        if FP8 == 2:  # e4m3 V stored [HKV, DV, Tk] (keys contiguous: K-major for Hopper's fp8 wgmma)
            vv = _load_vt(v_base, n, stride_vd, offs_n, offs_dv, Lk, DV, BDV, MASKED)
            v_s = _load_scales(vs_base, cols, Lk, MASKED)
            v_max = tl.max(v_s, 0)
            v_max = tl.where(v_max == 0.0, 1.0, v_max)  # all-zero tile: any; a NaN (interpreter's max) stays
            # P in [0, 1] (softmax) times 256 (a power of two, exact; e4m3 normals then reach down to 2^-14), each
            # key's column times its block's scale over the tile's largest (<= 1); the tile's product is
            # rescaled by v_max / 256
            p8 = _e4m3(p * (v_s * (256.0 / v_max))[None, :], UPCAST)
            acc += tl.dot(p8, vv) * (v_max * 0.00390625)
        else:
            vv = _load_kv_t(v_base, n, stride_vt, offs_n, offs_dv, VD, k_row0, h, Lk, DV, BDV, BN, MASKED, USE_TMA,
                            False)
            if UPCAST:
                acc = tl.dot(p, vv.to(tl.float32), acc, input_precision=DOT)
            else:
                acc = tl.dot(p.to(vv.dtype), vv, acc, input_precision=DOT)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=("n_items_cap", "Tq", "split_n"))
def attn_fwd_kernel(Q, K, V, O, LSE, QOFF, KOFF, ITEMS, KD, VD, n_items_cap, Tq, qk_scale, inv_norm, window,
                    split_n, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
                    ACT: tl.constexpr = 0, SPLIT: tl.constexpr = False, block=1, rope_c=0.0,
                    BLOCKED: tl.constexpr = False, ROPE: tl.constexpr = False, RB_POS=None, RB_TW=None, RB_QT=None,
                    RB_KT=None, n_pos=1, n_tw=1, rb_div=1.0, REL: tl.constexpr = 0, GROUP: tl.constexpr = 1,
                    FP8: tl.constexpr = 0, QS=None, KS=None, VS=None, Tk=0, stride_vd=1,
                    DOT: tl.constexpr = "tf32"):
    """Forward. Softmax writes O and LSE; pointwise writes O (or, with SPLIT, adds to fp32 O). REL > 0 adds
    the relative bias of the tables RB_POS [n_pos] and RB_TW [n_tw] (timestamps RB_QT [Tq], RB_KT [Tk]).
    One program per query head h, reading k/v head h // GROUP.

    FP8 1: Q and K are e4m3 with per-row fp32 scales QS [H, Tq], KS [HKV, Tk] (each row holds its block's
    scale; ``quant_fp8_kernel``), QK^T runs on the e4m3 operands and its fp32 product is scaled by q_s * k_s *
    qk_scale; P V stays in V's dtype. FP8 2 (softmax only): V too, stored transposed [HKV, DV, Tk] (``stride_vt``
    1, ``stride_vh`` DV * Tk, ``stride_vd`` Tk) with scales VS [HKV, Tk], and P cast to e4m3 (see _fwd_inner)."""
    b, h, mblk, split, q_start, Lq, k_start, Lk = _work(ITEMS, n_items_cap, QOFF, KOFF, H, SPLIT)
    if b < 0:
        return
    hk = h // GROUP
    shift = Lk - Lq
    m_lo, m_last, offs_m, rows = _q_block(mblk, Lq, BM)
    offs_n, offs_d, offs_dv = tl.arange(0, BN), tl.arange(0, BD), tl.arange(0, BDV)

    if ROPE:
        q = _rope_load(Q + (q_start + m_lo) * stride_qt + h * stride_qh, offs_m, stride_qt, rows, Lq, rows + shift,
                       rope_c, D, BD, BM, UPCAST)
        if not UPCAST:
            q = q.to(Q.dtype.element_ty)
    else:
        q = _load_block(Q + (q_start + m_lo) * stride_qt + h * stride_qh, offs_m, stride_qt, rows, Lq, offs_d, D)
        if UPCAST and FP8 == 0:
            q = q.to(tl.float32)
    k_base = K + k_start * stride_kt + hk * stride_kh
    v_base = V + k_start * stride_vt + hk * stride_vh
    k_row0 = k_start.to(tl.int32)
    q_s = qk_scale
    ks_base = KS
    vs_base = VS
    if FP8 > 0:
        q_s = tl.load(QS + h.to(tl.int64) * Tq + q_start + rows, mask=rows < Lq, other=0.0) * qk_scale
        ks_base = KS + hk.to(tl.int64) * Tk + k_start
        if FP8 == 2:
            vs_base = VS + hk.to(tl.int64) * Tk + k_start
    lo, full_lo, full_hi, hi = _key_range(m_lo, m_last, Lk, shift, window, split, split_n, BN, CAUSAL, WINDOWED,
                                          SPLIT, block, BLOCKED)
    if SPLIT:
        if hi <= lo:  # this key split holds no allowed key: the zeroed fp32 output needs nothing
            return

    rb_qt = _rel_times(RB_QT, q_start, rows, Lq, REL)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, full_lo, rows, Lk,
                               shift, window, qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, hk, D, DV, BD,
                               BDV, BN, True, CAUSAL, WINDOWED, UPCAST, USE_TMA, ACT, block, rope_c, BLOCKED, ROPE,
                               RB_POS, RB_TW, rb_qt, RB_KT, k_start, n_pos, n_tw, rb_div, REL, FP8, q_s, ks_base,
                               vs_base, stride_vd, DOT=DOT)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, full_lo, full_hi, rows,
                               Lk, shift, window, qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, hk, D, DV,
                               BD, BDV, BN, False, CAUSAL, WINDOWED, UPCAST, USE_TMA, ACT, block, rope_c, BLOCKED,
                               ROPE, RB_POS, RB_TW, rb_qt, RB_KT, k_start, n_pos, n_tw, rb_div, REL, FP8, q_s, ks_base,
                               vs_base, stride_vd, DOT=DOT)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, full_hi, hi, rows, Lk,
                               shift, window, qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, hk, D, DV, BD,
                               BDV, BN, True, CAUSAL, WINDOWED, UPCAST, USE_TMA, ACT, block, rope_c, BLOCKED, ROPE,
                               RB_POS, RB_TW, rb_qt, RB_KT, k_start, n_pos, n_tw, rb_div, REL, FP8, q_s, ks_base,
                               vs_base, stride_vd, DOT=DOT)

    o_ptrs = O + (q_start + m_lo) * stride_ot + h * stride_oh + offs_m[:, None] * stride_ot + offs_dv[None, :]
    o_mask = (rows[:, None] < Lq) & (offs_dv[None, :] < DV)
    if ACT == 0:
        # no allowed key: output 0 (even if a masked 0 * NaN reached acc), lse +inf
        empty = (l_i == 0.0) | ~_has_key(rows, Lk, shift, window, CAUSAL, WINDOWED, block, BLOCKED)
        out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        lse = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)
        tl.store(LSE + h.to(tl.int64) * Tq + q_start + rows, lse, mask=rows < Lq)
    elif SPLIT:
        keep = _has_key(rows, Lk, shift, window, CAUSAL, WINDOWED, block, BLOCKED)
        tl.atomic_add(o_ptrs, tl.where(keep[:, None], acc * inv_norm, 0.0), mask=o_mask, sem="relaxed")
    else:
        keep = _has_key(rows, Lk, shift, window, CAUSAL, WINDOWED, block, BLOCKED)
        tl.store(o_ptrs, tl.where(keep[:, None], acc * inv_norm, 0.0).to(O.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=("T",))
def attn_bwd_preprocess(O, DO, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh,
                        DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr):
    """Softmax only: delta[h, t] = sum_d o[t, h, d] * do[t, h, d] in fp32."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t0 = pid.to(tl.int64) * BT
    offs_t = tl.arange(0, BT)
    offs_d = tl.arange(0, BDV)
    mask = (t0 + offs_t[:, None] < T) & (offs_d[None, :] < DV)
    o = tl.load(O + t0 * stride_ot + h * stride_oh + offs_t[:, None] * stride_ot + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    do = tl.load(DO + t0 * stride_dot + h * stride_doh + offs_t[:, None] * stride_dot + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + h.to(tl.int64) * T + t0 + offs_t, tl.sum(o * do, 1), mask=t0 + offs_t < T)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, start, end, cols, Lq,
                shift, window, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, h, dq_base, stride_dqt,
                D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr,
                USE_TMA: tl.constexpr, ACT: tl.constexpr, block, rope_c, BLOCKED: tl.constexpr, ROPE: tl.constexpr,
                FUSED_DQ: tl.constexpr, RB_POS, RB_TW, rb_kt, RB_QT, rb_q0, n_pos, n_tw, rb_div, rb_grad, kvalid,
                REL: tl.constexpr, DOT: tl.constexpr = "tf32"):
    for m in range(start, end, BM):
        m = tl.multiple_of(m, BM)
        rows = m + offs_m
        qt = _load_rows_t(q_base, m, stride_qt, offs_m, offs_d, QD, q_row0, h, Lq, rows + shift, rope_c, k, D, BD,
                          BM, MASKED, USE_TMA, UPCAST, ROPE)
        do = _load_kv_t(do_base, m, stride_dot, offs_m, offs_dv, DOD, q_row0, h, Lq, DV, BDV, BM, MASKED, USE_TMA,
                        False)
        if UPCAST:
            qt = qt.to(tl.float32)
            do = do.to(tl.float32)
        qkt = tl.dot(k, qt, input_precision=DOT)  # [BN, BM]
        st = qkt * qk_scale
        if REL > 0:
            pidx, tidx = _rel_slots(rows[None, :] + shift - cols[:, None],
                                    _rel_times(RB_QT, rb_q0, rows, Lq, REL)[None, :], rb_kt[:, None], n_pos, n_tw,
                                    rb_div, REL, not UPCAST)
            st += _rel_bias(RB_POS, RB_TW, pidx, tidx, ACT, REL)
        if MASKED:  # [BN, BM]
            ok = rows[None, :] < Lq
            if CAUSAL:
                ok = ok & (cols[:, None] <= rows[None, :] + shift)
            if WINDOWED:
                ok = ok & (rows[None, :] + shift - cols[:, None] < window)
            if BLOCKED:
                b0 = _blk_start(rows + shift, block)
                ok = ok & (cols[:, None] >= b0[None, :]) & (cols[:, None] < b0[None, :] + block)
        if ACT == 0:
            if MASKED:
                lse = tl.load(lse_base + rows, mask=rows < Lq, other=float("inf"))
                delta = tl.load(delta_base + rows, mask=rows < Lq, other=0.0)
            else:
                lse = tl.load(lse_base + rows)
                delta = tl.load(delta_base + rows)
            pt = tl.math.exp2(st - lse[None, :])
            if MASKED:
                pt = tl.where(ok, pt, 0.0)
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT)  # [BN, BM]
            dst = pt * (dpt - delta[None, :])
        else:
            pt, gt = _act_fwd_grad(st, ACT, not UPCAST)
            if MASKED:
                pt = tl.where(ok, pt, 0.0)
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT)  # [BN, BM]
            dst = dpt * gt
            if MASKED:
                dst = tl.where(ok, dst, 0.0)
        if REL > 0:  # dS of the allowed pairs into this program's row of table gradients
            okg = kvalid[:, None] & (pidx >= 0)
            if MASKED:
                okg = okg & ok
            _rel_grad(rb_grad, dst, okg, pidx, tidx, n_pos, REL)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT)
        if FUSED_DQ:  # this key block's share of dQ, added in fp32 (the launcher scales it): 5 matmuls, not 7
            dq_part = tl.dot(tl.trans(dst).to(k.dtype), k, input_precision=DOT)  # [BM, BD]
            if ROPE:
                _rope_store(dq_base + m.to(tl.int64) * stride_dqt, offs_m, stride_dqt, rows, Lq, rows + shift, rope_c,
                            dq_part, D, BD, BM, True, UPCAST)
            else:
                tl.atomic_add(dq_base + m.to(tl.int64) * stride_dqt + offs_m[:, None] * stride_dqt + offs_d[None, :],
                              dq_part, mask=(rows[:, None] < Lq) & (offs_d[None, :] < D), sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_q_head(dk, dv, k, v, h, Q, DO, LSE, DELTA, DQACC, DK, stride_qt, stride_qh, stride_dot, stride_doh,
                 stride_dqt, stride_dqh, Tq, q_start, Lq, shift, window, lo, full_lo, full_hi, hi, cols, qk_scale,
                 offs_m, offs_d, offs_dv, QD, DOD, q_row0,
                 D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
                 ACT: tl.constexpr, block, rope_c, BLOCKED: tl.constexpr, ROPE: tl.constexpr, FUSED_DQ: tl.constexpr,
                 RB_POS, RB_TW, rb_kt, RB_QT, n_pos, n_tw, rb_div, rb_grad, kvalid, REL: tl.constexpr,
                 DOT: tl.constexpr = "tf32"):
    """Add query head ``h``'s share to the dK, dV accumulators of one key block: its queries that see the block,
    as masked [lo, full_lo), fully allowed [full_lo, full_hi) and masked [full_hi, hi) query blocks."""
    q_base = Q + q_start * stride_qt + h * stride_qh
    do_base = DO + q_start * stride_dot + h * stride_doh
    lse_base = LSE + h.to(tl.int64) * Tq + q_start
    delta_base = DELTA + h.to(tl.int64) * Tq + q_start
    dq_base = DK  # never written without FUSED_DQ
    if FUSED_DQ:
        dq_base = DQACC + q_start * stride_dqt + h * stride_dqh
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, lo, full_lo,
                         cols, Lq, shift, window, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, h, dq_base,
                         stride_dqt, D, DV, BD, BDV, BM, True, CAUSAL, WINDOWED, UPCAST, USE_TMA, ACT, block, rope_c,
                         BLOCKED, ROPE, FUSED_DQ, RB_POS, RB_TW, rb_kt, RB_QT, q_start, n_pos, n_tw, rb_div, rb_grad,
                         kvalid, REL, DOT=DOT)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, full_lo,
                         full_hi, cols, Lq, shift, window, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, h,
                         dq_base, stride_dqt, D, DV, BD, BDV, BM, False, CAUSAL, WINDOWED, UPCAST, USE_TMA, ACT, block,
                         rope_c, BLOCKED, ROPE, FUSED_DQ, RB_POS, RB_TW, rb_kt, RB_QT, q_start, n_pos, n_tw, rb_div,
                         rb_grad, kvalid, REL, DOT=DOT)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, full_hi, hi,
                         cols, Lq, shift, window, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, h, dq_base,
                         stride_dqt, D, DV, BD, BDV, BM, True, CAUSAL, WINDOWED, UPCAST, USE_TMA, ACT, block, rope_c,
                         BLOCKED, ROPE, FUSED_DQ, RB_POS, RB_TW, rb_kt, RB_QT, q_start, n_pos, n_tw, rb_div, rb_grad,
                         kvalid, REL, DOT=DOT)
    return dk, dv


@triton.jit(do_not_specialize=("n_items_cap", "Tq"))
def attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_, QOFF, KOFF, ITEMS, QD, DOD, n_items_cap, Tq, qk_scale,
                         dk_scale, dv_scale, window, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                         stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                         H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr,
                         CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
                         ACT: tl.constexpr = 0, block=1, rope_c=0.0, BLOCKED: tl.constexpr = False,
                         ROPE: tl.constexpr = False, DQACC=None, stride_dqt=0, stride_dqh=0,
                         FUSED_DQ: tl.constexpr = False, RB_POS=None, RB_TW=None, RB_QT=None, RB_KT=None, n_pos=1,
                         n_tw=1, rb_div=1.0, RB_GRAD=None, rb_slots=1, rb_width=1, REL: tl.constexpr = 0,
                         GROUP: tl.constexpr = 1, DOT: tl.constexpr = "tf32"):
    """dK, dV of one key block of one k/v head, looping over the GROUP query heads that read it and, for each,
    over the queries that see the block (no atomics). With FUSED_DQ also this block's share of dQ, added
    atomically to the fp32 ``DQACC`` [Tq, H, D] (unscaled, so no dq kernel runs). With REL > 0 the relative
    bias, and dS added per table entry to row pid % rb_slots of ``RB_GRAD`` [rb_slots, rb_width] (positions at
    [0, n_pos), time buckets at [n_pos, n_pos + n_tw)), unscaled."""
    b, hk, nblk, _, q_start, Lq, k_start, Lk = _work(ITEMS, n_items_cap, QOFF, KOFF, H // GROUP, False)
    if b < 0:
        return
    shift = Lk - Lq

    n_lo = nblk * BN
    n_last = tl.minimum(n_lo + BN, Lk) - 1
    offs_n = tl.arange(0, BN)
    cols = n_lo + offs_n
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)

    kmask = cols[:, None] < Lk
    k = _load_block(K + (k_start + n_lo) * stride_kt + hk * stride_kh, offs_n, stride_kt, cols, Lk, offs_d, D)
    v = _load_block(V + (k_start + n_lo) * stride_vt + hk * stride_vh, offs_n, stride_vt, cols, Lk, offs_dv, DV)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if ROPE:
        k = _rope_load(K + (k_start + n_lo) * stride_kt + hk * stride_kh, offs_n, stride_kt, cols, Lk, cols, rope_c, D,
                       BD, BN, UPCAST).to(v.dtype)
    lo, full_lo, full_hi, hi = _query_range(n_lo, n_last, Lq, shift, window, BM, CAUSAL, WINDOWED, block, BLOCKED)

    q_row0 = q_start.to(tl.int32)
    rb_kt = _rel_times(RB_KT, k_start, cols, Lk, REL)
    rb_grad = RB_GRAD
    if REL > 0:
        rb_grad = RB_GRAD + (tl.program_id(0) % rb_slots).to(tl.int64) * rb_width
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    if GROUP == 1:
        dk, dv = _dkdv_q_head(dk, dv, k, v, hk, Q, DO, LSE, DELTA, DQACC, DK, stride_qt, stride_qh, stride_dot,
                              stride_doh, stride_dqt, stride_dqh, Tq, q_start, Lq, shift, window, lo, full_lo, full_hi,
                              hi, cols, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, D, DV, BD, BDV, BM, CAUSAL,
                              WINDOWED, UPCAST, USE_TMA, ACT, block, rope_c, BLOCKED, ROPE, FUSED_DQ, RB_POS, RB_TW,
                              rb_kt, RB_QT, n_pos, n_tw, rb_div, rb_grad, cols < Lk, REL, DOT=DOT)
    else:
        for g in range(GROUP):  # the query heads of this k/v head's group, summed in registers
            dk, dv = _dkdv_q_head(dk, dv, k, v, hk * GROUP + g, Q, DO, LSE, DELTA, DQACC, DK, stride_qt, stride_qh,
                                  stride_dot, stride_doh, stride_dqt, stride_dqh, Tq, q_start, Lq, shift, window, lo,
                                  full_lo, full_hi, hi, cols, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, D,
                                  DV, BD, BDV, BM, CAUSAL, WINDOWED, UPCAST, USE_TMA, ACT, block, rope_c, BLOCKED,
                                  ROPE, FUSED_DQ, RB_POS, RB_TW, rb_kt, RB_QT, n_pos, n_tw, rb_div, rb_grad, cols < Lk,
                                  REL, DOT=DOT)
    dk = dk * dk_scale
    dv = dv * dv_scale
    if ROPE:
        _rope_store(DK + (k_start + n_lo) * stride_dkt + hk * stride_dkh, offs_n, stride_dkt, cols, Lk, cols, rope_c,
                    dk, D, BD, BN, False, UPCAST)
    else:
        tl.store(DK + (k_start + n_lo) * stride_dkt + hk * stride_dkh + offs_n[:, None] * stride_dkt
                 + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kmask & (offs_d[None, :] < D))
    tl.store(DV_ + (k_start + n_lo) * stride_dvt + hk * stride_dvh + offs_n[:, None] * stride_dvt + offs_dv[None, :],
             dv.to(DV_.dtype.element_ty), mask=kmask & (offs_dv[None, :] < DV))


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, start, end, rows, Lk, shift, window,
              qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h,
              D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr,
              USE_TMA: tl.constexpr, ACT: tl.constexpr, block, rope_c, BLOCKED: tl.constexpr, ROPE: tl.constexpr,
              RB_POS, RB_TW, rb_qt, RB_KT, rb_k0, n_pos, n_tw, rb_div, REL: tl.constexpr,
              DOT: tl.constexpr = "tf32"):
    for n in range(start, end, BN):
        n = tl.multiple_of(n, BN)
        cols = n + offs_n
        kt = _load_rows_t(k_base, n, stride_kt, offs_n, offs_d, KD, k_row0, h, Lk, cols, rope_c, q, D, BD, BN,
                          MASKED, USE_TMA, UPCAST, ROPE)
        vt = _load_kv_t(v_base, n, stride_vt, offs_n, offs_dv, VD, k_row0, h, Lk, DV, BDV, BN, MASKED, USE_TMA, True)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=DOT)
        dp = tl.dot(do, vt, input_precision=DOT)
        s = qk * qk_scale
        if REL > 0:
            pidx, tidx = _rel_slots(rows[:, None] + shift - cols[None, :], rb_qt[:, None],
                                    _rel_times(RB_KT, rb_k0, cols, Lk, REL)[None, :], n_pos, n_tw, rb_div, REL,
                                    not UPCAST)
            s += _rel_bias(RB_POS, RB_TW, pidx, tidx, ACT, REL)
        if ACT == 0:
            p = tl.math.exp2(s - lse[:, None])
            if MASKED:
                p = tl.where(_allowed(rows, cols, Lk, shift, window, CAUSAL, WINDOWED, block, BLOCKED), p, 0.0)
            ds = p * (dp - delta[:, None])
        else:
            _, g = _act_fwd_grad(s, ACT, not UPCAST)
            ds = dp * g
            if MASKED:
                ds = tl.where(_allowed(rows, cols, Lk, shift, window, CAUSAL, WINDOWED, block, BLOCKED), ds, 0.0)
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT)
    return dq


@triton.jit(do_not_specialize=("n_items_cap", "Tq", "split_n"))
def attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, QOFF, KOFF, ITEMS, KD, VD, n_items_cap, Tq, qk_scale, dq_scale,
                       window, split_n,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                       stride_dqt, stride_dqh,
                       H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr,
                       CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
                       ACT: tl.constexpr = 0, SPLIT: tl.constexpr = False, block=1, rope_c=0.0,
                       BLOCKED: tl.constexpr = False, ROPE: tl.constexpr = False, RB_POS=None, RB_TW=None,
                       RB_QT=None, RB_KT=None, n_pos=1, n_tw=1, rb_div=1.0, REL: tl.constexpr = 0,
                       GROUP: tl.constexpr = 1, DOT: tl.constexpr = "tf32"):
    """dQ of one query block, looping over its keys (with SPLIT: one key split, added to fp32 dQ); REL > 0
    recomputes the scores with the relative bias (its table gradients come from the dk/dv kernel). One
    program per query head h, reading k/v head h // GROUP."""
    b, h, mblk, split, q_start, Lq, k_start, Lk = _work(ITEMS, n_items_cap, QOFF, KOFF, H, SPLIT)
    if b < 0:
        return
    hk = h // GROUP
    shift = Lk - Lq
    m_lo, m_last, offs_m, rows = _q_block(mblk, Lq, BM)
    offs_n, offs_d, offs_dv = tl.arange(0, BN), tl.arange(0, BD), tl.arange(0, BDV)
    rmask = rows < Lq

    q = _load_block(Q + (q_start + m_lo) * stride_qt + h * stride_qh, offs_m, stride_qt, rows, Lq, offs_d, D)
    do = _load_block(DO + (q_start + m_lo) * stride_dot + h * stride_doh, offs_m, stride_dot, rows, Lq, offs_dv, DV)
    if ACT == 0:
        lse = tl.load(LSE + h.to(tl.int64) * Tq + q_start + rows, mask=rmask, other=float("inf"))
        delta = tl.load(DELTA + h.to(tl.int64) * Tq + q_start + rows, mask=rmask, other=0.0)
    else:
        lse = tl.zeros([BM], tl.float32)
        delta = lse
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    if ROPE:
        q = _rope_load(Q + (q_start + m_lo) * stride_qt + h * stride_qh, offs_m, stride_qt, rows, Lq, rows + shift,
                       rope_c, D, BD, BM, UPCAST).to(do.dtype)
    k_base = K + k_start * stride_kt + hk * stride_kh
    v_base = V + k_start * stride_vt + hk * stride_vh
    k_row0 = k_start.to(tl.int32)
    lo, full_lo, full_hi, hi = _key_range(m_lo, m_last, Lk, shift, window, split, split_n, BN, CAUSAL, WINDOWED,
                                          SPLIT, block, BLOCKED)
    if SPLIT:
        if hi <= lo:  # this key split holds no allowed key: the zeroed fp32 output needs nothing
            return

    rb_qt = _rel_times(RB_QT, q_start, rows, Lq, REL)
    dq = tl.zeros([BM, BD], tl.float32)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, full_lo, rows, Lk, shift, window,
                   qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, hk, D, DV, BD, BDV, BN, True, CAUSAL, WINDOWED,
                   UPCAST, USE_TMA, ACT, block, rope_c, BLOCKED, ROPE, RB_POS, RB_TW, rb_qt, RB_KT, k_start, n_pos,
                   n_tw, rb_div, REL, DOT=DOT)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_lo, full_hi, rows, Lk, shift,
                   window, qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, hk, D, DV, BD, BDV, BN, False, CAUSAL,
                   WINDOWED, UPCAST, USE_TMA, ACT, block, rope_c, BLOCKED, ROPE, RB_POS, RB_TW, rb_qt, RB_KT, k_start,
                   n_pos, n_tw, rb_div, REL, DOT=DOT)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_hi, hi, rows, Lk, shift, window,
                   qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, hk, D, DV, BD, BDV, BN, True, CAUSAL, WINDOWED,
                   UPCAST, USE_TMA, ACT, block, rope_c, BLOCKED, ROPE, RB_POS, RB_TW, rb_qt, RB_KT, k_start, n_pos,
                   n_tw, rb_div, REL, DOT=DOT)
    dq = tl.where(_has_key(rows, Lk, shift, window, CAUSAL, WINDOWED, block, BLOCKED)[:, None], dq * dq_scale, 0.0)
    dq_ptrs = DQ + (q_start + m_lo) * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :]
    dq_mask = rmask[:, None] & (offs_d[None, :] < D)
    if ROPE:
        _rope_store(DQ + (q_start + m_lo) * stride_dqt + h * stride_dqh, offs_m, stride_dqt, rows, Lq, rows + shift,
                    rope_c, dq, D, BD, BM, SPLIT, UPCAST)
    elif SPLIT:
        tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_mask)



@triton.jit(do_not_specialize=("n_items_cap", "T"))
def quant_fp8_kernel(X, Y, S, OFF, ITEMS, n_items_cap, T, stride_xt, stride_xh, stride_yt, stride_yh, stride_yd,
                     H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, G: tl.constexpr, EXACT: tl.constexpr):
    """e4m3 copy of one block of G rows (from its sequence's start, so no block straddles two sequences) of one
    head of X [T, H, D], with an amax scale (NaN ignored; a NaN stays NaN, and its row's scale is NaN): scale = amax / 448, Y = clamp(X * (448 / amax), +-448) rounded to
    nearest even, and the scale written to every row of the block in S [H, T] (0 for an all-zero block, whose Y
    is 0). Y's strides are arguments, so V can be written transposed ([H, D, T]). One program per (item of a
    ``build_schedule(..., G, over="q")`` schedule over OFF, head). EXACT: the interpreter's cast (see _e4m3)."""
    pid = tl.program_id(0)
    item = pid // H
    h = pid % H
    b = tl.load(ITEMS + item)
    if b < 0:
        return
    blk = tl.load(ITEMS + n_items_cap + item)
    start = tl.load(OFF + b)
    L = (tl.load(OFF + b + 1) - start).to(tl.int32)
    rows = blk * G + tl.arange(0, G)
    offs_d = tl.arange(0, BD)
    mask = (rows[:, None] < L) & (offs_d[None, :] < D)
    t = start + rows  # int64
    x = tl.load(X + t[:, None] * stride_xt + h * stride_xh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.where(x == x, tl.abs(x), 0.0), 1), 0)  # NaN stays in its element, not its block
    inv = tl.where(amax > 0, tl.math.div_rn(448.0, tl.where(amax > 0, amax, 1.0)), 0.0)
    # the clamp keeps a NaN (min/max would drop it: a NaN input must reach every row that sees it)
    y = _e4m3(tl.minimum(tl.maximum(x * inv, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                         propagate_nan=tl.PropagateNan.ALL), EXACT)
    tl.store(Y + t[:, None] * stride_yt + h * stride_yh + offs_d[None, :].to(tl.int64) * stride_yd, y, mask=mask)
    scale = tl.math.div_rn(amax, 448.0)
    # a row holding a NaN gets a NaN scale: the attention kernel multiplies it into the fp32 products, so the NaN
    # reaches every output that reads the row even where a dot drops it (the interpreter widens e4m3's NaN to 480)
    nan_row = tl.max(tl.where(x != x, 1, 0), 1) > 0
    tl.store(S + h.to(tl.int64) * T + t, tl.where(nan_row, float("nan"), scale), mask=rows < L)
