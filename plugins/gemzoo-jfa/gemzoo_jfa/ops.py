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
    last_dim_contiguous,
    launch_fwd,
    options_at,
    options_index,
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

__all__ = ["KERNEL", "jfa_attention", "jfa_triton", "jfa_fwd", "jfa_bwd", "jfa_fwd_rb", "jfa_bwd_rb"]
