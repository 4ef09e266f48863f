"""fp8-tensorwise: dynamic per-tensor scaled fp8 GEMMs, in the style of torchao's float8 training.

Each GEMM operand gets one fp32 scale for the whole tensor, taken from its amax when it is cast (dynamic scaling):
scale = fp8_max / max(amax, EPS), data = saturate(x * scale) in e4m3 for inputs and weights, e5m2 for the output
gradient. The three GEMMs of a linear, Y = X W^T, dX = dY W and dW = dY^T X, run through ``torch._scaled_mm``
with the inverse scales (scalars) on CUDA; on CPU through an exact emulation (the fp8 values in fp32, an fp32
matmul, then the product of the inverse scales, which is what ``_scaled_mm`` computes up to the order of its fp32
sums). One scale per tensor means one cast serves both layouts a tensor takes: X row-major for the forward and
X^T (tokens zero-padded to a multiple of 16, as ``_scaled_mm`` needs for wgrad) from the same scaled values.

The amax is a plain torch reduction, left to Inductor inside a compiled block (on gem-1b it ran as kernels of
its own, not fused into the producer). The cast itself has two backends (``casts``):
- "triton" (the default on CUDA): one Triton kernel (``triton_kernels.tensorwise_cast``, a torch custom op) reads
  each tile of x once and writes both layouts, the transposed one through a transpose in registers;
- "torch": the cast as torch ops, left to Inductor inside a compiled block, or run as one compiled function each
  when used eagerly on CUDA (``rowwise.compiled_cast``, dynamic shapes). The CPU always uses it.
Both round the same fp32 products, so they give the same bits. Saved for backward: X^T in e4m3, W^T in e4m3 and
the two inverse scales, so backward re-reads no bf16 or fp32 operand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo_mxfp8.cast import on_triton
from gemzoo_mxfp8.rowwise import TOKEN_PAD, compiled_cast

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12  # smallest amax a scale is taken from (an all-zero tensor); torchao's EPS; spelled as a literal in
# tensor_scale, since the autograd Function must read no float global (see the note in rowwise.py)
# Tests set this to run CPU tensors through torch._scaled_mm (which CPU builds of torch have) with the operand
# layouts CUDA requires, instead of the emulation.
SCALED_MM_ON_CPU = False
CAST_BACKENDS = ("triton", "torch")


def tensor_scale(x: torch.Tensor, elem: torch.dtype = E4M3, pow2: bool = False) -> torch.Tensor:
    """fp32 0-dim scale = fp8_max / max(amax(|x|), EPS); ``pow2`` rounds it down to a power of two (then the
    scaling multiplies exactly and only the cast rounds). NaN in x gives a NaN scale, inf a zero one (an infinite
    inverse scale): either way every dequantized value, and so every GEMM output, is NaN; nothing is hidden."""
    amax = x.abs().amax().float().clamp_min(1e-12)  # EPS
    # an IEEE division (a Python number over a tensor would be reciprocal(amax) * fp8_max, rounded twice)
    scale = torch.full_like(amax, torch.finfo(elem).max) / amax
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def quantize_tensorwise(x: torch.Tensor, elem: torch.dtype = E4M3, row: bool = True, col: bool = False,
                        pad_to: int = 1, pow2: bool = False):
    """x [R, C] -> (row data [R, C] or None, col data [C, Rp] or None, inverse scale fp32 0-dim).

    x ~= row * inv_scale and x^T ~= col[:, :R] * inv_scale, with Rp = R zero-padded to a multiple of
    ``pad_to`` (no rows pad to one ``pad_to``). The scale comes from the R real rows (zeros change no amax);
    the elements are rounded to nearest even after x * scale in fp32, saturating at the format's largest value."""
    fmax = torch.finfo(elem).max
    rows = x.shape[0]
    xf = x.float()
    scale = tensor_scale(xf, elem, pow2) if x.numel() else torch.ones((), device=x.device)
    scaled = xf * scale
    # row-major whatever x's layout (a transposed input, an output gradient autograd made non-contiguous):
    # _scaled_mm reads its first operand row-major
    row_data = scaled.clamp(-fmax, fmax).to(elem).contiguous() if row else None
    col_data = None
    if col:
        pad = (-rows) % pad_to if rows else pad_to
        col_data = F.pad(scaled, (0, 0, 0, pad)).t().clamp(-fmax, fmax).to(elem).contiguous()
    return row_data, col_data, scale.reciprocal()


def _cast(x: torch.Tensor, elem: torch.dtype, row: bool, col: bool, pad_to: int = 1, pow2: bool = False,
          backend: str = "triton"):
    """quantize_tensorwise's three outputs, through the Triton cast (CUDA, ``backend`` "triton") or torch ops."""
    if backend == "triton" and on_triton(x) and x.numel():
        from gemzoo_mxfp8.ops import tensorwise_cast_op

        scale = tensor_scale(x, elem, pow2)
        q, qt = tensorwise_cast_op(x, scale, elem, row=row, col=col, pad_to=pad_to)
        return (q if row else None), (qt if col else None), scale.reciprocal()
    return compiled_cast(quantize_tensorwise, x, elem, row, col, pad_to, pow2)


