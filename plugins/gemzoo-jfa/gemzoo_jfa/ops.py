"""jfa's torch custom ops over the family's launch functions (fake implementations included, so torch.compile
traces them), its input check and its registered kernel.

    gemzoo_jfa::fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, options) -> (out, lse)
    gemzoo_jfa::bwd(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, options) -> (dq, dk, dv)

With a relative bias (``gemzoo.api.RelativeAttentionBias``, computed inside the tiles):

    gemzoo_jfa::fwd_rb(q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal, scale,
                       window, bucket_divisor, options) -> (out, lse)
    gemzoo_jfa::bwd_rb(do, q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights, q_times, k_times,
                       causal, scale, window, bucket_divisor, options)
        -> (dq, dk, dv, d positions, d time_weights (empty without time weights))

``window`` is -1 for "no window". ``lse`` is [H, Tq] fp32, base 2, +inf on rows with no allowed key.
``options`` is a ``gemzoo_jfa.family.options_index`` (0: the default KernelOptions).
"""

from __future__ import annotations

import dataclasses

import torch

from gemzoo.api import FunctionKernel
from gemzoo_jfa.family import (
    FAMILY_CAPABILITIES,
    KernelOptions,
    backward,
    check_triton_inputs,
    dequantize_fp8,
    fp8_blocks,
    last_dim_contiguous,
    launch_fwd,
    options_at,
    options_index,
    quantize_fp8_reference,
    relative_bias_args,
    run_attention,
    run_attention_rel,
)


def _fwd_body(q, k, v, q_offsets, k_offsets, causal, scale, window, options=0):
    tq, h, _ = q.shape
    out = torch.empty(tq, h, v.shape[2], device=q.device, dtype=q.dtype)
    lse = torch.empty(h, tq, device=q.device, dtype=torch.float32)
    if tq > 0 and h > 0:
        launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, lse, options=options_at(options))
    return out, lse


def _bwd_body(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, options=0):
    return backward(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, options=options_at(options))


@torch.library.custom_op("gemzoo_jfa::fwd", mutates_args=())
def jfa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
            causal: bool, scale: float, window: int, options: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_body(q, k, v, q_offsets, k_offsets, causal, scale, window, options)


@jfa_fwd.register_fake
def _jfa_fwd_fake(q, k, v, q_offsets, k_offsets, causal, scale, window, options=0):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("gemzoo_jfa::bwd", mutates_args=())
def jfa_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor, causal: bool, scale: float,
            window: int, options: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_body(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, options)


@jfa_bwd.register_fake
def _jfa_bwd_fake(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, options=0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, causal, scale, window, *rest = inputs
    options = rest[0] if rest else 0
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, k_offsets)
    ctx.causal, ctx.scale, ctx.window, ctx.options = causal, scale, window, options
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv = jfa_bwd(dout, q, k, v, out, lse, q_offsets, k_offsets, ctx.causal, ctx.scale, ctx.window,
                         ctx.options)
    return dq, dk, dv, None, None, None, None, None, None


jfa_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- custom ops with a relative bias -----------------------------------------------------------------

def _fwd_rb_body(q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal, scale, window,
                 bucket_divisor, options=0):
    tq, h, _ = q.shape
    out = torch.empty(tq, h, v.shape[2], device=q.device, dtype=q.dtype)
    lse = torch.empty(h, tq, device=q.device, dtype=torch.float32)
    if tq > 0 and h > 0:
        launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, lse, options=options_at(options),
                   rel=relative_bias_args(positions, time_weights, q_times, k_times, bucket_divisor))
    return out, lse


def _bwd_rb_body(do, q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal,
                 scale, window, bucket_divisor, options=0):
    """(dq, dk, dv, d positions, d time_weights or None)."""
    return backward(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, options=options_at(options),
                    rel=relative_bias_args(positions, time_weights, q_times, k_times, bucket_divisor))


