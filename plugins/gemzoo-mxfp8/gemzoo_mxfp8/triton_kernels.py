"""Triton kernels for MXFP8: the fused cast (rowwise + columnwise-transposed, optional RHT), dequantize,
and the MX GEMM that dequantizes MX tiles in registers into bf16 MMA with fp32 accumulation.

Numerics follow gemzoo.mx (the bit-exact rule). Dequantized values e4m3 * 2^(e-127) are exact in bf16
(4 significant bits, power-of-two scale), and bf16 x bf16 products are exact in fp32, so the GEMM gives
the MX result with fp32 accumulation; only the summation order is the kernel's own.

Under TRITON_INTERPRET=1 (CPU) bf16 arithmetic is wrong, so kernels take ``F32: tl.constexpr`` and then
compute in fp32 (exact too) instead of bf16.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

TL_ELEM = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
ELEM_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
ELEM_MANT = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}  # mantissa bits
ELEM_EMIN = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}  # smallest normal exponent


# --------------------------------------------------------------------------------------------- helpers
@triton.jit
def _mx_exponent(amax, has_nan, EMAX: tl.constexpr):
    """Biased e8m0 exponent (int32) of fp32 block maxima: RCEIL of amax / EMAX, clamped; NaN -> 255."""
    v = tl.math.div_rn(amax, EMAX)  # IEEE division (plain `/` is approximate on GPU)
    bits = v.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = e + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(e, 254)
    return tl.where(has_nan, 255, e)


@triton.jit
def _pow2_f32(e):
    """2^(e-127) in fp32 for int32 e in [0, 255] (e=0 is the subnormal 2^-127; 255 is NaN)."""
    s = (e << 23).to(tl.float32, bitcast=True)
    s = tl.where(e == 0, tl.full(e.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True), s)
    return tl.where(e == 255, float("nan"), s)


@triton.jit
def _inv_scale(e):
    """1 / 2^(e-127) = 2^(127-e) in fp32, NaN for e=255."""
    return tl.where(e == 255, float("nan"), _pow2_f32(254 - e))


@triton.jit
def _round_to_elem(y, ELEM: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Bits (uint8) of fp32 y (|y| <= the element max) rounded to the nearest-even value of ELEM.

    Done by hand with the (y + M) - M trick because the interpreter's fp8 cast drops the carry when
    rounding crosses a power of two (CPU tests only: on the H200 this variant was not exact).
    """
    a = tl.abs(y)
    ex = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_e = tl.maximum(ex, EMIN) - MANT
    big = ((ulp_e + 23 + 127) << 23).to(tl.float32, bitcast=True)  # ulp * 2^23
    r = (a + big) - big
    bits = r.to(ELEM).to(tl.uint8, bitcast=True)
    sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)  # sign kept for zeros too
    return tl.where(y != y, 0x7F, bits | sign).to(tl.uint8)  # NaN -> 0x7F, as torch


@triton.jit
def _quantize(y, ELEM: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, ROUND: tl.constexpr):
    """fp32 y -> ELEM values, round to nearest even. ROUND 0: by hand with bit assembly (for the
    interpreter, whose fp8 cast drops carries, -0 and NaN); 2: the hardware cast (cvt.rn.satfinite)."""
    if ROUND == 0:
        return _round_to_elem(y, ELEM, MANT, EMIN).to(ELEM, bitcast=True)
    else:
        return y.to(ELEM, fp_downcast_rounding="rtne")


# ------------------------------------------------------------------------------------------------ cast
# Columns per program of the cast kernel (rows are always one MX block of 32). Memory-bound, so one
# fixed config; bench_mxfp8.py sweeps it and the README records the sweep.
CAST_CONFIG = {"BC": 64, "num_warps": 4} if INTERPRET else {"BC": 128, "num_warps": 4}
# Kernel variants (see _quantize and ROW_SPLIT). On the H200 (Triton 3.6) the native cast (ROUND=2) was
# checked bit-exact by bench_mxfp8.py with both ROW_SPLIT values; the reshape (ROW_SPLIT=0) is faster
# (rowwise 3.5 against 2.0 TB/s). Hand rounding was not exact there. The interpreter needs ROUND=0: its
# own fp8 cast drops carries, -0 and NaN.
# COL_MMA=1 routes the columnwise path of bf16 inputs through an exact int8 identity MMA per byte (see
# the kernel): bit-exact on the H200 and 1.8x faster there. COL_T=1 transposes the tile explicitly
# instead; it measured no faster. bench_mxfp8.py checks and times both.
CAST_VARIANT = ({"ROUND": 0, "ROW_SPLIT": 0, "COL_MMA": 0, "COL_T": 0} if INTERPRET else
                {"ROUND": 2, "ROW_SPLIT": 0, "COL_MMA": 1, "COL_T": 0})