def emulated_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """What _scaled_mm computes: the fp8 values are exact in fp32, and so is the product of two of them (at most
    4 + 4 significand bits), so only the fp32 sums round; then the product of the inverse scales."""
    return ((a.float() @ b.float()) * (sa * sb)).to(out_dtype)


def scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """(a @ b) * sa * sb with a [M, K] fp8 row-major, b [K, N] fp8 column-major, sa and sb fp32 0-dim inverse
    scales: ``torch._scaled_mm`` on CUDA when K and N are multiples of 16 (its requirement), else the emulation.
    ``fast_accum`` (the forward GEMM, as torchao does) lets cuBLAS skip the periodic fp32 promotion."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:  # no tokens: nothing to multiply
        return torch.zeros(m, n, device=a.device, dtype=out_dtype)
    if (a.is_cuda or SCALED_MM_ON_CPU) and k % 16 == 0 and n % 16 == 0:
        if a.stride(1) != 1 or b.stride(0) != 1:
            raise RuntimeError(f"scaled_mm needs a row-major and b column-major, got strides {a.stride()} and "
                               f"{b.stride()}")
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return emulated_mm(a, sa, b, sb, out_dtype)


class FP8TensorwiseFunction(torch.autograd.Function):
    """Y = X W^T (+ b) with X, W in e4m3; dX = dY W and dW = dY^T X with dY in e5m2; one scale per tensor."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype=None, pow2=False, fast_accum=True, casts="triton"):
        out_dtype = out_dtype or x.dtype
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        need_w, need_x = weight.requires_grad, x.requires_grad
        # X row-major for the forward; X^T along tokens (padded to 16) for wgrad, from the same scaled values
        xq, xt, sx = _cast(x2, E4M3, True, need_w, TOKEN_PAD, pow2, casts)
        # W row-major (read as W^T column-major by the forward); W^T row-major (read as W column-major by dgrad)
        wq, wt, sw = _cast(weight, E4M3, True, need_x, 1, pow2, casts)
        y = scaled_mm(xq, sx, wq.t(), sw, torch.float32 if out_dtype == torch.float32 else torch.bfloat16,
                      fast_accum=fast_accum)
        if bias is not None:
            y = y + bias.to(y.dtype)
        empty = x2.new_empty(0)
        ctx.save_for_backward(xt if xt is not None else empty, sx, wt if wt is not None else empty, sw)
        # plain constants only: no shapes (SymInts under dynamic shapes); backward takes them from dy and W^T
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, weight.dtype, bias is not None
        ctx.pow2, ctx.casts = pow2, casts
        return y.to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xt, sx, wt, sw = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        n = dy.shape[-1]
        dy2 = dy.reshape(-1, n)
        dx = dw = db = None
        # dY row-major along N for dgrad; dY^T along tokens (padded to 16) for wgrad; e5m2: gradients need range
        dyq, dyt, sdy = _cast(dy2, E5M2, need_x, need_w, TOKEN_PAD, ctx.pow2, ctx.casts)
        if need_x:
            # dX straight in x's dtype: the GEMM's epilogue rounds the same fp32 value an fp32 output then cast would,
            # without writing and reading dX in fp32 (8 bytes an element more)
            dx = scaled_mm(dyq, sdy, wt.t(), sw, ctx.x_dtype).view(*dy.shape[:-1], wt.shape[0])
        if need_w:
            dw = scaled_mm(dyt, sdy, xt.t(), sx, torch.float32).to(ctx.w_dtype)
        if need_b and ctx.has_bias:
            db = dy2.float().sum(0)
        return dx, dw, db, None, None, None, None


class FP8TensorwiseLinear(nn.Module):
    """Drop-in for nn.Linear (same parameters) computing its three GEMMs in per-tensor scaled fp8."""

    precision = "fp8-tensorwise"
    out_dtype: torch.dtype | None = None
    pow2: bool = False
    fast_accum: bool = True
    casts: str = "triton"

    @classmethod
    def from_linear(cls, linear: nn.Linear, out_dtype: torch.dtype | None = None, pow2: bool = False,
                    fast_accum: bool = True, casts: str = "triton") -> FP8TensorwiseLinear:
        """``out_dtype`` None returns x's dtype; the policy asks for bf16, as BF16Linear does. ``casts`` picks
        the cast backend on CUDA ("triton" or "torch"; the CPU always runs torch ops)."""
        if casts not in CAST_BACKENDS:
            raise ValueError(f"casts must be one of {CAST_BACKENDS}, got {casts!r}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.out_dtype, new.pow2, new.fast_accum, new.casts = out_dtype, pow2, fast_accum, casts
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8TensorwiseLinear expects inputs with last dim {self.in_features}, got "
                             f"{tuple(x.shape)}")
        return FP8TensorwiseFunction.apply(x, self.weight, self.bias, self.out_dtype, self.pow2, self.fast_accum,
                                           self.casts)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"pow2={self.pow2}, casts={self.casts}")
