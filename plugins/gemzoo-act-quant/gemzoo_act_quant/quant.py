"""fp8 storage for saved activations: power-of-two scales per row or per block of 32 along the last dim.

    packed = quantize(x, elem=torch.float8_e4m3fn, scale="row")   # or "block32"
    y = dequantize(packed)                                         # x's dtype and shape again

A power-of-two scale 2^e is chosen so that amax / 2^e <= the element's largest finite value (448 for
e4m3, 57344 for e5m2): dividing by it is exact, so the only error is the element's rounding (relative
error <= 2^-4 for e4m3 normals). Scales are stored as int8 exponents (1 byte a row or a block).
``block32`` goes through ``gemzoo_mxfp8.quantize_mx`` / ``dequantize_mx`` (the OCP MX cast: Triton on
GPU, C++ on CPU) when gemzoo-mxfp8 is installed, else through the plain-torch block cast below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ELEMS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                               "float8_e8m0fnu") if hasattr(torch, n))
SCALES = ("row", "block32", "auto")
BLOCK = 32


@functools.lru_cache(maxsize=1)
def mx_api():
    """(quantize_mx, dequantize_mx) from gemzoo-mxfp8, or None when it is not installed."""
    try:
        from gemzoo_mxfp8 import dequantize_mx, quantize_mx
    except ImportError:
        return None
    return quantize_mx, dequantize_mx


def resolve_scale(scale: str) -> str:
    """"auto": MX blocks of 32 when gemzoo-mxfp8 is installed, else power-of-two scales per row."""
    if scale == "auto":
        return "block32" if mx_api() is not None else "row"
    return scale


@dataclass
class Packed:
    """One saved tensor in fp8: ``data`` (the padded last dim for torch blocks), ``scale`` and how to undo it."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    shape: torch.Size
    kind: str  # "row" | "block32" (plain torch) | "mx" (gemzoo_mxfp8)
    stride: tuple[int, ...] | None = None  # x's strides when it was not contiguous (compiled backward graphs check them)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def _pow2_exponent(amax: torch.Tensor, elem: torch.dtype) -> torch.Tensor:
    """int8 e with amax / 2^e <= finfo(elem).max (0 for all-zero groups)."""
    fmax = torch.finfo(elem).max
    _, e = torch.frexp(amax.float() / fmax)  # amax / fmax = m 2^e, m in [0.5, 1)
    return e.clamp(-127, 127).to(torch.int8)


def _cast(x: torch.Tensor, e: torch.Tensor, elem: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(elem).max
    y = x.float() * torch.exp2(-e.float())  # exact: a power of two
    return y.clamp(-fmax, fmax).to(elem)  # the clamp only guards inf; NaN stays NaN


def quantize_rows(x: torch.Tensor, elem: torch.dtype) -> Packed:
    amax = x.abs().amax(dim=-1, keepdim=True)
    e = _pow2_exponent(amax, elem)
    return Packed(_cast(x, e, elem), e, x.dtype, x.shape, "row")


def quantize_blocks(x: torch.Tensor, elem: torch.dtype) -> Packed:
    n = x.shape[-1]
    pad = (-n) % BLOCK
    xb = F.pad(x, (0, pad)) if pad else x
    xb = xb.reshape(*x.shape[:-1], (n + pad) // BLOCK, BLOCK)
    e = _pow2_exponent(xb.abs().amax(dim=-1, keepdim=True), elem)
    return Packed(_cast(xb, e, elem), e, x.dtype, x.shape, "block32")


def quantize(x: torch.Tensor, elem: torch.dtype = torch.float8_e4m3fn, scale: str = "row") -> Packed:
    """x (floating, last dim >= 1) -> Packed; see the module docstring."""
    scale = resolve_scale(scale)
    if scale == "row":
        p = quantize_rows(x, elem)
    elif mx_api() is not None:
        data, s = mx_api()[0](x.contiguous(), axis=-1, block=BLOCK, elem=elem)
        p = Packed(data, s, x.dtype, x.shape, "mx")
    else:
        p = quantize_blocks(x, elem)
    if not x.is_contiguous():
        p.stride = tuple(x.stride())
    return p


def dequantize(p: Packed) -> torch.Tensor:
    y = _dequantize(p)
    if p.stride is None:
        return y
    out = torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=y.device)
    return out.copy_(y)


def _dequantize(p: Packed) -> torch.Tensor:
    if p.kind == "mx":
        out_dtype = p.dtype if p.dtype in (torch.float32, torch.bfloat16) else torch.float32
        return mx_api()[1](p.data, p.scale, axis=-1, block=BLOCK, dtype=out_dtype).to(p.dtype)
    y = p.data.float() * torch.exp2(p.scale.float())
    if p.kind == "block32":
        y = y.reshape(*p.shape[:-1], -1)[..., : p.shape[-1]]
    return y.to(p.dtype)
