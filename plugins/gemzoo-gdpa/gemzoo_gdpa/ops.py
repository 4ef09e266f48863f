"""Torch custom ops for GDPA over gemzoo-jfa's kernel family (fake implementations included, so
torch.compile traces them).

    gemzoo_gdpa::fwd(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window) -> out
    gemzoo_gdpa::bwd(do, q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window)
        -> (dq, dk, dv)

``activation`` is a code of ``gemzoo_jfa.ops.ACTIVATION_CODES`` (never 0: softmax is jfa's); ``window``
is -1 for "no window". Pointwise attention saves nothing but q, k, v: no logsumexp, no delta.
"""

from __future__ import annotations

import torch

from gemzoo_jfa.ops import _last_dim_contiguous, check_triton_inputs


def _codes() -> dict[str, int]:
    from gemzoo_jfa.ops import ACTIVATION_CODES

    return ACTIVATION_CODES


# -- custom ops --------------------------------------------------------------------------------------

def _fwd_body(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window):
    """(out, None): pointwise attention saves no logsumexp."""
    from gemzoo_jfa.ops import _launch_fwd

    tq, h, _ = q.shape
    out = torch.empty(tq, h, v.shape[2], device=q.device, dtype=q.dtype)
    if tq == 0 or h == 0:
        return out, None
    if k.shape[0] == 0:
        return out.zero_(), None
    _launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, None, activation, inv_norm)
    return out, None


def _bwd_body(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, inv_norm, window):
    """(dq, dk, dv); ``out`` and ``lse`` are not read (pointwise needs neither)."""
    from gemzoo_jfa.ops import backward

    return backward(do, q, k, v, None, None, q_offsets, k_offsets, causal, scale, window, activation, inv_norm)


@torch.library.custom_op("gemzoo_gdpa::fwd", mutates_args=())
def gdpa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
             causal: bool, activation: int, scale: float, inv_norm: float, window: int) -> torch.Tensor:
    return _fwd_body(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window)[0]


@gdpa_fwd.register_fake
def _gdpa_fwd_fake(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("gemzoo_gdpa::bwd", mutates_args=())
def gdpa_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
             k_offsets: torch.Tensor, causal: bool, activation: int, scale: float, inv_norm: float,
             window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_body(do, q, k, v, None, None, q_offsets, k_offsets, causal, activation, scale, inv_norm, window)


@gdpa_bwd.register_fake
def _gdpa_bwd_fake(do, q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window = inputs
    ctx.save_for_backward(q, k, v, q_offsets, k_offsets)
    ctx.args = causal, activation, scale, inv_norm, window


def _backward(ctx, dout):
    q, k, v, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv = gdpa_bwd(dout, q, k, v, q_offsets, k_offsets, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


gdpa_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- public entry ------------------------------------------------------------------------------------

def _check(q, k, v, q_offsets, k_offsets, **options):
    """Against the registered kernel's capabilities, so softmax, block_size or rotary fail the same way on
    every device, naming the kernels that serve them."""
    from gemzoo_gdpa.plugin import KERNEL

    return check_triton_inputs(KERNEL, "gdpa", q, k, v, q_offsets, k_offsets, **options)


def gdpa_triton(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="silu", scale=None, norm=None,
                max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None):
    """Generalized dot-product attention through the Triton kernels on q's device (CPU needs TRITON_INTERPRET=1).

    Same signature and meaning as every gemzoo attention kernel (see gemzoo.interfaces.attention), for the
    pointwise activations: out = (act(scale * Q K^T) on allowed pairs, 0 elsewhere) / norm @ V. Unlike the
    registered kernel (whose callers always name the activation) the default here is silu, HSTU's.
    """
    q_offsets, k_offsets = _check(q, k, v, q_offsets, k_offsets, activation=activation, causal=causal, scale=scale,
                                  norm=norm, max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
                                  window=window, rope_theta=rope_theta)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    inv_norm = 1.0 if norm is None else 1.0 / float(norm)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    from gemzoo_jfa.ops import run_attention

    return run_attention(gdpa_fwd, _fwd_body, _bwd_body, q, k, v, q_offsets, k_offsets, bool(causal),
                         _codes()[activation], scale, inv_norm, -1 if window is None else int(window))


__all__ = ["gdpa_triton", "gdpa_fwd", "gdpa_bwd"]
