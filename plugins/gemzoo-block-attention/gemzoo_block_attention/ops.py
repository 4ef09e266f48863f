"""Torch custom ops for block attention over gemzoo-jfa's kernel family (fake implementations included, so
torch.compile traces them).

    gemzoo_block_attention::fwd(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window,
                                block, rope_theta, options) -> (out, lse)
    gemzoo_block_attention::bwd(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale,
                                inv_norm, window, block, rope_theta, options) -> (dq, dk, dv)

``activation`` is a code of ``gemzoo.api.ACTIVATION_CODES`` (0 softmax, else pointwise); ``window`` and
``block`` are -1 for "off", ``rope_theta`` 0.0; ``options`` a ``gemzoo_jfa.family.options_index``. ``lse`` is
[H, Tq] fp32 (base 2) for softmax and [H, 0] for pointwise activations, which save nothing but q, k, v. RoPE
is applied to the q and k tiles inside the kernels (and undone on dq, dk), so no rotated copy of q or k is
written or saved.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from gemzoo_jfa.family import (
    DEFAULT_OPTIONS,
    FAMILY_CAPABILITIES,
    Configs,
    KernelConfig,
    KernelOptions,
    backward,
    check_triton_inputs,
    last_dim_contiguous,
    launch_fwd,
    options_at,
    options_index,
    run_attention,
)

from gemzoo.api import ACTIVATION_CODES, ACTIVATIONS, FunctionKernel, apply_rope, check_inputs, positions, seq_ids


def block_configs(q: torch.Tensor, block: int):
    """Tile shapes for a block mask: with blocks of at most 64 positions, 64x64 tiles in all three kernels
    (bf16/fp16, D <= 128), so a 64-block's tiles are all fully allowed or causal-diagonal instead of half
    masked as with jfa's 128-row tiles; None (jfa's defaults) otherwise."""
    if q.device.type != "cuda" or block <= 0 or block > 64 or q.element_size() != 2 or q.shape[-1] > 128:
        return None
    return _SMALL_BLOCK_CONFIGS


_SMALL_BLOCK_TILE = KernelConfig(64, 64, 4, 3)
_SMALL_BLOCK_CONFIGS = Configs(_SMALL_BLOCK_TILE, _SMALL_BLOCK_TILE, _SMALL_BLOCK_TILE)


def block_options(q: torch.Tensor, block: int, options: KernelOptions | None = None) -> KernelOptions:
    """``options`` (None: the defaults) with ``block_configs``' tiles, unless they set tiles themselves (bench)."""
    options = DEFAULT_OPTIONS if options is None else options
    configs = block_configs(q, block) if options.configs is None else None
    return options if configs is None else _with_configs(options, configs)


@functools.lru_cache(maxsize=64)
def _with_configs(options: KernelOptions, configs: Configs) -> KernelOptions:
    """One KernelOptions object per (options, tiles): two calls a step (forward, backward) build none."""
    return dataclasses.replace(options, configs=configs)


# -- bodies (run by the custom ops, and in eager by gemzoo_jfa.family.run_attention) ----------------------

def _fwd_body(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block, rope_theta,
              options=0):
    tq, h, _ = q.shape
    out = torch.empty(tq, h, v.shape[2], device=q.device, dtype=q.dtype)
    lse = torch.empty(h, tq if activation == 0 else 0, device=q.device, dtype=torch.float32)
    if tq == 0 or h == 0:
        return out, lse
    if k.shape[0] == 0:
        return out.zero_(), lse.fill_(float("inf"))
    launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, lse if activation == 0 else None,
               activation, inv_norm, block, rope_theta, block_options(q, block, options_at(options)))
    return out, lse


def _bwd_body(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block,
              rope_theta, options=0):
    return backward(do, q, k, v, out if activation == 0 else None, lse if activation == 0 else None, q_offsets,
                    k_offsets, causal, scale, window, activation, inv_norm, block, rope_theta,
                    block_options(q, block, options_at(options)))


# -- custom ops --------------------------------------------------------------------------------------

@torch.library.custom_op("gemzoo_block_attention::fwd", mutates_args=())
def block_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
              causal: bool, activation: int, scale: float, inv_norm: float, window: int, block: int,
              rope_theta: float, options: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_body(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block, rope_theta,
                     options)


@block_fwd.register_fake
def _block_fwd_fake(q, k, v, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block, rope_theta,
                    options=0):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2]),
            q.new_empty(q.shape[1], q.shape[0] if activation == 0 else 0, dtype=torch.float32))


@torch.library.custom_op("gemzoo_block_attention::bwd", mutates_args=())
def block_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor, causal: bool, activation: int,
              scale: float, inv_norm: float, window: int, block: int, rope_theta: float,
              options: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_body(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block,
                     rope_theta, options)