@torch.library.custom_op("gemzoo_jfa::fwd_rb", mutates_args=())
def jfa_fwd_rb(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
               positions: torch.Tensor, time_weights: torch.Tensor | None, q_times: torch.Tensor | None,
               k_times: torch.Tensor | None, causal: bool, scale: float, window: int, bucket_divisor: float,
               options: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_rb_body(q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal, scale,
                        window, bucket_divisor, options)


@jfa_fwd_rb.register_fake
def _jfa_fwd_rb_fake(q, k, v, *args):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("gemzoo_jfa::bwd_rb", mutates_args=())
def jfa_bwd_rb(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor, positions: torch.Tensor,
               time_weights: torch.Tensor | None, q_times: torch.Tensor | None, k_times: torch.Tensor | None,
               causal: bool, scale: float, window: int, bucket_divisor: float, options: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, d_pos, d_tw = _bwd_rb_body(do, q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights,
                                           q_times, k_times, causal, scale, window, bucket_divisor, options)
    return dq, dk, dv, d_pos, positions.new_empty(0) if d_tw is None else d_tw


@jfa_bwd_rb.register_fake
def _jfa_bwd_rb_fake(do, q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights, *args):
    d_tw = positions.new_empty(0) if time_weights is None else torch.empty_like(time_weights)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(positions), d_tw


def _setup_context_rb(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights, q_times, k_times)
    ctx.args = tuple(args)
    ctx.mark_non_differentiable(lse)


def _backward_rb(ctx, dout, dlse):
    q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights, q_times, k_times = ctx.saved_tensors
    dq, dk, dv, d_pos, d_tw = jfa_bwd_rb(dout, q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights,
                                         q_times, k_times, *ctx.args)
    return (dq, dk, dv, None, None, d_pos, None if time_weights is None else d_tw, None, None) + (None,) * len(ctx.args)


jfa_fwd_rb.register_autograd(_backward_rb, setup_context=_setup_context_rb)


# -- the fp8 forward as a kernel of its own ----------------------------------------------------------

class _Fp8Emulated(torch.autograd.Function):
    """The fp8 forward's CPU emulation: ``kernel`` on the inputs quantised to e4m3 and back with the GPU path's
    per-block rule (quantize_fp8_reference), and the gradients of ``kernel`` at the unquantised inputs
    (straight-through, as on the GPU)."""

    @staticmethod
    def forward(ctx, kernel, kw, blocks, mode, q, k, v, q_offsets, k_offsets):
        k_off = q_offsets if k_offsets is None else k_offsets
        gq, gk = blocks

        def qdq(x, off, block):
            return dequantize_fp8(*quantize_fp8_reference(x, off, block), x.dtype)

        with torch.no_grad():
            out = kernel(qdq(q, q_offsets, gq), qdq(k, k_off, gk), qdq(v, k_off, gk) if mode == "qkv" else v,
                         q_offsets, k_offsets, **kw)
        ctx.kernel, ctx.kw, ctx.has_k_offsets = kernel, kw, k_offsets is not None
        ctx.save_for_backward(q, k, v, q_offsets, k_off)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q_offsets, k_offsets = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:7]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs, strict=True)]
            out = ctx.kernel(*leaves, q_offsets, k_offsets if ctx.has_k_offsets else None, **ctx.kw)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, dout) if wanted else ())
        return (None, None, None, None, *(next(grads) if n else None for n in needs), None, None)


def jfa_fp8_attention(q, k, v, q_offsets, k_offsets=None, *, fp8="qkv", options: KernelOptions | None = None, **kw):
    """jfa with the fp8 forward (KernelOptions.fp8 = ``fp8``, "qk" or "qkv"; the registered ``jfa-fp8`` kernel):
    CUDA tensors run the Triton kernels; CPU tensors the emulation: the CPU kernel ("cpu", else "reference") on
    q, k (and v) quantised to e4m3 and back with the same per-block rule and block sizes as the GPU path,
    gradients at the unquantised inputs. The emulation rounds the inputs as the GPU does but not P (the GPU's
    P V on an e4m3 P, "qkv") nor its tile order. (The Triton path on CPU tensors, under TRITON_INTERPRET=1:
    ``jfa_triton(..., options=KernelOptions(fp8=...))``.)"""
    if fp8 not in ("qk", "qkv"):
        raise ValueError(f"jfa-fp8 takes fp8='qk' or 'qkv', got {fp8!r}; for no fp8 use the 'jfa' kernel")
    options = dataclasses.replace(options or KernelOptions(), fp8=fp8)
    if q.device.type == "cuda":
        return jfa_triton(q, k, v, q_offsets, k_offsets, options=options, **kw)
    q_offsets, k_offsets = check_triton_inputs(KERNEL_FP8, "jfa-fp8", q, k, v, q_offsets, k_offsets, **kw)
    if kw.get("rope_theta") is not None:
        raise ValueError("jfa-fp8 does not fuse RoPE; rotate q and k first")
    # jfa's kernel object on CPU tensors is the registered "cpu" kernel (else "reference")
    return _Fp8Emulated.apply(KERNEL, kw, fp8_blocks(q, options, "cuda"), fp8, q, k, v, q_offsets, k_offsets)


