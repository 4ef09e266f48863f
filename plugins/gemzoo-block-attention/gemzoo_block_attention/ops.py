"""Torch custom ops for block attention over gemzoo-jfa's kernel family (fake implementations included, so
torch.compile traces them).

    gemzoo_block_attention::fwd(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window,
                                block, rope_theta) -> (out, lse)
    gemzoo_block_attention::bwd(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale,
                                inv_norm, window, block, rope_theta) -> (dq, dk, dv)

``activation`` is a code of ``gemzoo_jfa.ops.ACTIVATION_CODES`` (0 softmax, else pointwise); ``window`` and
``block`` are -1 for "off", ``rope_theta`` 0.0. ``lse`` is [H, Tq] fp32 (base 2) for softmax and [H, 0]
for pointwise activations, which save nothing but q, k, v. RoPE is applied to the q and k tiles inside
the kernels (and undone on dq, dk), so no rotated copy of q or k is written or saved.
"""

from __future__ import annotations

import contextlib

import torch

from gemzoo_jfa.ops import _last_dim_contiguous, check_triton_inputs


def _jfa_ops():
    from gemzoo_jfa import ops

    return ops


def block_configs(q: torch.Tensor, block: int):
    """Tile shapes for a block mask: with blocks of at most 64 positions, 64x64 tiles in all three kernels
    (bf16/fp16, D <= 128), so a 64-block's tiles are all fully allowed or causal-diagonal instead of half
    masked as with jfa's 128-row tiles; None (jfa's defaults) otherwise."""
    if q.device.type != "cuda" or block <= 0 or block > 64 or q.element_size() != 2 or q.shape[-1] > 128:
        return None
    ops = _jfa_ops()
    c = ops.KernelConfig(64, 64, 4, 3)
    return ops.Configs(c, c, c)


@contextlib.contextmanager
def _tiles(q: torch.Tensor, block: int):
    ops = _jfa_ops()
    configs = block_configs(q, block) if ops._override is None else None  # a caller's override (bench) wins
    with ops.using(configs):
        yield


# -- bodies (run by the custom ops, and in eager by gemzoo_jfa.ops.run_attention) ----------------------

def _fwd_body(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block, rope_theta):
    tq, h, _ = q.shape
    out = torch.empty(tq, h, v.shape[2], device=q.device, dtype=q.dtype)
    lse = torch.empty(h, tq if activation == 0 else 0, device=q.device, dtype=torch.float32)
    if tq == 0 or h == 0:
        return out, lse
    if k.shape[0] == 0:
        return out.zero_(), lse.fill_(float("inf"))
    with _tiles(q, block):
        _jfa_ops()._launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out,
                               lse if activation == 0 else None, activation, inv_norm, block, rope_theta)
    return out, lse


def _bwd_body(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block,
              rope_theta):
    with _tiles(q, block):
        return _jfa_ops().backward(do, q, k, v, out if activation == 0 else None, lse if activation == 0 else None,
                                   q_offsets, k_offsets, causal, scale, window, activation, inv_norm, block,
                                   rope_theta)


# -- custom ops --------------------------------------------------------------------------------------

@torch.library.custom_op("gemzoo_block_attention::fwd", mutates_args=())
def block_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
              causal: bool, activation: int, scale: float, inv_norm: float, window: int, block: int,
              rope_theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_body(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block, rope_theta)


@block_fwd.register_fake
def _block_fwd_fake(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block, rope_theta):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2]),
            q.new_empty(q.shape[1], q.shape[0] if activation == 0 else 0, dtype=torch.float32))


@torch.library.custom_op("gemzoo_block_attention::bwd", mutates_args=())
def block_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor, causal: bool, activation: int,
              scale: float, inv_norm: float, window: int, block: int,
              rope_theta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_body(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block,
                     rope_theta)


@block_bwd.register_fake
def _block_bwd_fake(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block,
                    rope_theta):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block, rope_theta = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out if activation == 0 else None, lse, q_offsets, k_offsets)
    ctx.args = causal, activation, scale, inv_norm, window, block, rope_theta
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, q_offsets, k_offsets = ctx.saved_tensors
    if out is None:  # pointwise: the op's schema still wants a tensor (never read)
        out = lse
    dq, dk, dv = block_bwd(dout, q, k, v, out, lse, q_offsets, k_offsets, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


block_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- rotary in torch (CPU dispatch, and the unfused baseline of the bench) --------------------------------

def rope_jagged(q, k, q_offsets, k_offsets, theta: float):
    """q and k rotated in torch by DESIGN.md's rule (query i of a sequence at i + Lk - Lq, key j at j), in
    fp32 and cast back: new tensors (what the fused kernels avoid)."""
    from gemzoo.interfaces.attention import apply_rope
    from gemzoo.jagged import positions, seq_ids

    tq, tk = q.shape[0], k.shape[0]
    shift = (k_offsets.diff() - q_offsets.diff())[seq_ids(q_offsets, tq)]
    q_pos = positions(q_offsets, tq) + shift
    k_pos = positions(k_offsets, tk)
    return (apply_rope(q.float(), q_pos, theta).to(q.dtype), apply_rope(k.float(), k_pos, theta).to(k.dtype))


# -- public entry ------------------------------------------------------------------------------------

def _check(q, k, v, q_offsets, k_offsets, **options):
    """Against the registered kernel's capabilities (block_size, window, rope_theta > 0 and an even head dim
    with it, ...)."""
    from gemzoo_block_attention.plugin import KERNEL

    return check_triton_inputs(KERNEL, "block-attention", q, k, v, q_offsets, k_offsets, **options)


def block_attention_triton(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                           norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None,
                           rope_theta=None):
    """Block-sparse jagged attention through the Triton kernels on q's device (CPU needs TRITON_INTERPRET=1).

    The interface of every gemzoo attention kernel (gemzoo.interfaces.attention): key j is allowed for query
    i iff (i + s) // block_size == j // block_size (s = Lk - Lq; blocks counted from each sequence's start),
    and causal / window hold; softmax or a pointwise activation (with norm); ``rope_theta`` applies RoPE
    (half-split, positions within each sequence) to q and k inside the kernels. Only tiles holding allowed
    pairs are loaded, so with a fixed block and window the time grows linearly with the lengths.
    """
    from gemzoo_jfa.ops import ACTIVATION_CODES

    q_offsets, k_offsets = _check(q, k, v, q_offsets, k_offsets, activation=activation, causal=causal,
                                  scale=scale, norm=norm, max_q_len=max_q_len, max_k_len=max_k_len,
                                  block_size=block_size, window=window, rope_theta=rope_theta)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    inv_norm = 1.0 if norm is None else 1.0 / float(norm)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    return _jfa_ops().run_attention(lambda *a: block_fwd(*a)[0], _fwd_body, _bwd_body, q, k, v, q_offsets,
                                    k_offsets, bool(causal), ACTIVATION_CODES[activation], scale, inv_norm,
                                    -1 if window is None else int(window),
                                    -1 if block_size is None else int(block_size),
                                    0.0 if rope_theta is None else float(rope_theta))


__all__ = ["block_attention_triton", "block_fwd", "block_bwd", "block_configs", "rope_jagged"]
