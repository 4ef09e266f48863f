"""Torch custom ops for GDPA over gemzoo-jfa's kernel family (fake implementations included, so
torch.compile traces them), its input check and its registered kernel.

    gemzoo_gdpa::fwd(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, options) -> out
    gemzoo_gdpa::bwd(do, q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, options)
        -> (dq, dk, dv)

With a relative bias (``gemzoo.api.RelativeAttentionBias``, computed inside the tiles):

    gemzoo_gdpa::fwd_rb(q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal,
                        activation, scale, inv_norm, window, bucket_divisor, options) -> out
    gemzoo_gdpa::bwd_rb(do, q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal,
                        activation, scale, inv_norm, window, bucket_divisor, options)
        -> (dq, dk, dv, d positions, d time_weights (empty without time weights))

``activation`` is a code of ``gemzoo.api.ACTIVATION_CODES`` (never 0: softmax is jfa's); ``window`` is -1
for "no window"; ``options`` a ``gemzoo_jfa.family.options_index``. Pointwise attention saves nothing but
q, k, v (and the bias's tables and timestamps): no logsumexp, no delta.
"""

from __future__ import annotations

import dataclasses

import torch
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

from gemzoo.api import ACTIVATION_CODES, ACTIVATIONS, FunctionKernel

POINTWISE = frozenset(a for a in ACTIVATIONS if a != "softmax")


# -- custom ops --------------------------------------------------------------------------------------

def _fwd_body(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, options=0):
    """(out, None): pointwise attention saves no logsumexp."""
    tq, h, _ = q.shape
    out = torch.empty(tq, h, v.shape[2], device=q.device, dtype=q.dtype)
    if tq == 0 or h == 0:
        return out, None
    if k.shape[0] == 0:
        return out.zero_(), None
    launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, None, activation, inv_norm,
               options=options_at(options))
    return out, None


def _bwd_body(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, options=0):
    """(dq, dk, dv); ``out`` and ``lse`` are not read (pointwise needs neither)."""
    return backward(do, q, k, v, None, None, q_offsets, k_offsets, causal, scale, window, activation, inv_norm,
                    options=options_at(options))


@torch.library.custom_op("gemzoo_gdpa::fwd", mutates_args=())
def gdpa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
             causal: bool, activation: int, scale: float, inv_norm: float, window: int,
             options: int = 0) -> torch.Tensor:
    return _fwd_body(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, options)[0]


@gdpa_fwd.register_fake
def _gdpa_fwd_fake(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, options=0):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("gemzoo_gdpa::bwd", mutates_args=())
def gdpa_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
             k_offsets: torch.Tensor, causal: bool, activation: int, scale: float, inv_norm: float,
             window: int, options: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_body(do, q, k, v, None, None, q_offsets, k_offsets, causal, activation, scale, inv_norm, window,
                     options)


@gdpa_bwd.register_fake
def _gdpa_bwd_fake(do, q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, options=0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, *args = inputs
    ctx.save_for_backward(q, k, v, q_offsets, k_offsets)
    ctx.args = tuple(args)


def _backward(ctx, dout):
    q, k, v, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv = gdpa_bwd(dout, q, k, v, q_offsets, k_offsets, *ctx.args)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.args)


gdpa_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- custom ops with a relative bias -----------------------------------------------------------------

def _fwd_rb_body(q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal, activation, scale,
                 inv_norm, window, bucket_divisor, options=0):
    """(out, None), the relative bias computed in the tiles."""
    tq, h, _ = q.shape
    out = torch.empty(tq, h, v.shape[2], device=q.device, dtype=q.dtype)
    if tq == 0 or h == 0:
        return out, None
    if k.shape[0] == 0:
        return out.zero_(), None
    launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, None, activation, inv_norm,
               options=options_at(options),
               rel=relative_bias_args(positions, time_weights, q_times, k_times, bucket_divisor))
    return out, None


def _bwd_rb_body(do, q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal,
                 activation, scale, inv_norm, window, bucket_divisor, options=0):
    """(dq, dk, dv, d positions, d time_weights or None); ``out`` and ``lse`` are not read."""
    return backward(do, q, k, v, None, None, q_offsets, k_offsets, causal, scale, window, activation, inv_norm,
                    options=options_at(options),
                    rel=relative_bias_args(positions, time_weights, q_times, k_times, bucket_divisor))


@torch.library.custom_op("gemzoo_gdpa::fwd_rb", mutates_args=())
def gdpa_fwd_rb(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
                positions: torch.Tensor, time_weights: torch.Tensor | None, q_times: torch.Tensor | None,
                k_times: torch.Tensor | None, causal: bool, activation: int, scale: float, inv_norm: float,
                window: int, bucket_divisor: float, options: int = 0) -> torch.Tensor:
    return _fwd_rb_body(q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, causal, activation,
                        scale, inv_norm, window, bucket_divisor, options)[0]


