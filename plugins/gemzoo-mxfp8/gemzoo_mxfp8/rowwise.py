"""fp8-rowwise: per-row scaled e4m3 GEMMs through ``torch._scaled_mm`` (the fast Hopper alternative to MX).

Each GEMM operand gets one fp32 scale per row of its contraction (amax / 448): X and W per row in the
forward, dY per row and W per column in dgrad, dY and X per column (over tokens) in wgrad. Saved for
backward: X^T quantized along tokens (fp8 + scales), and the weight parameter itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0
EPS = 1e-12  # smallest amax a scale is taken from (an all-zero row or column)
TOKEN_PAD = 16  # wgrad contracts over tokens: _scaled_mm needs a multiple of 16 (else an fp32 fallback)

# The casts below spell E4M3_MAX and EPS as literals: code the autograd Functions run reads no float from a
# module global, a default argument or an attribute. Under dynamic shapes (torch.compile(dynamic=True), auto-ac's
# dynamic = true) Dynamo makes such a float a graph input and reads it with .item() inside the subgraph of the
# first autograd Function that touches it; the next fp8 linear of the same graph then reuses that value from the
# first one's forward and tracing stops with "lift_tracked_freevar_to_input should not be called on root
# SubgraphTracer" (the second fp8 linear of a compiled gem-1b block).


def _row_scale(amax: torch.Tensor) -> torch.Tensor:
    """max(amax, EPS) / E4M3_MAX."""
    return amax.clamp_min(1e-12) / 448.0


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v saturated to +-E4M3_MAX, rounded to e4m3."""
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def quantize_rowwise(x: torch.Tensor):
    """x [R, C] -> (e4m3 [R, C], fp32 scale [R, 1]) with x ~= data * scale, scale = amax(row) / 448."""
    xf = x.float()
    scale = _row_scale(xf.abs().amax(dim=1, keepdim=True))
    data = _to_e4m3(xf / scale)
    return data.contiguous(), scale.contiguous()


def quantize_rowwise_t(x: torch.Tensor, pad_to: int = 1):
    """quantize_rowwise(x.t()), with x's rows (the tokens) zero-padded to a multiple of ``pad_to``:
    _scaled_mm needs a contraction that is a multiple of 16, and zero tokens add nothing to dY^T X. No
    tokens at all pad to one block. Its own function, so torch.compile keeps a separate cache for it.

    The scales reduce over the R real tokens, and the zero rows join the scaled values before the cast (zeros
    change no amax and quantize to zero). Padding the input first made the compiled forward hold two reductions
    of one activation, over R and over R padded, which torch 2.11's Inductor fuses as one mix-order reduction
    and then asserts equal (``get_numel_rnumel``: "90544 v.s. 90533", the compiled gem-bench
    ``jfa,fp8-rowwise`` row of 2026-12-02)."""
    rows, cols = x.shape
    if rows == 0:
        return (torch.zeros(cols, pad_to, device=x.device).to(torch.float8_e4m3fn),
                torch.full((cols, 1), 1e-12 / 448.0, device=x.device))  # EPS / E4M3_MAX
    xf = x.float()
    scale = _row_scale(xf.abs().amax(dim=0, keepdim=True))  # [1, C]: one per column of x
    scaled = F.pad(xf / scale, (0, 0, 0, (-rows) % pad_to))
    data = _to_e4m3(scaled.t())
    return data.contiguous(), scale.view(cols, 1)  # view, not .t(): _scaled_mm wants stride (1, 1)


_compiled = {}
COMPILE_CASTS = True  # eager CUDA use compiles the casts: one fused kernel each, for every token count


def compiled_cast(fn, x: torch.Tensor, *args):
    """``fn(x, *args)``, compiled on CUDA unless we are already being compiled (then the caller's graph fuses it).

    dynamic=True and a detached input keep it to one graph per dtype (weights fp32, activations bf16),
    where token counts that change every step would otherwise recompile until dynamo gives up."""
    if x.is_cuda and COMPILE_CASTS and not torch.compiler.is_compiling():
        if fn not in _compiled:
            _compiled[fn] = torch.compile(fn, dynamic=True)
        fn, x = _compiled[fn], x.detach()
    return fn(x, *args)


def _quant(x: torch.Tensor, transposed: bool = False, pad_to: int = 1):
    """quantize_rowwise of x (or of x.t()), compiled on CUDA (``compiled_cast``)."""
    fn, args = (quantize_rowwise_t, (pad_to,)) if transposed else (quantize_rowwise, ())
    return compiled_cast(fn, x, *args)


