"""The OCP MX cast rule in plain torch: the bit-exact definition every MX kernel is tested against.

For each block of ``block`` elements along ``axis``:
  1. amax = max|x| in fp32;
  2. v = amax / emax as an IEEE fp32 division (emax 448 for e4m3, 57344 for e5m2);
  3. the biased exponent e is v's exponent field, plus 1 if v's mantissa field is non-zero (RCEIL);
  4. e is clamped to [0, 254];
  5. scale = 2^(e - 127), stored as float8_e8m0fnu (the byte e);
  6. data = round-to-nearest-even cast of x / scale to the element type.
A block containing NaN gets the NaN scale 0xFF (and NaN data). A trailing partial block is padded with zeros.
``data`` keeps x's shape (moved back to ``axis``); ``scale`` has ceil(n / block) entries along ``axis``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ELEM_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _check(axis: int, block: int, elem: torch.dtype) -> None:
    if elem not in ELEM_MAX:
        raise ValueError(f"elem must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem}")
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")


def mx_exponent(amax: torch.Tensor, elem: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Biased e8m0 exponent (int32, 0..255) for fp32 block maxima ``amax``; NaN -> 255."""
    v = amax.float() / ELEM_MAX[elem]
    bits = v.view(torch.int32)
    e = (bits >> 23) & 0xFF
    e = e + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    e = e.clamp(0, 254)
    return torch.where(torch.isnan(amax), torch.full_like(e, 255), e)


def exponent_to_scale(e: torch.Tensor) -> torch.Tensor:
    """fp32 value 2^(e-127) of biased exponents (NaN for 255). Exact, subnormals included."""
    s = torch.ldexp(torch.ones_like(e, dtype=torch.float32), (e - 127).to(torch.int32))
    return torch.where(e == 255, torch.full_like(s, float("nan")), s)


def quantize_mx_torch(x: torch.Tensor, axis: int = -1, block: int = 32, elem: torch.dtype = torch.float8_e4m3fn):
    """Returns (data [same shape as x, dtype elem], scale [.., ceil(n/block), .. along axis] float8_e8m0fnu)."""
    _check(axis, block, elem)
    xm = x.movedim(axis, -1).float()
    n = xm.shape[-1]
    pad = (-n) % block
    xb = F.pad(xm, (0, pad)).reshape(*xm.shape[:-1], (n + pad) // block, block)  # explicit: x may have 0 rows
    amax = xb.abs().amax(-1)
    amax = torch.where(torch.isnan(xb).any(-1), torch.full_like(amax, float("nan")), amax)
    e = mx_exponent(amax, elem)
    inv = exponent_to_scale(254 - e.clamp(max=254))  # 1/scale = 2^(127-e), exact for e in [0, 254]
    inv = torch.where(e == 255, torch.full_like(inv, float("nan")), inv)  # NaN block -> NaN data
    data = (xb * inv.unsqueeze(-1)).to(elem).reshape(*xm.shape[:-1], n + pad)[..., :n]
    scale = e.to(torch.uint8).view(torch.float8_e8m0fnu)
    return data.movedim(-1, axis).contiguous(), scale.movedim(-1, axis).contiguous()


def dequantize_mx_torch(data: torch.Tensor, scale: torch.Tensor, axis: int = -1, block: int = 32,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    dm = data.movedim(axis, -1).float()
    e = scale.movedim(axis, -1).view(torch.uint8).to(torch.int32)
    n = dm.shape[-1]
    s = exponent_to_scale(e).repeat_interleave(block, dim=-1)[..., :n]
    return (dm * s).to(dtype).movedim(-1, axis)