@dataclasses.dataclass
class ApproximateKernel(FunctionKernel):
    """A FunctionKernel whose forward is approximate by design (fp8): ``forward_tolerance`` is the relative error
    bound the shared conformance suite holds it to instead of its dtype's (tests/test_attention_conformance.py)."""

    forward_tolerance: float = 8e-2


# e4m3 keeps 3 mantissa bits: each rounded input is off by up to 2^-4 (about 2.7% RMS), and the conformance
# cases' outputs (fp32, D=16) came out 2.9-4.8% off in relative L2; 8e-2 leaves room for other seeds
KERNEL_FP8 = ApproximateKernel(
    jfa_fp8_attention,
    FAMILY_CAPABILITIES,  # no relative bias: the CPU emulation does not give its tables' gradients
    "jfa with an fp8 (e4m3) forward: Q, K, V and P in e4m3 with per-block amax scales (QK^T and P V as fp8 "
    "matmuls), the backward in the inputs' dtype (straight-through); CPU tensors run an emulation (inputs "
    "quantised and dequantised with the same rule)",
    forward_tolerance=8e-2,
)


# -- public entry ------------------------------------------------------------------------------------

def jfa_triton(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None, norm=None,
               max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None, relative_bias=None,
               options: KernelOptions | None = None):
    """Jagged flash attention through the Triton kernels on q's device (CPU needs TRITON_INTERPRET=1).

    Same signature and meaning as every gemzoo attention kernel (see docs/attention.md), checked by the
    shared check_inputs: an option jfa does not declare (pointwise activations, norm, block_size,
    rope_theta) is an error naming the kernels that serve it; hints smaller than a real length are errors.
    ``relative_bias`` (a ``gemzoo.api.RelativeAttentionBias``) is computed inside the tiles, differentiable in
    both tables.
    ``options`` (a ``gemzoo_jfa.family.KernelOptions``) sets tiles, schedule order, TMA and buckets.
    """
    q_offsets, k_offsets = check_triton_inputs(KERNEL, "jfa", q, k, v, q_offsets, k_offsets, activation=activation,
                                               causal=causal, scale=scale, norm=norm, max_q_len=max_q_len,
                                               max_k_len=max_k_len, block_size=block_size, window=window,
                                               rope_theta=rope_theta, relative_bias=relative_bias)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    if relative_bias is not None:
        return run_attention_rel(lambda *a: jfa_fwd_rb(*a)[0], _fwd_rb_body, _bwd_rb_body, q, k, v, q_offsets,
                                 k_offsets, relative_bias, bool(causal), scale, -1 if window is None else int(window),
                                 float(relative_bias.bucket_divisor), options_index(options))
    return run_attention(lambda *a: jfa_fwd(*a)[0], _fwd_body, _bwd_body, q, k, v, q_offsets, k_offsets,
                         bool(causal), scale, -1 if window is None else int(window), options_index(options))


def jfa_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    """Jagged flash attention; CUDA tensors run the Triton kernels, others the CPU kernel (after the same
    capability check, so the fallback accepts nothing jfa does not declare)."""
    return KERNEL(q, k, v, q_offsets, k_offsets, **kw)


KERNEL = FunctionKernel(
    jfa_triton,
    dataclasses.replace(FAMILY_CAPABILITIES, relative_bias=True),  # the family's, and the fused relative bias
    "Jagged flash attention (Triton, fwd+bwd on jagged q/k/v, longest-first work schedule; a relative "
    "position/time bias computed in the tiles); CPU tensors go to the 'cpu' kernel or 'reference'",
    cpu_fallback="cpu",
)

__all__ = ["ApproximateKernel", "KERNEL", "KERNEL_FP8", "jfa_attention", "jfa_fp8_attention", "jfa_triton", "jfa_fwd", "jfa_bwd", "jfa_fwd_rb", "jfa_bwd_rb"]
