"""Triton kernels for jagged flash attention (softmax), forward and backward.

Layout: q [Tq, H, D], k [Tk, H, D], v [Tk, H, DV] with unit stride on the last dim; int64 offsets [B+1].
Every program takes one work item, a (sequence, block) pair from a schedule built on the device
(see ``schedule.py``), and one head: ``pid = item * H + head`` so the heads of the costliest items
start first. Items past the real count carry sequence -1 and exit at once.

Key j is allowed for query i iff (not CAUSAL or j <= i + s) and (not WINDOWED or i + s - j < window),
with s = Lk - Lq (bottom-right causal). Key ranges are cut into fully-allowed blocks (no mask
arithmetic) and boundary blocks (masked). Softmax runs in base 2; the saved logsumexp is base 2 too
and is +inf for rows with no allowed key, so their probabilities are 0 in the backward pass.

UPCAST converts loaded tiles to fp32 before any arithmetic: the Triton interpreter gets bf16 wrong.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ceil_to(x, m):
    return ((x + m - 1) // m) * m


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, start, end, rows, Lk, shift, window,
               qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h,
               D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr,
               USE_TMA: tl.constexpr):
    for n in range(start, end, BN):
        n = tl.multiple_of(n, BN)
        cols = n + offs_n
        kt_ptrs = k_base + n.to(tl.int64) * stride_kt + offs_n[None, :] * stride_kt + offs_d[:, None]
        v_ptrs = v_base + n.to(tl.int64) * stride_vt + offs_n[:, None] * stride_vt + offs_dv[None, :]
        if USE_TMA:  # rows past the sequence end belong to the next one: masked below (MASKED blocks only)
            kt = tl.trans(KD.load([k_row0 + n, h, 0]).reshape(BN, BD))
        elif MASKED:
            kt = tl.load(kt_ptrs, mask=(cols[None, :] < Lk) & (offs_d[:, None] < D), other=0.0)
        elif BD != D:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < D, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        if UPCAST:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt) * qk_scale
        if MASKED:
            ok = cols[None, :] < Lk
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None] + shift)
            if WINDOWED:
                ok = ok & (rows[:, None] + shift - cols[None, :] < window)
            qk = tl.where(ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked rows so far: keep p = 0
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            vv = VD.load([k_row0 + n, h, 0]).reshape(BN, BDV)
        elif MASKED:
            vv = tl.load(v_ptrs, mask=(cols[:, None] < Lk) & (offs_dv[None, :] < DV), other=0.0)
        elif BDV != DV:
            vv = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
        else:
            vv = tl.load(v_ptrs)
        if UPCAST:
            acc = tl.dot(p, vv.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(vv.dtype), vv, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def jfa_fwd_kernel(Q, K, V, O, LSE, QOFF, KOFF, ITEMS, KD, VD, n_items_cap, Tq, qk_scale, window,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr):
    pid = tl.program_id(0)
    item = pid // H
    h = pid % H
    b = tl.load(ITEMS + item)
    if b < 0:
        return
    mblk = tl.load(ITEMS + n_items_cap + item)
    q_start = tl.load(QOFF + b)
    Lq = (tl.load(QOFF + b + 1) - q_start).to(tl.int32)
    k_start = tl.load(KOFF + b)
    Lk = (tl.load(KOFF + b + 1) - k_start).to(tl.int32)
    shift = Lk - Lq

    m_lo = mblk * BM
    m_last = tl.minimum(m_lo + BM, Lq) - 1
    offs_m = tl.arange(0, BM)
    rows = m_lo + offs_m
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)

    q_base = Q + (q_start + m_lo) * stride_qt + h * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=(rows[:, None] < Lq) & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + k_start * stride_kt + h * stride_kh
    v_base = V + k_start * stride_vt + h * stride_vh
    k_row0 = k_start.to(tl.int32)

    # keys any row of this block may see: [lo, hi); fully-allowed blocks: [full_lo, full_hi)
    hi = Lk
    if CAUSAL:
        hi = tl.minimum(hi, m_last + shift + 1)
    lo = 0
    full_lo = 0
    if WINDOWED:
        lo = tl.maximum(m_lo + shift - window + 1, 0)
        full_lo = _ceil_to(tl.maximum(m_last + shift - window + 1, 0), BN)
    lo = (lo // BN) * BN
    hi = tl.maximum(hi, lo)
    full_hi = Lk
    if CAUSAL:
        full_hi = tl.minimum(full_hi, m_lo + shift + 1)
    full_hi = (tl.maximum(full_hi, 0) // BN) * BN
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, full_lo, rows, Lk,
                               shift, window, qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h, D, DV, BD,
                               BDV, BN, True, CAUSAL, WINDOWED, UPCAST, USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, full_lo, full_hi, rows,
                               Lk, shift, window, qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h, D, DV,
                               BD, BDV, BN, False, CAUSAL, WINDOWED, UPCAST, USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, full_hi, hi, rows, Lk,
                               shift, window, qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h, D, DV, BD,
                               BDV, BN, True, CAUSAL, WINDOWED, UPCAST, USE_TMA)

    empty = l_i == 0.0  # no allowed key: output 0, lse +inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    o_base = O + (q_start + m_lo) * stride_ot + h * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=(rows[:, None] < Lq) & (offs_dv[None, :] < DV))
    tl.store(LSE + h.to(tl.int64) * Tq + q_start + rows, lse, mask=rows < Lq)


@triton.jit
def jfa_bwd_preprocess(O, DO, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh,
                       DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr):
    """delta[h, t] = sum_d o[t, h, d] * do[t, h, d] in fp32."""
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
                shift, window, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, h,
                D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr,
                USE_TMA: tl.constexpr):
    for m in range(start, end, BM):
        m = tl.multiple_of(m, BM)
        rows = m + offs_m
        qt_ptrs = q_base + m.to(tl.int64) * stride_qt + offs_m[None, :] * stride_qt + offs_d[:, None]
        do_ptrs = do_base + m.to(tl.int64) * stride_dot + offs_m[:, None] * stride_dot + offs_dv[None, :]
        if USE_TMA:  # rows past the sequence end belong to the next one: their p is masked to 0
            qt = tl.trans(QD.load([q_row0 + m, h, 0]).reshape(BM, BD))
            do = DOD.load([q_row0 + m, h, 0]).reshape(BM, BDV)
            if MASKED:
                lse = tl.load(lse_base + rows, mask=rows < Lq, other=float("inf"))
                delta = tl.load(delta_base + rows, mask=rows < Lq, other=0.0)
            else:
                lse = tl.load(lse_base + rows)
                delta = tl.load(delta_base + rows)
        elif MASKED:
            qt = tl.load(qt_ptrs, mask=(rows[None, :] < Lq) & (offs_d[:, None] < D), other=0.0)
            do = tl.load(do_ptrs, mask=(rows[:, None] < Lq) & (offs_dv[None, :] < DV), other=0.0)
            lse = tl.load(lse_base + rows, mask=rows < Lq, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < Lq, other=0.0)
        else:
            if BD != D:
                qt = tl.load(qt_ptrs, mask=offs_d[:, None] < D, other=0.0)
            else:
                qt = tl.load(qt_ptrs)
            if BDV != DV:
                do = tl.load(do_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                do = tl.load(do_ptrs)
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        if UPCAST:
            qt = qt.to(tl.float32)
            do = do.to(tl.float32)
        qkt = tl.dot(k, qt)  # [BN, BM]
        pt = tl.math.exp2(qkt * qk_scale - lse[None, :])
        if MASKED:
            ok = rows[None, :] < Lq
            if CAUSAL:
                ok = ok & (cols[:, None] <= rows[None, :] + shift)
            if WINDOWED:
                ok = ok & (rows[None, :] + shift - cols[:, None] < window)
            pt = tl.where(ok, pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, tl.trans(do))  # [BN, BM]
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk)
    return dk, dv


@triton.jit
def jfa_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_, QOFF, KOFF, ITEMS, QD, DOD, n_items_cap, Tq, qk_scale,
                        sm_scale,
                        window, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                        H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr,
                        CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr):
    pid = tl.program_id(0)
    item = pid // H
    h = pid % H
    b = tl.load(ITEMS + item)
    if b < 0:
        return
    nblk = tl.load(ITEMS + n_items_cap + item)
    q_start = tl.load(QOFF + b)
    Lq = (tl.load(QOFF + b + 1) - q_start).to(tl.int32)
    k_start = tl.load(KOFF + b)
    Lk = (tl.load(KOFF + b + 1) - k_start).to(tl.int32)
    shift = Lk - Lq

    n_lo = nblk * BN
    n_last = tl.minimum(n_lo + BN, Lk) - 1
    offs_n = tl.arange(0, BN)
    cols = n_lo + offs_n
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)

    kmask = cols[:, None] < Lk
    k = tl.load(K + (k_start + n_lo) * stride_kt + h * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                mask=kmask & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + (k_start + n_lo) * stride_vt + h * stride_vh + offs_n[:, None] * stride_vt + offs_dv[None, :],
                mask=kmask & (offs_dv[None, :] < DV), other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    # queries that may see a key of this block: [lo, hi); fully-allowed query blocks: [full_lo, full_hi)
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = tl.maximum(n_lo - shift, 0)
        full_lo = _ceil_to(tl.maximum(n_last - shift, 0), BM)
    lo = (lo // BM) * BM
    hi = Lq
    full_hi = Lq
    if WINDOWED:
        hi = tl.minimum(hi, n_last - shift + window)
        full_hi = tl.minimum(full_hi, n_lo - shift + window)
    hi = tl.maximum(hi, lo)
    full_hi = (tl.maximum(full_hi, 0) // BM) * BM
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)

    q_base = Q + q_start * stride_qt + h * stride_qh
    do_base = DO + q_start * stride_dot + h * stride_doh
    lse_base = LSE + h.to(tl.int64) * Tq + q_start
    delta_base = DELTA + h.to(tl.int64) * Tq + q_start
    q_row0 = q_start.to(tl.int32)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, lo, full_lo,
                         cols, Lq, shift, window, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, h, D, DV, BD,
                         BDV, BM, True, CAUSAL, WINDOWED, UPCAST, USE_TMA)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, full_lo,
                         full_hi, cols, Lq, shift, window, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, h, D,
                         DV, BD, BDV, BM, False, CAUSAL, WINDOWED, UPCAST, USE_TMA)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, full_hi, hi,
                         cols, Lq, shift, window, qk_scale, offs_m, offs_d, offs_dv, QD, DOD, q_row0, h, D, DV, BD,
                         BDV, BM, True, CAUSAL, WINDOWED, UPCAST, USE_TMA)
    dk = dk * sm_scale
    tl.store(DK + (k_start + n_lo) * stride_dkt + h * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kmask & (offs_d[None, :] < D))
    tl.store(DV_ + (k_start + n_lo) * stride_dvt + h * stride_dvh + offs_n[:, None] * stride_dvt + offs_dv[None, :],
             dv.to(DV_.dtype.element_ty), mask=kmask & (offs_dv[None, :] < DV))


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, start, end, rows, Lk, shift, window,
              qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h,
              D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr,
              USE_TMA: tl.constexpr):
    for n in range(start, end, BN):
        n = tl.multiple_of(n, BN)
        cols = n + offs_n
        kt_ptrs = k_base + n.to(tl.int64) * stride_kt + offs_n[None, :] * stride_kt + offs_d[:, None]
        vt_ptrs = v_base + n.to(tl.int64) * stride_vt + offs_n[None, :] * stride_vt + offs_dv[:, None]
        if USE_TMA:  # rows past the sequence end belong to the next one: their p is masked to 0
            kt = tl.trans(KD.load([k_row0 + n, h, 0]).reshape(BN, BD))
            vt = tl.trans(VD.load([k_row0 + n, h, 0]).reshape(BN, BDV))
        elif MASKED:
            kt = tl.load(kt_ptrs, mask=(cols[None, :] < Lk) & (offs_d[:, None] < D), other=0.0)
            vt = tl.load(vt_ptrs, mask=(cols[None, :] < Lk) & (offs_dv[:, None] < DV), other=0.0)
        else:
            if BD != D:
                kt = tl.load(kt_ptrs, mask=offs_d[:, None] < D, other=0.0)
            else:
                kt = tl.load(kt_ptrs)
            if BDV != DV:
                vt = tl.load(vt_ptrs, mask=offs_dv[:, None] < DV, other=0.0)
            else:
                vt = tl.load(vt_ptrs)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        qk = tl.dot(q, kt)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            ok = cols[None, :] < Lk
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None] + shift)
            if WINDOWED:
                ok = ok & (rows[:, None] + shift - cols[None, :] < window)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, vt)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
    return dq


@triton.jit
def jfa_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, QOFF, KOFF, ITEMS, KD, VD, n_items_cap, Tq, qk_scale, sm_scale,
                      window,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                      stride_dqt, stride_dqh,
                      H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr,
                      CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr):
    pid = tl.program_id(0)
    item = pid // H
    h = pid % H
    b = tl.load(ITEMS + item)
    if b < 0:
        return
    mblk = tl.load(ITEMS + n_items_cap + item)
    q_start = tl.load(QOFF + b)
    Lq = (tl.load(QOFF + b + 1) - q_start).to(tl.int32)
    k_start = tl.load(KOFF + b)
    Lk = (tl.load(KOFF + b + 1) - k_start).to(tl.int32)
    shift = Lk - Lq

    m_lo = mblk * BM
    m_last = tl.minimum(m_lo + BM, Lq) - 1
    offs_m = tl.arange(0, BM)
    rows = m_lo + offs_m
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    rmask = rows < Lq

    q = tl.load(Q + (q_start + m_lo) * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + (q_start + m_lo) * stride_dot + h * stride_doh + offs_m[:, None] * stride_dot
                 + offs_dv[None, :], mask=rmask[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + h.to(tl.int64) * Tq + q_start + rows, mask=rmask, other=float("inf"))
    delta = tl.load(DELTA + h.to(tl.int64) * Tq + q_start + rows, mask=rmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    k_base = K + k_start * stride_kt + h * stride_kh
    v_base = V + k_start * stride_vt + h * stride_vh
    k_row0 = k_start.to(tl.int32)

    hi = Lk
    if CAUSAL:
        hi = tl.minimum(hi, m_last + shift + 1)
    lo = 0
    full_lo = 0
    if WINDOWED:
        lo = tl.maximum(m_lo + shift - window + 1, 0)
        full_lo = _ceil_to(tl.maximum(m_last + shift - window + 1, 0), BN)
    lo = (lo // BN) * BN
    hi = tl.maximum(hi, lo)
    full_hi = Lk
    if CAUSAL:
        full_hi = tl.minimum(full_hi, m_lo + shift + 1)
    full_hi = (tl.maximum(full_hi, 0) // BN) * BN
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)

    dq = tl.zeros([BM, BD], tl.float32)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, full_lo, rows, Lk, shift, window,
                   qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h, D, DV, BD, BDV, BN, True, CAUSAL, WINDOWED,
                   UPCAST, USE_TMA)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_lo, full_hi, rows, Lk, shift,
                   window, qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h, D, DV, BD, BDV, BN, False, CAUSAL,
                   WINDOWED, UPCAST, USE_TMA)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_hi, hi, rows, Lk, shift, window,
                   qk_scale, offs_n, offs_d, offs_dv, KD, VD, k_row0, h, D, DV, BD, BDV, BN, True, CAUSAL, WINDOWED,
                   UPCAST, USE_TMA)
    dq = dq * sm_scale
    tl.store(DQ + (q_start + m_lo) * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=rmask[:, None] & (offs_d[None, :] < D))