@triton.jit(do_not_specialize=("R",))
def _mx_cast_kernel(
    x_ptr, R, C, stride_xr, stride_xc,
    rq_ptr, rs_ptr, rdq_ptr,          # rowwise: data [R, C], scale [R, ceil(C/32)], dequantized [R, C]
    cq_ptr, cs_ptr, cdq_ptr, RP,      # columnwise: data [C, RP], scale [C, RP/32], dequant [C, RP] (transposed)
                                      # or, with COL_NAT, data [RP, C], scale [RP/32, C], dequant [RP, C]
    h_ptr, h_mult,                    # RHT for the columnwise outputs: [32, 32] block-diagonal +-1 matrix
    ROW_Q: tl.constexpr, ROW_DQ: tl.constexpr, COL_Q: tl.constexpr, COL_DQ: tl.constexpr,
    RHT: tl.constexpr, EMAX: tl.constexpr, ELEM: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    F32: tl.constexpr, IN_BF16: tl.constexpr, ROUND: tl.constexpr, ROW_SPLIT: tl.constexpr,
    COL_MMA: tl.constexpr, COL_T: tl.constexpr, COL_NAT: tl.constexpr, BC: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * 32 + tl.arange(0, 32)
    cols = pid_c * BC + tl.arange(0, BC)
    rmask = rows < R
    cmask = cols < C
    m2 = rmask[:, None] & cmask[None, :]
    x_raw = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=m2, other=0)
    if IN_BF16:  # bf16 arrives as int16 bits: widen exactly (the interpreter flushes bf16 subnormals)
        x = (x_raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x_raw.to(tl.float32)
    nsb: tl.constexpr = BC // 32

    n_sb = (C + 31) // 32
    if ROW_Q or ROW_DQ:
        if ROW_SPLIT:  # one [32, 32] MX block column at a time: no reshapes
            for j in tl.static_range(BC // 32):
                cj = pid_c * BC + j * 32 + tl.arange(0, 32)
                mj = rmask[:, None] & (cj < C)[None, :]
                xr = tl.load(x_ptr + rows[:, None] * stride_xr + cj[None, :] * stride_xc, mask=mj, other=0)
                if IN_BF16:
                    xj = (xr.to(tl.int32) << 16).to(tl.float32, bitcast=True)
                else:
                    xj = xr.to(tl.float32)
                amax = tl.max(tl.abs(xj), axis=1)
                nan = tl.max((xj != xj).to(tl.int32), axis=1) > 0
                e = _mx_exponent(amax, nan, EMAX)
                q = _quantize(xj * _inv_scale(e)[:, None], ELEM, MANT, EMIN, ROUND)
                sb = pid_c * nsb + j
                if ROW_Q:
                    tl.store(rq_ptr + rows[:, None] * C + cj[None, :], q, mask=mj)
                    tl.store(rs_ptr + rows * n_sb + sb, e.to(tl.uint8), mask=rmask & (sb < n_sb))
                if ROW_DQ:
                    dq = q.to(tl.float32) * _pow2_f32(e)[:, None]
                    tl.store(rdq_ptr + rows[:, None] * C + cj[None, :], dq.to(rdq_ptr.dtype.element_ty), mask=mj)
        else:
            x3 = tl.reshape(x, [32, nsb, 32])
            amax = tl.max(tl.abs(x3), axis=2)
            nan = tl.max((x3 != x3).to(tl.int32), axis=2) > 0
            e = _mx_exponent(amax, nan, EMAX)
            y = tl.reshape(x3 * _inv_scale(e)[:, :, None], [32, BC])
            q = _quantize(y, ELEM, MANT, EMIN, ROUND)
            sblocks = pid_c * nsb + tl.arange(0, nsb)
            if ROW_Q:
                tl.store(rq_ptr + rows[:, None] * C + cols[None, :], q, mask=m2)
                tl.store(rs_ptr + rows[:, None] * n_sb + sblocks[None, :], e.to(tl.uint8),
                         mask=rmask[:, None] & (sblocks < n_sb)[None, :])
            if ROW_DQ:
                dq = tl.reshape(tl.reshape(q.to(tl.float32), [32, nsb, 32]) * _pow2_f32(e)[:, :, None], [32, BC])
                tl.store(rdq_ptr + rows[:, None] * C + cols[None, :], dq.to(rdq_ptr.dtype.element_ty), mask=m2)

    if COL_Q or COL_DQ:
        xc = x
        if COL_MMA and not RHT and IN_BF16:
            # Exact transpose-friendly copy: an int8 identity MMA on each byte of x's bf16 bits (int32
            # accumulation is exact for any bytes, so NaN, inf, -0 and subnormals survive). Its output
            # layout makes the reduction over rows and the store much cheaper (H200: 2.2 against 1.2 TB/s).
            # fp32 inputs skip it: there it measured no faster.
            eye = (tl.arange(0, 32)[:, None] == tl.arange(0, 32)[None, :]).to(tl.int8)
            b = x_raw.to(tl.int32)
            hi = tl.dot(eye, (b >> 8).to(tl.int8), out_dtype=tl.int32)
            lo = tl.dot(eye, b.to(tl.int8), out_dtype=tl.int32)
            xc = (((hi & 0xFF) << 24) | ((lo & 0xFF) << 16)).to(tl.float32, bitcast=True)
        if RHT:
            h = tl.load(h_ptr + tl.arange(0, 32)[:, None] * 32 + tl.arange(0, 32)[None, :])
            if F32 or not IN_BF16:  # fp32 inputs keep fp32 sums
                xc = tl.dot(h.to(tl.float32), x, input_precision="ieee") * h_mult
            else:  # +-1 times bf16 is exact; fp32 accumulation on the tensor cores
                xc = tl.dot(h.to(tl.bfloat16), x.to(tl.bfloat16)) * h_mult
        prow = rows < RP  # padded rows are written too (zeros, or RHT mixes) so RP % 32 == 0 is dense
        if COL_T:  # transpose first: reductions within a row and stores along the contiguous last dim
            xt = tl.trans(xc)  # [BC, 32]
            amax = tl.max(tl.abs(xt), axis=1)
            nan = tl.max((xt != xt).to(tl.int32), axis=1) > 0
            e = _mx_exponent(amax, nan, EMAX)
            q = _quantize(xt * _inv_scale(e)[:, None], ELEM, MANT, EMIN, ROUND)
            offs = rows[None, :] * C + cols[:, None] if COL_NAT else cols[:, None] * RP + rows[None, :]
            m_t = cmask[:, None] & prow[None, :]
            scale_f = _pow2_f32(e)[:, None]
        else:
            amax = tl.max(tl.abs(xc), axis=0)
            nan = tl.max((xc != xc).to(tl.int32), axis=0) > 0
            e = _mx_exponent(amax, nan, EMAX)
            q = _quantize(xc * _inv_scale(e)[None, :], ELEM, MANT, EMIN, ROUND)
            offs = rows[:, None] * C + cols[None, :] if COL_NAT else cols[None, :] * RP + rows[:, None]
            m_t = prow[:, None] & cmask[None, :]
            scale_f = _pow2_f32(e)[None, :]
        if COL_Q:
            tl.store(cq_ptr + offs, q, mask=m_t)
            s_offs = pid_r * C + cols if COL_NAT else cols * (RP // 32) + pid_r
            tl.store(cs_ptr + s_offs, e.to(tl.uint8), mask=cmask)
        if COL_DQ:
            dq = q.to(tl.float32) * scale_f
            tl.store(cdq_ptr + offs, dq.to(cdq_ptr.dtype.element_ty), mask=m_t)


def hadamard_sign_matrix(signs: torch.Tensor, block: int, device) -> tuple[torch.Tensor, float]:
    """[32, 32] block-diagonal matrix M (+-1 entries) and multiplier c with c*M = blockdiag(H diag(signs))."""
    return _hadamard_sign_matrix(tuple(signs.tolist()), block, str(device))


@functools.lru_cache(maxsize=64)
def _hadamard_sign_matrix(signs: tuple, block: int, device: str):
    from gemzoo_mxfp8.rht import hadamard_matrix

    h = hadamard_matrix(block, normalized=False) * torch.tensor(signs).float().view(1, -1)  # H diag(s), +-1
    m = torch.block_diag(*([h] * (32 // block)))
    return m.to(device=device, dtype=torch.float32).contiguous(), block ** -0.5


def cast_buffers(x: torch.Tensor, *, row_q=False, row_dq=False, col_q=False, col_dq=False,
                 elem=torch.float8_e4m3fn, dq_dtype=torch.bfloat16, col_layout: str = "t") -> list[torch.Tensor]:
    """mx_cast's six outputs, allocated (row data, row scale, row dq, col data, col scale, col dq); the ones
    not asked for are distinct empty tensors. Shared with the custom op's fake implementation."""
    if col_layout not in ("t", "n"):
        raise ValueError(f"col_layout must be 't' (transposed) or 'n' (x's layout), got {col_layout!r}")
    R, C = x.shape
    RP = -(-R // 32) * 32
    cshape, sshape = ((RP, C), (RP // 32, C)) if col_layout == "n" else ((C, RP), (C, RP // 32))
    shapes = [((R, C), elem, row_q), ((R, -(-C // 32)), torch.uint8, row_q), ((R, C), dq_dtype, row_dq),
              (cshape, elem, col_q), (sshape, torch.uint8, col_q), (cshape, dq_dtype, col_dq)]
    return [torch.empty(shape if wanted else (0,), device=x.device, dtype=dtype) for shape, dtype, wanted in shapes]


def mx_cast(x: torch.Tensor, *, row_q=False, row_dq=False, col_q=False, col_dq=False,
            elem=torch.float8_e4m3fn, rht: tuple[torch.Tensor, float] | None = None,
            dq_dtype=torch.bfloat16, col_layout: str = "t", config: dict | None = None,
            variant: dict | None = None):
    """One pass over a 2-D x. Returns a dict with the outputs asked for:
    row: (data [R, C], scale uint8 [R, ceil(C/32)]), row_dq [R, C];
    col: x quantized along R, with RP = R rounded up to 32 (padded rows quantize to zero). With
    col_layout "t" (transposed): (data [C, RP], scale uint8 [C, RP/32]), col_dq [C, RP]; with "n" (x's own
    layout, the cheaper store): (data [RP, C], scale uint8 [RP/32, C]), col_dq [RP, C].
    ``rht`` = hadamard_sign_matrix(...) applies the RHT along R first."""
    if x.dim() != 2:
        raise ValueError(f"mx_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    flags = dict(row_q=row_q, row_dq=row_dq, col_q=col_q, col_dq=col_dq)
    buffers = cast_buffers(x, **flags, elem=elem, dq_dtype=dq_dtype, col_layout=col_layout)
    launch_cast(x, buffers, **flags, elem=elem, rht=rht, col_layout=col_layout, config=config, variant=variant)
    return cast_outputs(buffers, **flags)


def cast_outputs(buffers: list[torch.Tensor], *, row_q, row_dq, col_q, col_dq) -> dict:
    """The dict mx_cast returns, from the six buffers: only the outputs asked for."""
    rq, rs, rdq, cq, cs, cdq = buffers
    wanted = {"row": (row_q, (rq, rs)), "row_dq": (row_dq, rdq), "col": (col_q, (cq, cs)), "col_dq": (col_dq, cdq)}
    return {name: value for name, (asked, value) in wanted.items() if asked}


def launch_cast(x: torch.Tensor, buffers: list[torch.Tensor], *, row_q, row_dq, col_q, col_dq, elem, rht=None,
                col_layout="t", config=None, variant=None) -> None:
    """Run the cast kernel over x into ``buffers`` (from cast_buffers)."""
    R, C = x.shape
    if R == 0 or C == 0:
        return
    rq, rs, rdq, cq, cs, cdq = buffers
    h, mult = rht if rht is not None else (torch.empty(0, device=x.device), 1.0)
    cfg = config or CAST_CONFIG
    grid = (triton.cdiv(R, 32), triton.cdiv(C, cfg["BC"]))
    in_bf16 = x.dtype == torch.bfloat16
    _mx_cast_kernel[grid](
        x.view(torch.int16) if in_bf16 else x, R, C, x.stride(0), x.stride(1), rq, rs, rdq, cq, cs, cdq,
        triton.cdiv(R, 32) * 32, h, mult,
        ROW_Q=row_q, ROW_DQ=row_dq, COL_Q=col_q, COL_DQ=col_dq, RHT=rht is not None,
        EMAX=ELEM_MAX[elem], ELEM=TL_ELEM[elem], MANT=ELEM_MANT[elem], EMIN=ELEM_EMIN[elem],
        F32=INTERPRET, IN_BF16=in_bf16, COL_NAT=col_layout == "n", **{**CAST_VARIANT, **(variant or {})}, **cfg,
    )


# ------------------------------------------------------------------------------------------- dequantize
@triton.jit(do_not_specialize=("R",))
def _mx_dequant_kernel(q_ptr, s_ptr, out_ptr, R, C, stride_qr, stride_sr, AXIS0: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m2 = (rows < R)[:, None] & (cols < C)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qr + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if AXIS0:  # blocks of 32 rows: scale [ceil(R/32), C]
        s_offs = (rows // 32)[:, None] * stride_sr + cols[None, :]
    else:  # blocks of 32 columns: scale [R, ceil(C/32)]
        s_offs = rows[:, None] * stride_sr + (cols // 32)[None, :]
    e = tl.load(s_ptr + s_offs, mask=m2, other=127).to(tl.int32)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], (q * _pow2_f32(e)).to(out_ptr.dtype.element_ty), mask=m2)


def mx_dequant(data: torch.Tensor, scale_u8: torch.Tensor, dtype=torch.float32, axis: int = -1) -> torch.Tensor:
    """Dequantize 2-D data [R, C] (last dim contiguous) with uint8 scales [R, ceil(C/32)] (axis -1, blocks
    along C) or [ceil(R/32), C] (axis 0, blocks along R)."""
    R, C = data.shape
    out = torch.empty(R, C, device=data.device, dtype=dtype)
    if R and C:
        grid = (triton.cdiv(R, 32), triton.cdiv(C, 128))
        _mx_dequant_kernel[grid](data, scale_u8, out, R, C, data.stride(0), scale_u8.stride(0), AXIS0=axis == 0,
                                 BR=32, BC=128)
    return out


# ------------------------------------------------------------------------------------------------ GEMM
@triton.jit
def _pow2_bf16(e):
    """e8m0 byte (int32) -> bf16 2^(e-127): exponent field = e (0 -> subnormal 2^-127, 255 -> NaN)."""
    b = e << 7
    b = tl.where(e == 0, 0x0040, b)
    b = tl.where(e == 255, 0x7FC0, b)
    return b.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_tile(q, e, BR: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """[BR, BK] fp8 tile and [BR, BK/32] exponents -> dequantized tile (bf16 on GPU, fp32 interpreted)."""
    if F32:
        s = _pow2_f32(e)
        return tl.reshape(tl.reshape(q.to(tl.float32), [BR, BK // 32, 32]) * s[:, :, None], [BR, BK])
    else:
        s = _pow2_bf16(e)
        return tl.reshape(tl.reshape(q.to(tl.bfloat16), [BR, BK // 32, 32]) * s[:, :, None], [BR, BK])


@triton.jit
def _load_scales(s_ptr, rows, rmask, stride, k0, n_sk, BK: tl.constexpr):
    """[R, BK/32] int32 exponents of the K step starting at k0 (127, i.e. 1.0, outside)."""
    ks = k0 // 32 + tl.arange(0, BK // 32)
    return tl.load(s_ptr + rows[:, None] * stride + ks[None, :], mask=rmask[:, None] & (ks < n_sk)[None, :],
                   other=127).to(tl.int32)


@triton.jit
def _scale_col(e, j: tl.constexpr, BK: tl.constexpr):
    """Column j of a [R, BK/32] register tile (a masked row sum: registers cannot be indexed)."""
    return tl.sum(tl.where(tl.arange(0, BK // 32)[None, :] == j, e, 0), axis=1)


@triton.jit
def _k_step_tile(acc, a_ptr, b_ptr, ea, eb, k0, K, rm, rn, mmask, nmask, stride_am, stride_bn,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, A_BF16: tl.constexpr):
    """One BK step: [BM, BK] / [BN, BK] tiles dequantized through a [.., BK/32, 32] reshape.
    With A_BF16, A is already the (exact) bf16 dequantization and goes to the MMA as loaded."""
    rk = tl.arange(0, BK)
    kmask = (k0 + rk) < K
    a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
    b = tl.load(b_ptr + rn[:, None] * stride_bn + (k0 + rk)[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    if A_BF16:
        if F32:
            ad = a.to(tl.float32)
        else:
            ad = a
    else:
        ad = _dequant_tile(a, ea, BM, BK, F32)
    bd = _dequant_tile(b, eb, BN, BK, F32)
    if F32:
        return tl.dot(ad, tl.trans(bd), acc, input_precision="ieee")
    return tl.dot(ad, tl.trans(bd), acc)


@triton.jit
def _k_step_blocks(acc, a_ptr, b_ptr, ea, eb, k0, K, rm, rn, mmask, nmask, stride_am, stride_bn,
                   BK: tl.constexpr, F32: tl.constexpr, A_BF16: tl.constexpr):
    """One BK step as BK/32 MX blocks: per-row scales broadcast without reshapes, K=32 dots."""
    for j in tl.static_range(BK // 32):
        kk = k0 + j * 32 + tl.arange(0, 32)
        km = kk < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :], mask=mmask[:, None] & km[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_bn + kk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
        ebj = _scale_col(eb, j, BK)
        if F32:
            bd = b.to(tl.float32) * _pow2_f32(ebj)[:, None]
            if A_BF16:
                ad = a.to(tl.float32)
            else:
                ad = a.to(tl.float32) * _pow2_f32(_scale_col(ea, j, BK))[:, None]
            acc = tl.dot(ad, tl.trans(bd), acc, input_precision="ieee")
        else:
            bd = b.to(tl.bfloat16) * _pow2_bf16(ebj)[:, None]
            if A_BF16:
                ad = a
            else:
                ad = a.to(tl.bfloat16) * _pow2_bf16(_scale_col(ea, j, BK))[:, None]
            acc = tl.dot(ad, tl.trans(bd), acc)
    return acc


def _gemm_configs():
    if INTERPRET:
        return [triton.Config({"BM": 32, "BN": 32, "BK": 64, "GROUP_M": 4, "SUB": 0}, num_warps=4, num_stages=1)]
    cfgs = []
    # checked offline with ptxas for sm_90a: no spills, no serialized wgmma (128x256x128 spills)
    for bm, bn, bk, w, s, sub in [(128, 128, 64, 8, 4, 0), (128, 256, 64, 8, 3, 0), (128, 256, 64, 8, 4, 0),
                                  (128, 128, 128, 8, 3, 0), (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1)]:
        cfgs.append(triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "SUB": sub}, num_warps=w, num_stages=s))
    return cfgs


@triton.jit(do_not_specialize=("M",))
def _mx_gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, bias_ptr, M, N, K,
    stride_am, stride_sam, stride_bn, stride_sbn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BIAS_M: tl.constexpr, F32: tl.constexpr, A_BF16: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SUB: tl.constexpr,
):
    """C[M, N] = sum_k deq(A)[m, k] deq(B)[n, k]; A, B fp8 with K contiguous, e8m0 scales per 32 along K.

    The fp8 tiles are software-pipelined by Triton (cp.async); the scale bytes are too narrow for that,
    so they are prefetched by hand one K step ahead, in registers."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gm = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gm
    pid_n = (pid % group) // gm
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    n_sk = tl.cdiv(K, 32)
    eb_next = _load_scales(sb_ptr, rn, nmask, stride_sbn, 0, n_sk, BK)
    if A_BF16:
        ea_next = eb_next  # unused
    else:
        ea_next = _load_scales(sa_ptr, rm, mmask, stride_sam, 0, n_sk, BK)
    for k0 in range(0, K, BK):
        ea = ea_next
        eb = eb_next
        eb_next = _load_scales(sb_ptr, rn, nmask, stride_sbn, k0 + BK, n_sk, BK)
        if not A_BF16:
            ea_next = _load_scales(sa_ptr, rm, mmask, stride_sam, k0 + BK, n_sk, BK)
        if SUB:
            acc = _k_step_blocks(acc, a_ptr, b_ptr, ea, eb, k0, K, rm, rn, mmask, nmask, stride_am, stride_bn,
                                 BK, F32, A_BF16)
        else:
            acc = _k_step_tile(acc, a_ptr, b_ptr, ea, eb, k0, K, rm, rn, mmask, nmask, stride_am, stride_bn,
                               BM, BN, BK, F32, A_BF16)
    if HAS_BIAS:
        if BIAS_M:
            acc += tl.load(bias_ptr + rm, mask=mmask, other=0.0).to(tl.float32)[:, None]
        else:
            acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


_mx_gemm_autotuned = triton.autotune(configs=_gemm_configs(), key=["M", "N", "K", "HAS_BIAS", "BIAS_M", "A_BF16", "stride_cn"])(_mx_gemm_kernel)


def mx_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, k: int | None = None,
            bias: torch.Tensor | None = None, out_dtype=torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """A [M, >=K] x B [N, >=K]^T over the first K columns, MX along K (uint8 scales). -> [M, N].

    ``sb=None``: B is bf16 holding the exact dequantization of an MX tensor (a weight dequantized once).
    Scales are uint8 [rows, ceil(K/32)] with a contiguous last dim.
    ``config`` (BM, BN, BK, GROUP_M, SUB, num_warps, num_stages) skips the autotuner."""
    M, N = a.shape[0], b.shape[0]
    K = a.shape[1] if k is None else k
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("mx_gemm needs the contraction dim contiguous in both operands")
    c = torch.empty(M, N, device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(M, N))
    if config is None and a.is_cuda:
        prune_gemm_configs(a.device)
    kernel = _mx_gemm_autotuned if config is None else _mx_gemm_kernel
    bias_arg = bias if bias is not None else c
    if sb is None:
        # bf16 B: compute C^T = B A^T with the bf16 operand first. Its tiles then go to the MMA straight
        # from shared memory (Triton would otherwise keep a converted first operand in registers, and
        # ptxas serializes that wgmma chain); C^T is stored transposed into C.
        grid = lambda meta: (triton.cdiv(N, meta["BM"]) * triton.cdiv(M, meta["BN"]),)  # noqa: E731
        kernel[grid](
            b, sa, a, sa, c, bias_arg, N, M, K,
            b.stride(0), 0, a.stride(0), sa.stride(0), 1, c.stride(0),
            HAS_BIAS=bias is not None, BIAS_M=True, F32=INTERPRET, A_BF16=True, **(config or {}),
        )
        return c
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
    kernel[grid](
        a, sa, b, sb, c, bias_arg, M, N, K,
        a.stride(0), sa.stride(0), b.stride(0), sb.stride(0), c.stride(0), 1,
        HAS_BIAS=bias is not None, BIAS_M=False, F32=INTERPRET, A_BF16=False, **(config or {}),
    )
    return c


_pruned: set = set()


def prune_gemm_configs(device) -> list[str]:
    """Drop autotune configs that fail to compile or run on this GPU (once per process); returns the errors."""
    key = str(device)
    if key in _pruned:
        return []
    _pruned.add(key)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(256, 256, device=device, generator=gen).to(torch.float8_e4m3fn)
    s = torch.full((256, 8), 127, device=device, dtype=torch.uint8)
    good, errors = [], []
    for cfg in _mx_gemm_autotuned.configs:
        meta = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        try:
            mx_gemm(a, s, a, s, config=meta)
            mx_gemm(a, s, a.to(torch.bfloat16), None, config=meta)
            torch.cuda.synchronize(device)
            good.append(cfg)
        except Exception as exc:  # a config this Triton/GPU cannot build: tune over the others
            errors.append(f"{meta}: {type(exc).__name__}: {str(exc)[:200]}")
    if not good:
        raise RuntimeError("no MX GEMM config compiles on this device:\n" + "\n".join(errors))
    _mx_gemm_autotuned.configs = good
    return errors


# ------------------------------------------------------------------------------- fp8-rowwise casts (GPU)
@triton.jit(do_not_specialize=("R",))
def _rowwise_q_kernel(x_ptr, q_ptr, s_ptr, camax_ptr, R, C, stride_xr,
                      COL_AMAX: tl.constexpr, ROUND: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Per-row e4m3 quantization of BR rows (scale = amax / 448), plus the per-column amax (atomic max)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    amax = tl.zeros([BR], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        m2 = rmask[:, None] & (cols < C)[None, :]
        a = tl.abs(tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :], mask=m2, other=0.0).to(tl.float32))
        amax = tl.maximum(amax, tl.max(a, axis=1))
        if COL_AMAX:
            tl.atomic_max(camax_ptr + cols, tl.max(a, axis=0), mask=cols < C)
    scale = tl.maximum(amax, 1e-12) / 448.0
    tl.store(s_ptr + rows, scale, mask=rmask)
    for c0 in range(0, C, BC):  # second pass hits L2
        cols = c0 + tl.arange(0, BC)
        m2 = rmask[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        q = _quantize(tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0), tl.float8e4nv, 3, -6, ROUND)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=m2)


@triton.jit(do_not_specialize=("R",))
def _colwise_q_kernel(x_ptr, camax_ptr, q_ptr, s_ptr, R, RP, C, stride_xr, ROUND: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr):
    """Per-column e4m3 quantization with precomputed column amax; writes the transpose q [C, RP] (rows
    from R to RP are zero padding)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    m2 = (rows < R)[:, None] & cmask[None, :]
    scale = tl.maximum(tl.load(camax_ptr + cols, mask=cmask, other=1.0), 1e-12) / 448.0
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    q = _quantize(tl.minimum(tl.maximum(x / scale[None, :], -448.0), 448.0), tl.float8e4nv, 3, -6, ROUND)
    tl.store(q_ptr + cols[None, :] * RP + rows[:, None], q, mask=(rows < RP)[:, None] & cmask[None, :])
    if tl.program_id(0) == 0:
        tl.store(s_ptr + cols, scale, mask=cmask)


def rowwise_cast(x: torch.Tensor, *, row=True, col=False, pad_to: int = 1):
    """fp8-rowwise casts of a 2-D x [R, C] (last dim contiguous) in at most two passes:
    row -> (e4m3 [R, C], fp32 scale [R, 1]); col -> (e4m3 x^T [C, RP], fp32 scale [C, 1]) quantized along R,
    with R zero-padded to RP, a multiple of ``pad_to``."""
    R, C = x.shape
    if x.stride(1) != 1:
        raise ValueError("rowwise_cast needs the last dim contiguous")
    dev = x.device
    out = {}
    camax = torch.zeros(C, device=dev, dtype=torch.float32) if col else torch.empty(0, device=dev)
    if row or col:
        q = torch.empty(R, C, device=dev, dtype=torch.float8_e4m3fn) if row else torch.empty(0, device=dev, dtype=torch.float8_e4m3fn)
        s = torch.empty(R, 1, device=dev, dtype=torch.float32)
        if row:
            _rowwise_q_kernel[(triton.cdiv(R, 16),)](x, q, s, camax, R, C, x.stride(0), COL_AMAX=col,
                                                     ROUND=CAST_VARIANT["ROUND"], BR=16, BC=256,
                                                     num_warps=4)
            out["row"] = (q, s)
        elif R:
            camax = x.abs().amax(0).float()
    if col:
        RP = triton.cdiv(R, pad_to) * pad_to or pad_to  # no tokens: one block of zeros
        qt = torch.empty(C, RP, device=dev, dtype=torch.float8_e4m3fn)
        st = torch.empty(C, 1, device=dev, dtype=torch.float32)
        _colwise_q_kernel[(triton.cdiv(RP, 64), triton.cdiv(C, 64))](x, camax, qt, st, R, RP, C, x.stride(0),
                                                                   ROUND=CAST_VARIANT["ROUND"], BR=64, BC=64,
                                                                   num_warps=4)
        out["col"] = (qt, st)
    return out


# ---------------------------------------------------------------------------- fp8-tensorwise cast (GPU)
# Tile of the tensorwise cast; memory-bound, one fixed config. bench_mxfp8.py --only tensorwise sweeps five
# (one H100, 2026-12-05, 107520 x 2560 and x 10240 bf16): 128 x 128 was the fastest, 0.995 and 3.93 ms amax
# included (the others 1.05-1.07 and 4.14-4.22; Inductor's cast 1.54 and 6.06), every one bit-identical.
TENSORWISE_CONFIG = {"BR": 32, "BC": 32, "num_warps": 4} if INTERPRET else {"BR": 128, "BC": 128, "num_warps": 8}


@triton.jit(do_not_specialize=("R", "RP"))
def _tensorwise_cast_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, R, RP, C, stride_xr, stride_xc,
                            ROW: tl.constexpr, COL: tl.constexpr, IN_BF16: tl.constexpr, FMAX: tl.constexpr,
                            ELEM: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, ROUND: tl.constexpr,
                            BR: tl.constexpr, BC: tl.constexpr):
    """One read of a [BR, BC] tile of x: x * scale (one fp32 scale for the tensor), saturated to +-FMAX and
    rounded to nearest even in ELEM, stored row-major into q [R, C] and transposed into qt [C, RP] (qt's
    columns R..RP are the zero padding). NaN stays NaN."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    m2 = (rows < R)[:, None] & cmask[None, :]
    x_raw = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=m2, other=0)
    if IN_BF16:  # bf16 arrives as int16 bits: widen exactly (the interpreter flushes bf16 subnormals)
        x = (x_raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x_raw.to(tl.float32)
    y = tl.where(m2, x * tl.load(scale_ptr), 0.0)  # the padding stays zero under a NaN or infinite scale
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))
    q = _quantize(y, ELEM, MANT, EMIN, ROUND)
    if ROW:
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=m2)
    if COL:
        tl.store(qt_ptr + cols[:, None] * RP + rows[None, :], tl.trans(q),
                 mask=cmask[:, None] & (rows < RP)[None, :])


def tensorwise_buffers(x: torch.Tensor, elem: torch.dtype, row: bool, col: bool, pad_to: int):
    """(q [R, C] or empty, qt [C, RP] or empty): RP is R rounded up to ``pad_to`` (no rows: one ``pad_to``).
    Shared with the custom op's fake implementation (R may be symbolic there)."""
    R, C = x.shape
    rp = torch.sym_max(-(-R // pad_to) * pad_to, pad_to)
    q = x.new_empty((R, C) if row else (0,), dtype=elem)
    qt = x.new_empty((C, rp) if col else (0,), dtype=elem)
    return q, qt


def tensorwise_cast(x: torch.Tensor, scale: torch.Tensor, elem: torch.dtype = torch.float8_e4m3fn, *,
                    row: bool = True, col: bool = False, pad_to: int = 1, config: dict | None = None):
    """fp8-tensorwise casts of a 2-D x [R, C] in one pass, given its fp32 0-dim ``scale`` (fp8_max / amax):
    (row-major data [R, C], transposed data [C, RP] along R zero-padded to a multiple of ``pad_to``), each an
    empty tensor when not asked for. Bit-identical to ``tensorwise.quantize_tensorwise`` with that scale."""
    if x.dim() != 2:
        raise ValueError(f"tensorwise_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    if elem not in TL_ELEM:
        raise ValueError(f"elem must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem}")
    q, qt = tensorwise_buffers(x, elem, row, col, pad_to)
    R, C = x.shape
    RP = qt.shape[1] if col else R
    if not (row or col) or C == 0 or max(R, RP) == 0:
        return q, qt
    cfg = dict(config or TENSORWISE_CONFIG)
    br, bc = cfg.pop("BR"), cfg.pop("BC")
    in_bf16 = x.dtype == torch.bfloat16
    xs = x.view(torch.int16) if in_bf16 else x
    grid = (triton.cdiv(max(R, RP), br), triton.cdiv(C, bc))
    _tensorwise_cast_kernel[grid](xs, scale, q, qt, R, RP, C, x.stride(0), x.stride(1), ROW=row, COL=col,
                                  IN_BF16=in_bf16, FMAX=ELEM_MAX[elem], ELEM=TL_ELEM[elem], MANT=ELEM_MANT[elem],
                                  EMIN=ELEM_EMIN[elem], ROUND=CAST_VARIANT["ROUND"], BR=br, BC=bc, **cfg)
    return q, qt