@block_bwd.register_fake
def _block_bwd_fake(do, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, inv_norm, window, block,
                    rope_theta, options=0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out if args[1] == 0 else None, lse, q_offsets, k_offsets)  # args[1]: activation
    ctx.args = tuple(args)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, q_offsets, k_offsets = ctx.saved_tensors
    if out is None:  # pointwise: the op's schema still wants a tensor (never read)
        out = lse
    dq, dk, dv = block_bwd(dout, q, k, v, out, lse, q_offsets, k_offsets, *ctx.args)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.args)


block_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- rotary in torch (CPU dispatch, and the unfused baseline of the bench) --------------------------------

def rope_jagged(q, k, q_offsets, k_offsets, theta: float):
    """q and k rotated in torch by docs/attention.md's rule (query i of a sequence at i + Lk - Lq, key j at j), in
    fp32 and cast back: new tensors (what the fused kernels avoid)."""
    tq, tk = q.shape[0], k.shape[0]
    shift = (k_offsets.diff() - q_offsets.diff())[seq_ids(q_offsets, tq)]
    q_pos = positions(q_offsets, tq) + shift
    k_pos = positions(k_offsets, tk)
    return (apply_rope(q.float(), q_pos, theta).to(q.dtype), apply_rope(k.float(), k_pos, theta).to(k.dtype))


# -- public entry ------------------------------------------------------------------------------------

def block_attention_triton(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                           norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None,
                           rope_theta=None, options: KernelOptions | None = None):
    """Block-sparse jagged attention through the Triton kernels on q's device (CPU needs TRITON_INTERPRET=1).

    The interface of every gemzoo attention kernel (gemzoo.interfaces.attention): key j is allowed for query
    i iff (i + s) // block_size == j // block_size (s = Lk - Lq; blocks counted from each sequence's start),
    and causal / window hold; softmax or a pointwise activation (with norm); ``rope_theta`` applies RoPE
    (half-split, positions within each sequence) to q and k inside the kernels. Only tiles holding allowed
    pairs are loaded, so with a fixed block and window the time grows linearly with the lengths. Checked
    against the registered kernel's capabilities (block_size, window, rope_theta > 0 and an even head dim
    with it, ...). ``options`` (``gemzoo_jfa.family.KernelOptions``) sets schedule order, TMA, buckets and
    fused dQ; its tiles, when set, replace ``block_configs``.
    """
    q_offsets, k_offsets = check_triton_inputs(KERNEL, "block-attention", q, k, v, q_offsets, k_offsets,
                                               activation=activation, causal=causal, scale=scale, norm=norm,
                                               max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
                                               window=window, rope_theta=rope_theta)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    inv_norm = 1.0 if norm is None else 1.0 / float(norm)
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    return run_attention(lambda *a: block_fwd(*a)[0], _fwd_body, _bwd_body, q, k, v, q_offsets, k_offsets,
                         bool(causal), ACTIVATION_CODES[activation], scale, inv_norm,
                         -1 if window is None else int(window), -1 if block_size is None else int(block_size),
                         0.0 if rope_theta is None else float(rope_theta), options_index(options))


def _block_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    if q.device.type == "cuda":
        return block_attention_triton(q, k, v, q_offsets, k_offsets, **kw)
    # CPU: the same check as the Triton path, then the C++ kernel (rotary applied in torch first; autograd
    # goes through the rotation) or the reference when the extension is not built
    q_offsets, k_offsets = check_inputs(q, k, v, q_offsets, k_offsets, capabilities=KERNEL.capabilities,
                                        kernel=KERNEL, **kw)
    theta = kw.pop("rope_theta", None)
    if theta is not None:
        q, k = rope_jagged(q, k, q_offsets, k_offsets, theta)
    return _UNROTATED(q, k, v, q_offsets, k_offsets, **kw)


# jfa's family plus blocks and RoPE; softmax and every pointwise activation (jfa's shared tile loop)
CAPABILITIES = dataclasses.replace(FAMILY_CAPABILITIES, activations=frozenset(ACTIVATIONS), block=True, rotary=True)

KERNEL = FunctionKernel(
    _block_attention,
    CAPABILITIES,
    "Block-sparse jagged attention (GEM BlockAttention): block_size blocks from each sequence's start, "
    "optional sliding window, fused RoPE (rope_theta), softmax or pointwise activations; Triton fwd+bwd on "
    "jfa's kernel family, grid over allowed tiles only; CPU tensors go to the 'cpu' kernel or 'reference'",
)

# CPU tensors after the rotation in torch: the 'cpu' kernel, or 'reference' when the extension is not built
_UNROTATED = FunctionKernel(block_attention_triton, dataclasses.replace(CAPABILITIES, rotary=False),
                            "block attention on CPU tensors with q and k already rotated", cpu_fallback="cpu")

__all__ = ["KERNEL", "block_attention_triton", "block_fwd", "block_bwd", "block_configs", "block_options",
           "rope_jagged"]
