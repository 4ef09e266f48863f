"""The Triton kernels as torch custom ops (``torch.ops.gemzoo_mxfp8.*``) with fake implementations, so
``torch.compile`` traces the MX linear without graph breaks and sees the kernels as opaque calls.

    mx_cast(x, row_q, row_dq, col_q, col_dq, elem, h, h_mult, dq_dtype, col_layout) -> 6 tensors
    mx_dequant(data, scale_u8, dtype, axis) -> tensor
    mx_gemm(a, sa, b, sb, k, bias, out_dtype) -> tensor
    tensorwise_cast(x, scale, elem, row, col, pad_to) -> 2 tensors

``cast_op`` / ``dequant_op`` / ``gemm_op`` are the Python entry points the plugin uses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gemzoo_mxfp8 import triton_kernels as tk


@torch.library.custom_op("gemzoo_mxfp8::mx_cast", mutates_args=())
def _mx_cast(x: Tensor, row_q: bool, row_dq: bool, col_q: bool, col_dq: bool, elem: torch.dtype,
             h: Tensor | None, h_mult: float, dq_dtype: torch.dtype, col_layout: str) -> list[Tensor]:
    flags = dict(row_q=row_q, row_dq=row_dq, col_q=col_q, col_dq=col_dq)
    buffers = tk.cast_buffers(x, **flags, elem=elem, dq_dtype=dq_dtype, col_layout=col_layout)
    tk.launch_cast(x, buffers, **flags, elem=elem, rht=None if h is None else (h, h_mult), col_layout=col_layout)
    return buffers


@_mx_cast.register_fake
def _(x, row_q, row_dq, col_q, col_dq, elem, h, h_mult, dq_dtype, col_layout):
    return tk.cast_buffers(x, row_q=row_q, row_dq=row_dq, col_q=col_q, col_dq=col_dq, elem=elem,
                           dq_dtype=dq_dtype, col_layout=col_layout)


@torch.library.custom_op("gemzoo_mxfp8::mx_dequant", mutates_args=())
def _mx_dequant(data: Tensor, scale_u8: Tensor, dtype: torch.dtype, axis: int) -> Tensor:
    return tk.mx_dequant(data, scale_u8, dtype, axis=axis)


@_mx_dequant.register_fake
def _(data, scale_u8, dtype, axis):
    return data.new_empty(data.shape, dtype=dtype)


@torch.library.custom_op("gemzoo_mxfp8::mx_gemm", mutates_args=())
def _mx_gemm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor | None, k: int, bias: Tensor | None,
             out_dtype: torch.dtype) -> Tensor:
    return tk.mx_gemm(a, sa, b, sb, k=k, bias=bias, out_dtype=out_dtype)


@_mx_gemm.register_fake
def _(a, sa, b, sb, k, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op("gemzoo_mxfp8::tensorwise_cast", mutates_args=())
def _tensorwise_cast(x: Tensor, scale: Tensor, elem: torch.dtype, row: bool, col: bool,
                     pad_to: int) -> tuple[Tensor, Tensor]:
    return tk.tensorwise_cast(x, scale, elem, row=row, col=col, pad_to=pad_to)


@_tensorwise_cast.register_fake
def _(x, scale, elem, row, col, pad_to):
    return tk.tensorwise_buffers(x, elem, row, col, pad_to)


def cast_op(x: Tensor, *, row_q=False, row_dq=False, col_q=False, col_dq=False, elem=torch.float8_e4m3fn,
            rht: tuple[Tensor, float] | None = None, dq_dtype=torch.bfloat16, col_layout="t") -> dict:
    """triton_kernels.mx_cast through the custom op: the same dict of outputs."""
    h, h_mult = rht if rht is not None else (None, 1.0)
    buffers = torch.ops.gemzoo_mxfp8.mx_cast(x, row_q, row_dq, col_q, col_dq, elem, h, h_mult, dq_dtype, col_layout)
    return tk.cast_outputs(buffers, row_q=row_q, row_dq=row_dq, col_q=col_q, col_dq=col_dq)


def dequant_op(data: Tensor, scale_u8: Tensor, dtype=torch.float32, axis: int = -1) -> Tensor:
    return torch.ops.gemzoo_mxfp8.mx_dequant(data, scale_u8, dtype, axis)


def gemm_op(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor | None, k: int | None = None, bias: Tensor | None = None,
            out_dtype=torch.bfloat16) -> Tensor:
    return torch.ops.gemzoo_mxfp8.mx_gemm(a, sa, b, sb, a.shape[1] if k is None else k, bias, out_dtype)


def tensorwise_cast_op(x: Tensor, scale: Tensor, elem=torch.float8_e4m3fn, *, row=True, col=False,
                       pad_to: int = 1) -> tuple[Tensor, Tensor]:
    """triton_kernels.tensorwise_cast through the custom op: (row data or empty, transposed data or empty)."""
    return torch.ops.gemzoo_mxfp8.tensorwise_cast(x, scale, elem, row, col, pad_to)
