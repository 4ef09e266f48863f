"""The MX linear: an autograd function with fp32 accumulation whose three GEMMs read MXFP8 operands.

  forward  Y  = X W^T     X, W in MX along K (rowwise)
  dgrad    dX = dY W      dY, W in MX along N (the contraction)
  wgrad    dW = dY^T X    dY, X in MX along tokens (columnwise), optionally after a random Hadamard
                          transform along tokens (H D dY)^T (H D X) = dY^T X
Only MX tensors are saved for backward (X quantized along tokens); W is the parameter itself.

Backends (same numerics, exact MX: dequantized values are exact in bf16, products exact in fp32):
  cpu     dequantize to fp32, fp32 matmul
  triton  MX activation tiles dequantized in registers into bf16 MMA (gemzoo_mxfp8.triton_kernels.mx_gemm, as the custom op
          gemzoo_mxfp8::mx_gemm);
          the weight operand is dequantized once per step (small) and read as exact bf16
  cublas  the cast kernel also writes the exact bf16 dequantization; the GEMM is cuBLAS bf16. Columnwise
          (token-blocked) outputs stay in the activation's own layout; cuBLAS reads them transposed
  hybrid  cublas for forward and dgrad, triton for wgrad (reads the saved MX X directly)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo_mxfp8.cast import cast2d, dequant2d, on_triton
from gemzoo_mxfp8.rht import rht_signs

BACKENDS = ("auto", "triton", "cublas", "hybrid")
AUTO_BACKEND = "cublas"  # the faster of the two on the H200 (see README's benchmark table)


@dataclass(frozen=True)
class MXLinearConfig:
    elem: torch.dtype = torch.float8_e4m3fn        # forward operands
    grad_elem: torch.dtype = torch.float8_e4m3fn   # dY in dgrad and wgrad
    rht: bool = False
    rht_block: int = 32
    rht_seed: int = 0
    backend: str = "auto"
    out_dtype: torch.dtype | None = None           # None: x's dtype; the policy asks for bf16, as BF16Linear

    def rht_args(self):
        return (rht_signs(self.rht_block, self.rht_seed), self.rht_block) if self.rht else None

    def cuda_backend(self) -> str:
        return AUTO_BACKEND if self.backend == "auto" else self.backend


@functools.cache
def _rht(cfg: MXLinearConfig):
    return cfg.rht_args()


class MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cfg: MXLinearConfig):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        out_dtype = cfg.out_dtype or x.dtype
        need_w = weight.requires_grad
        rht = _rht(cfg)
        if not on_triton(x):
            xo = cast2d(x2, row_dq=True, col_q=need_w, elem=cfg.elem, rht=rht, dq_dtype=torch.float32)
            wdq = cast2d(weight, row_dq=True, elem=cfg.elem, dq_dtype=torch.float32)["row_dq"]
            y = xo["row_dq"] @ wdq.t()
            if bias is not None:
                y = y + bias.float()
        elif cfg.cuda_backend() == "triton":
            from gemzoo_mxfp8.ops import gemm_op

            xo = cast2d(x2, row_q=True, col_q=need_w, elem=cfg.elem, rht=rht)
            wdq = cast2d(weight, row_dq=True, elem=cfg.elem)["row_dq"]  # small: dequantized once, exact in bf16
            y = gemm_op(*xo["row"], wdq, None, bias=bias, out_dtype=out_dtype)
        else:  # cublas, hybrid; hybrid's Triton wgrad reads X^T along tokens, cuBLAS takes X's own layout
            layout = "t" if cfg.cuda_backend() == "hybrid" else "n"
            xo = cast2d(x2, row_dq=True, col_q=need_w, elem=cfg.elem, rht=rht, col_layout=layout)
            wdq = cast2d(weight, row_dq=True, elem=cfg.elem)["row_dq"]
            y = F.linear(xo["row_dq"], wdq, None if bias is None else bias.to(torch.bfloat16))
        xc = xo.get("col", (None, None))
        ctx.save_for_backward(weight, *xc)  # the weight is the parameter itself; X only as MX
        ctx.cfg, ctx.x_shape, ctx.x_dtype, ctx.has_bias, ctx.m = cfg, x.shape, x.dtype, bias is not None, x2.shape[0]
        return y.to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        weight, xc_data, xc_scale = ctx.saved_tensors
        cfg = ctx.cfg
        n, k = weight.shape
        dy2 = dy.reshape(-1, n)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        rht = _rht(cfg)
        dx = dw = db = None
        mp = xc_data.shape[1] if xc_data is not None else 0
        if not on_triton(dy):
            do = cast2d(dy2, row_dq=need_x, col_dq=need_w, elem=cfg.grad_elem, rht=rht, dq_dtype=torch.float32)
            if need_x:
                wc = cast2d(weight, col_dq=True, elem=cfg.elem, dq_dtype=torch.float32)["col_dq"]  # [K, Np]
                dx = do["row_dq"] @ wc[:, :n].t()
            if need_w:
                dw = do["col_dq"] @ dequant2d(xc_data, xc_scale, torch.float32).t()
        elif cfg.cuda_backend() == "triton":
            from gemzoo_mxfp8.ops import gemm_op

            do = cast2d(dy2, row_q=need_x, col_q=need_w, elem=cfg.grad_elem, rht=rht)
            if need_x:
                wc = cast2d(weight, col_dq=True, elem=cfg.elem)["col_dq"]  # W^T in MX along N: [K, Np]
                dx = gemm_op(*do["row"], wc, None, k=n, out_dtype=ctx.x_dtype)
            if need_w:
                dw = gemm_op(*do["col"], xc_data, xc_scale, k=mp, out_dtype=weight.dtype)
        else:
            hybrid = cfg.cuda_backend() == "hybrid"
            do = cast2d(dy2, row_dq=need_x, col_dq=need_w and not hybrid, col_q=need_w and hybrid,
                        elem=cfg.grad_elem, rht=rht, col_layout="t" if hybrid else "n")
            if need_x:
                wc = cast2d(weight, col_dq=True, elem=cfg.elem)["col_dq"]
                dx = do["row_dq"] @ wc[:, :n].t()
            if need_w and hybrid:
                from gemzoo_mxfp8.ops import gemm_op

                dw = gemm_op(*do["col"], xc_data, xc_scale, k=mp, out_dtype=weight.dtype)
            elif need_w:  # both in their own layout, [Mp, N] and [Mp, K]: cuBLAS reads the transpose
                dw = do["col_dq"].t() @ dequant2d(xc_data, xc_scale, torch.bfloat16, axis=0)
        if need_x:
            dx = dx.to(ctx.x_dtype).view(ctx.x_shape)
        if need_w:
            dw = dw.to(weight.dtype)
        if need_b and ctx.has_bias:
            db = dy2.float().sum(0)
        return dx, dw, db, None


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              cfg: MXLinearConfig = MXLinearConfig()) -> torch.Tensor:
    return MXLinearFunction.apply(x, weight, bias, cfg)


class MXLinear(nn.Module):
    """Drop-in for nn.Linear (same parameters, same state-dict names) whose matmuls run in MXFP8."""

    precision = "mxfp8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, cfg=MXLinearConfig(),
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.cfg = in_features, out_features, cfg
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: MXLinearConfig = MXLinearConfig()) -> MXLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features, new.cfg = linear.in_features, linear.out_features, cfg
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MXLinear expects inputs with last dim {self.in_features}, got {tuple(x.shape)}")
        return mx_linear(x, self.weight, self.bias, self.cfg)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rht={self.cfg.rht}")
