"""MX casts: ``quantize_mx`` / ``dequantize_mx`` (public) and ``cast2d`` (the fused multi-output cast the
linear uses). CUDA tensors go to the Triton kernels, CPU tensors to ``gemzoo.ops`` (C++ when built) or the
plain-torch rule in ``gemzoo.mx``. Both are bit-identical to ``gemzoo.mx.quantize_mx_torch``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemzoo.mx as mx_ref
from gemzoo_mxfp8.rht import hadamard_transform

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


def _cpu_quantize(x, axis, block, elem):
    import gemzoo.ops as ops

    fn = getattr(ops, "quantize_mx", None)
    if fn is not None:
        return fn(x, axis=axis, block=block, elem=elem)
    return mx_ref.quantize_mx_torch(x, axis=axis, block=block, elem=elem)


def _cpu_dequantize(data, scale, axis, block, dtype):
    import gemzoo.ops as ops

    fn = getattr(ops, "dequantize_mx", None)
    if fn is not None:
        return fn(data, scale, axis=axis, block=block, dtype=dtype)
    return mx_ref.dequantize_mx_torch(data, scale, axis=axis, block=block, dtype=dtype)


def quantize_mx(x: torch.Tensor, axis: int = -1, block: int = 32, elem: torch.dtype = torch.float8_e4m3fn):
    """(data [x's shape, elem], scale [ceil(n/block) along axis, float8_e8m0fnu]); OCP MX with RCEIL scales."""
    _check_elem(elem)
    if not x.is_floating_point():
        raise TypeError(f"quantize_mx needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize_mx needs at least one dimension")
    axis = axis % x.dim()
    if not _use_triton(x, block):
        return _cpu_quantize(x, axis, block, elem) if not x.is_cuda else \
            mx_ref.quantize_mx_torch(x, axis=axis, block=block, elem=elem)
    from gemzoo_mxfp8.triton_kernels import mx_cast

    n = x.shape[axis]
    if axis == x.dim() - 1:  # rowwise
        x2 = x.reshape(-1, n)
        data, scale = mx_cast(x2, row_q=True, elem=elem)["row"]
        return data.view(x.shape), scale.view(*x.shape[:-1], -1).view(torch.float8_e8m0fnu)
    # columnwise: view as [n, rest] and let the kernel quantize along n with the transpose fused
    moved = x.movedim(axis, 0)
    x2 = moved.reshape(n, -1)
    data_t, scale_t = mx_cast(x2, col_q=True, elem=elem)["col"]  # [rest, n_pad], [rest, n_pad/32]
    data = data_t[:, :n].t().reshape(moved.shape).movedim(0, axis)
    scale = scale_t.t().reshape(-1, *moved.shape[1:]).movedim(0, axis)
    return data, scale.view(torch.float8_e8m0fnu)


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor, axis: int = -1, block: int = 32,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_mx: data * 2^(e - 127) per block (NaN for the NaN scale)."""
    axis = axis % data.dim()
    if not _use_triton(data, block):
        if data.is_cuda:
            return mx_ref.dequantize_mx_torch(data, scale, axis=axis, block=block, dtype=dtype)
        return _cpu_dequantize(data, scale, axis, block, dtype)
    from gemzoo_mxfp8.triton_kernels import mx_dequant

    dm = data.movedim(axis, -1)
    sm = scale.movedim(axis, -1)
    n = dm.shape[-1]
    d2 = dm.reshape(-1, n).contiguous()
    s2 = sm.reshape(-1, sm.shape[-1]).contiguous().view(torch.uint8)
    return mx_dequant(d2, s2, dtype).view(dm.shape).movedim(-1, axis)


def cast2d(x: torch.Tensor, *, row_q=False, row_dq=False, col_q=False, col_dq=False,
           elem=torch.float8_e4m3fn, rht=None, dq_dtype=torch.bfloat16) -> dict:
    """Fused cast of a 2-D x [R, C] (see triton_kernels.mx_cast for the outputs; scales are uint8).

    ``rht`` = (signs, block) applies H diag(signs) along R before the columnwise quantization.
    """
    if on_triton(x):
        from gemzoo_mxfp8.triton_kernels import hadamard_sign_matrix, mx_cast

        h = None if rht is None else hadamard_sign_matrix(rht[0], rht[1], x.device)
        return mx_cast(x, row_q=row_q, row_dq=row_dq, col_q=col_q, col_dq=col_dq, elem=elem, rht=h,
                       dq_dtype=dq_dtype)
    out = {}
    R, C = x.shape
    if row_q or row_dq:
        d, s = _cpu_quantize(x, 1, 32, elem)
        if row_q:
            out["row"] = (d, s.view(torch.uint8))
        if row_dq:
            out["row_dq"] = _cpu_dequantize(d, s, 1, 32, dq_dtype)
    if col_q or col_dq:
        rp = -(-R // 32) * 32
        xt = F.pad(x.float(), (0, 0, 0, rp - R)).t()  # [C, RP]
        if rht is not None:
            xt = hadamard_transform(xt.contiguous(), block=rht[1], signs=rht[0])
        d, s = _cpu_quantize(xt, 1, 32, elem)
        if col_q:
            out["col"] = (d, s.view(torch.uint8))
        if col_dq:
            out["col_dq"] = _cpu_dequantize(d, s, 1, 32, dq_dtype)
    return out


def dequant2d(data: torch.Tensor, scale_u8: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Rowwise dequantize of 2-D MX data (scales uint8 along the last dim)."""
    if on_triton(data):
        from gemzoo_mxfp8.triton_kernels import mx_dequant

        return mx_dequant(data, scale_u8, dtype)
    return _cpu_dequantize(data, scale_u8.view(torch.float8_e8m0fnu), 1, 32, dtype)
