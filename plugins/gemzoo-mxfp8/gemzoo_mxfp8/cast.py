"""MX casts: ``quantize_mx`` / ``dequantize_mx`` (public) and ``cast2d`` (the fused multi-output cast the
linear uses). CUDA tensors go to the Triton kernels, CPU tensors to ``gemzoo.api.quantize_mx`` (C++ when
built) or the plain-torch rule ``gemzoo.api.quantize_mx_torch``; both are bit-identical to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemzoo import api

ELEMS = (torch.float8_e4m3fn, torch.float8_e5m2)

# Tests set this under TRITON_INTERPRET=1 to run the GPU code paths (Triton kernels) on CPU tensors.
FORCE_TRITON = False


def on_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or FORCE_TRITON


def _check_elem(elem):
    if elem not in ELEMS:
        raise ValueError(f"elem must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem}")


def _use_triton(x: torch.Tensor, block: int) -> bool:
    return x.is_cuda and block == 32


def quantize_mx(x: torch.Tensor, axis: int = -1, block: int = 32, elem: torch.dtype = torch.float8_e4m3fn):
    """(data [x's shape, elem], scale [ceil(n/block) along axis, float8_e8m0fnu]); OCP MX with RCEIL scales."""
    _check_elem(elem)
    if not x.is_floating_point():
        raise TypeError(f"quantize_mx needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize_mx needs at least one dimension")
    axis = axis % x.dim()
    if not _use_triton(x, block):
        return api.quantize_mx(x, axis, block, elem) if not x.is_cuda else \
            api.quantize_mx_torch(x, axis=axis, block=block, elem=elem)
    from gemzoo_mxfp8.ops import cast_op

    n = x.shape[axis]
    if axis == x.dim() - 1:  # rowwise
        x2 = x.reshape(-1, n)
        data, scale = cast_op(x2, row_q=True, elem=elem)["row"]
        return data.view(x.shape), scale.view(*x.shape[:-1], -1).view(torch.float8_e8m0fnu)
    # columnwise: view as [n, rest] and let the kernel quantize along n, written in that same layout
    moved = x.movedim(axis, 0)
    x2 = moved.reshape(n, -1)
    data_n, scale_n = cast_op(x2, col_q=True, elem=elem, col_layout="n")["col"]  # [n_pad, rest], [n_pad/32, rest]
    data = data_n[:n].reshape(moved.shape).movedim(0, axis)
    scale = scale_n.reshape(-1, *moved.shape[1:]).movedim(0, axis)
    return data, scale.view(torch.float8_e8m0fnu)


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor, axis: int = -1, block: int = 32,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_mx: data * 2^(e - 127) per block (NaN for the NaN scale)."""
    axis = axis % data.dim()
    if not _use_triton(data, block):
        if data.is_cuda:
            return api.dequantize_mx_torch(data, scale, axis=axis, block=block, dtype=dtype)
        return api.dequantize_mx(data, scale, axis, block, dtype)
    from gemzoo_mxfp8.ops import dequant_op

    last = axis == data.dim() - 1
    dm = data.movedim(axis, -1 if last else 0)
    sm = scale.movedim(axis, -1 if last else 0)
    if last:
        d2, s2 = dm.reshape(-1, dm.shape[-1]), sm.reshape(-1, sm.shape[-1])
    else:
        d2, s2 = dm.reshape(dm.shape[0], -1), sm.reshape(sm.shape[0], -1)
    out = dequant_op(d2.contiguous(), s2.contiguous().view(torch.uint8), dtype, axis=-1 if last else 0)
    return out.view(dm.shape).movedim(-1 if last else 0, axis)


def cast2d(x: torch.Tensor, *, row_q=False, row_dq=False, col_q=False, col_dq=False,
           elem=torch.float8_e4m3fn, rht=None, dq_dtype=torch.bfloat16, col_layout="t") -> dict:
    """Fused cast of a 2-D x [R, C] (see triton_kernels.mx_cast for the outputs and ``col_layout``;
    scales are uint8).

    ``rht`` = (signs, block) applies H diag(signs) along R before the columnwise quantization.
    """
    if on_triton(x):
        from gemzoo_mxfp8.ops import cast_op
        from gemzoo_mxfp8.triton_kernels import hadamard_sign_matrix

        h = None if rht is None else hadamard_sign_matrix(rht[0], rht[1], x.device)
        return cast_op(x, row_q=row_q, row_dq=row_dq, col_q=col_q, col_dq=col_dq, elem=elem, rht=h,
                       dq_dtype=dq_dtype, col_layout=col_layout)
    out = {}
    R, C = x.shape
    if row_q or row_dq:
        d, s = api.quantize_mx(x, 1, 32, elem)
        if row_q:
            out["row"] = (d, s.view(torch.uint8))
        if row_dq:
            out["row_dq"] = api.dequantize_mx(d, s, 1, 32, dq_dtype)
    if col_q or col_dq:
        rp = -(-R // 32) * 32
        xt = F.pad(x.float(), (0, 0, 0, rp - R)).t()  # [C, RP]
        if rht is not None:
            xt = api.hadamard_transform(xt.contiguous(), block=rht[1], signs=rht[0])
        d, s = api.quantize_mx(xt, 1, 32, elem)
        nat = (lambda t: t.t().contiguous()) if col_layout == "n" else (lambda t: t)
        if col_q:
            out["col"] = (nat(d), nat(s.view(torch.uint8)))
        if col_dq:
            out["col_dq"] = nat(api.dequantize_mx(d, s, 1, 32, dq_dtype))
    return out


def dequant2d(data: torch.Tensor, scale_u8: torch.Tensor, dtype=torch.bfloat16, axis: int = -1) -> torch.Tensor:
    """Dequantize 2-D MX data with uint8 scales: blocks along the last dim (axis -1) or along rows (axis 0)."""
    if on_triton(data):
        from gemzoo_mxfp8.ops import dequant_op

        return dequant_op(data, scale_u8, dtype, axis=axis)
    return api.dequantize_mx(data, scale_u8.view(torch.float8_e8m0fnu), axis % 2, 32, dtype)