def _mm(a, sa, b_t, sb, out_dtype, fast_accum=False):
    """(a * sa) @ (b_t * sb)^T with a [M, K], b_t [N, K] both rowwise-quantized along K.

    ``fast_accum`` (forward only, as torchao does) lets cuBLAS skip the periodic fp32 promotion."""
    m, k = a.shape
    n = b_t.shape[0]
    if m == 0 or n == 0:  # no tokens: _scaled_mm rejects the empty scales
        return torch.zeros(m, n, device=a.device, dtype=out_dtype)
    if a.is_cuda and k % 16 == 0 and n % 16 == 0:
        return torch._scaled_mm(a, b_t.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accum).to(out_dtype)
    try:  # CPU _scaled_mm supports rowwise scales too
        return torch._scaled_mm(a, b_t.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=torch.float32).to(out_dtype)
    except (RuntimeError, NotImplementedError):  # emulate: products of e4m3 values are exact in fp32
        return ((a.float() @ b_t.float().t()) * sa * sb.view(1, -1)).to(out_dtype)


# "torch": casts in torch ops (fused by torch.compile); "triton": gemzoo_mxfp8's two-pass Triton casts
# (row quantization and column amax in one pass, transposed column quantization in the second).
CAST_BACKEND = "torch"


def _casts(x2: torch.Tensor, row: bool, col: bool, pad_to: int = 1):
    """(row (data, scale [R,1]) or None, col-of-transpose (data [C,Rp], scale [C,1]) or None), where Rp is
    R zero-padded to a multiple of ``pad_to`` (activations: their token count varies)."""
    if x2.is_cuda and CAST_BACKEND == "triton" and not torch.compiler.is_compiling():
        from gemzoo_mxfp8.triton_kernels import rowwise_cast

        out = rowwise_cast(x2.contiguous(), row=row, col=col, pad_to=pad_to)
        return out.get("row"), out.get("col")
    return (_quant(x2) if row else None), (_quant(x2, transposed=True, pad_to=pad_to) if col else None)


class FP8RowwiseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype=None):
        out_dtype = out_dtype or x.dtype
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        (xq, sx), xt = _casts(x2, True, weight.requires_grad, pad_to=TOKEN_PAD)
        (wq, sw), _ = _casts(weight, True, False)
        y = _mm(xq, sx, wq, sw, torch.float32 if out_dtype == torch.float32 else torch.bfloat16, fast_accum=True)
        if bias is not None:
            y = y + bias.to(y.dtype)
        # X^T quantized along tokens [K, M] for wgrad (empty placeholders when W needs no grad)
        saved = xt if xt is not None else (x2.new_empty(0), x2.new_empty(0))
        ctx.save_for_backward(weight, *saved)
        # plain constants only: no shapes (SymInts under dynamic shapes); backward takes them from dy and W
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return y.to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        weight, xtq, sxt = ctx.saved_tensors
        n = weight.shape[0]
        dy2 = dy.reshape(-1, n)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        drow, dcol = _casts(dy2, need_x, need_w, pad_to=TOKEN_PAD)  # dY along N (dgrad); dY^T [N, M] along tokens (wgrad)
        if need_x:
            _, (wtq, swt) = _casts(weight, False, True)  # W^T [K, N] along N
            # dX in x's dtype (on CUDA the rowwise GEMM writes bf16 either way: no bf16 -> fp32 -> bf16 round trip)
            dx = _mm(*drow, wtq, swt, ctx.x_dtype).view(*dy.shape[:-1], weight.shape[1])
        if need_w:
            dw = _mm(*dcol, xtq, sxt, torch.float32).to(weight.dtype)
        if need_b and ctx.has_bias:
            db = dy2.float().sum(0)
        return dx, dw, db, None


class FP8RowwiseLinear(nn.Module):
    """Drop-in for nn.Linear (same parameters) computing in per-row scaled e4m3."""

    precision = "fp8-rowwise"
    out_dtype: torch.dtype | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, out_dtype: torch.dtype | None = None) -> FP8RowwiseLinear:
        """``out_dtype`` None returns x's dtype; the policy asks for bf16, as BF16Linear does."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.out_dtype = out_dtype
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8RowwiseLinear expects inputs with last dim {self.in_features}, got {tuple(x.shape)}")
        return FP8RowwiseFunction.apply(x, self.weight, self.bias, self.out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