@gdpa_fwd_rb.register_fake
def _gdpa_fwd_rb_fake(q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, *args):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("gemzoo_gdpa::bwd_rb", mutates_args=())
def gdpa_bwd_rb(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                k_offsets: torch.Tensor, positions: torch.Tensor, time_weights: torch.Tensor | None,
                q_times: torch.Tensor | None, k_times: torch.Tensor | None, causal: bool, activation: int,
                scale: float, inv_norm: float, window: int, bucket_divisor: float, options: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, d_pos, d_tw = _bwd_rb_body(do, q, k, v, None, None, q_offsets, k_offsets, positions, time_weights,
                                           q_times, k_times, causal, activation, scale, inv_norm, window,
                                           bucket_divisor, options)
    return dq, dk, dv, d_pos, positions.new_empty(0) if d_tw is None else d_tw


@gdpa_bwd_rb.register_fake
def _gdpa_bwd_rb_fake(do, q, k, v, q_offsets, k_offsets, positions, time_weights, *args):
    d_tw = positions.new_empty(0) if time_weights is None else torch.empty_like(time_weights)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(positions), d_tw


def _setup_context_rb(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9])
    ctx.args = tuple(inputs[9:])


def _backward_rb(ctx, dout):
    q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times = ctx.saved_tensors
    dq, dk, dv, d_pos, d_tw = gdpa_bwd_rb(dout, q, k, v, q_offsets, k_offsets, positions, time_weights, q_times,
                                          k_times, *ctx.args)
    return (dq, dk, dv, None, None, d_pos, None if time_weights is None else d_tw, None, None) + (None,) * len(ctx.args)


gdpa_fwd_rb.register_autograd(_backward_rb, setup_context=_setup_context_rb)


# -- public entry ------------------------------------------------------------------------------------

def gdpa_triton(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="silu", scale=None, norm=None,
                max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None, relative_bias=None,
                options: KernelOptions | None = None):
    """Generalized dot-product attention through the Triton kernels on q's device (CPU needs TRITON_INTERPRET=1).

    Same signature and meaning as every gemzoo attention kernel (see gemzoo.api.AttentionKernel), for the
    pointwise activations: out = (act(scale * Q K^T) on allowed pairs, 0 elsewhere) / norm @ V. Unlike the
    registered kernel (whose callers always name the activation) the default here is silu, HSTU's. Checked
    against the registered kernel's capabilities, so softmax, block_size or rotary fail the same way on every
    device, naming the kernels that serve them. ``relative_bias`` (a ``gemzoo.api.RelativeAttentionBias``) is
    computed inside the tiles from its tables and timestamps, differentiable in both tables. ``options``
    (``gemzoo_jfa.family.KernelOptions``) sets tiles, schedule order, TMA, the key split and buckets.
    """
    q_offsets, k_offsets = check_triton_inputs(KERNEL, "gdpa", q, k, v, q_offsets, k_offsets, activation=activation,
                                               causal=causal, scale=scale, norm=norm, max_q_len=max_q_len,
                                               max_k_len=max_k_len, block_size=block_size, window=window,
                                               rope_theta=rope_theta, relative_bias=relative_bias)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    inv_norm = 1.0 if norm is None else 1.0 / float(norm)
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    if relative_bias is not None:
        return run_attention_rel(gdpa_fwd_rb, _fwd_rb_body, _bwd_rb_body, q, k, v, q_offsets, k_offsets,
                                 relative_bias, bool(causal), ACTIVATION_CODES[activation], scale, inv_norm,
                                 -1 if window is None else int(window), float(relative_bias.bucket_divisor),
                                 options_index(options))
    return run_attention(gdpa_fwd, _fwd_body, _bwd_body, q, k, v, q_offsets, k_offsets, bool(causal),
                         ACTIVATION_CODES[activation], scale, inv_norm, -1 if window is None else int(window),
                         options_index(options))


def gdpa_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    """Generalized dot-product attention; CUDA tensors run the Triton kernels, others the CPU kernel (after
    the same capability check, so the fallback accepts nothing gdpa does not declare)."""
    return KERNEL(q, k, v, q_offsets, k_offsets, **kw)


KERNEL = FunctionKernel(
    gdpa_triton,
    # jfa's family, pointwise instead of softmax, and the fused relative bias
    dataclasses.replace(FAMILY_CAPABILITIES, activations=POINTWISE, relative_bias=True),
    "Generalized dot-product attention: pointwise activations (" + ", ".join(sorted(POINTWISE)) + ") with "
    "norm, causal/full/window, Lq != Lk (split-K path for short-Q/long-K cross attention), a relative "
    "position/time bias computed in the tiles (HSTU's); Triton fwd+bwd on "
    "jagged q/k/v sharing jfa's kernels; CPU tensors go to the 'cpu' kernel or 'reference'",
    cpu_fallback="cpu",
)

__all__ = ["KERNEL", "POINTWISE", "gdpa_attention", "gdpa_triton", "gdpa_fwd", "gdpa_bwd", "gdpa_fwd_rb", "gdpa_bwd_rb"]
