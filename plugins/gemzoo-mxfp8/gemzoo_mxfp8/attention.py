"""MX attention matmuls (the quantized reference path): q and k in MX along D, v in MX along the sequence.

``MXAttention`` wraps whatever kernel a JaggedAttention site already uses. It fake-quantizes q, k, v
(quantize then dequantize with the exact MX rule: the values the MX matmuls QK^T and PV see) and runs the
wrapped kernel on them, so QK^T and PV compute on MX operands with fp32 accumulation. Gradients pass
straight through the quantization (the backward matmuls run in the wrapped kernel's precision).
v is quantized per sequence: blocks of 32 keys never straddle two sequences.
"""

from __future__ import annotations

import torch

from gemzoo.api import jagged_to_padded, max_length, padded_to_jagged
from gemzoo_mxfp8.cast import dequantize_mx, quantize_mx


class _FakeQuantMX(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, elem):
        data, scale = quantize_mx(x, axis=axis, elem=elem)
        return dequantize_mx(data, scale, axis=axis, dtype=x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def fake_quant_mx(x: torch.Tensor, axis: int = -1, elem=torch.float8_e4m3fn) -> torch.Tensor:
    return _FakeQuantMX.apply(x, axis, elem)


def fake_quant_mx_sequence(v: torch.Tensor, offsets: torch.Tensor, elem=torch.float8_e4m3fn) -> torch.Tensor:
    """v [T, H, Dv] jagged by ``offsets``: MX blocks of 32 along each sequence (zero-padded at its end)."""
    if v.shape[0] == 0:
        return v
    lmax = max_length(offsets)
    padded = jagged_to_padded(v, offsets, lmax)  # [B, L, H, Dv]
    return padded_to_jagged(fake_quant_mx(padded, axis=1, elem=elem), offsets)


class MXAttention:
    """Attention kernel wrapper: the inner kernel on MX-quantized q, k (along D) and v (along keys)."""

    def __init__(self, inner, inner_name: str = "?", elem=torch.float8_e4m3fn):
        self.inner, self.inner_name, self.elem = inner, inner_name, elem
        self.capabilities = inner.capabilities
        self.description = f"MXFP8 QK^T and PV around {inner_name!r}"

    def __call__(self, q, k, v, q_offsets, k_offsets=None, **kw):
        k_off = q_offsets if k_offsets is None else k_offsets
        qm = fake_quant_mx(q, axis=-1, elem=self.elem)
        km = fake_quant_mx(k, axis=-1, elem=self.elem)
        vm = fake_quant_mx_sequence(v, k_off, elem=self.elem)
        return self.inner(qm, km, vm, q_offsets, k_offsets, **kw)

    def __repr__(self) -> str:
        return f"MXAttention({self.inner_name})"
