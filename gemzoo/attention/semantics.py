"""The executable semantics of jagged attention: the mask rule, RoPE, the pointwise activations, the codes the
compiled kernels use for them, and :func:`reference_attention`, the per-sequence oracle that the ``reference``
kernel registers and every kernel's tests and benchmarks compare against.

The contract itself (shapes, the mask rule, NaN handling) is stated in :mod:`gemzoo.interfaces.attention`
and docs/attention.md.
"""

from __future__ import annotations

import torch

from gemzoo.attention.checks import check_inputs
from gemzoo.interfaces.attention import ACTIVATIONS, AttentionCapabilities, RelativeAttentionBias

# Activation name -> the integer code of the compiled kernels (gemzoo's C++/CUDA ops and the Triton kernels of
# the jfa family): one table, whose numbering the C++ kernels (csrc/) are compiled against.
ACTIVATION_CODES = {"softmax": 0, "silu": 1, "gelu": 2, "relu": 3, "identity": 4, "gelu_tanh": 5, "relu2": 6,
                    "leaky_relu": 7, "hardswish": 8}
assert set(ACTIVATION_CODES) == set(ACTIVATIONS), "every activation needs a kernel code"


def pair_allowed(i: torch.Tensor, j: torch.Tensor, *, causal: bool, window: int | None,
                 block_size: int | None) -> torch.Tensor:
    """The mask rule of :mod:`gemzoo.interfaces.attention` for query positions ``i`` (already shifted by Lk - Lq) and key positions ``j``,
    broadcast against each other."""
    ok = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (i - j) < window
    if block_size is not None:
        ok &= torch.div(i, block_size, rounding_mode="floor") == torch.div(j, block_size, rounding_mode="floor")
    return ok


def allowed_mask(lq: int, lk: int, *, causal: bool, window: int | None, block_size: int | None, device=None):
    """Boolean [lq, lk] mask of allowed (query, key) pairs for one sequence."""
    i = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
    j = torch.arange(lk, device=device).unsqueeze(0)
    return pair_allowed(i, j, causal=causal, window=window, block_size=block_size)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE, half-split convention: x [L, H, D] (D even) rotated at positions ``pos`` [L], pairs
    (d, d + D/2) by the angle pos * theta^(-2d/D). Computed in x's dtype (fp32 or fp64 in the reference)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2 / x.shape[-1])
    ang = (pos.to(torch.float64)[:, None] * inv_freq[None, :]).to(x.dtype)[:, None, :]  # [L, 1, D/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_activation(scores: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(scores)
    if activation == "gelu":
        return torch.nn.functional.gelu(scores)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(scores, approximate="tanh")
    if activation == "relu":
        return torch.relu(scores)
    if activation == "relu2":
        return torch.relu(scores).square()
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu(scores, 0.01)
    if activation == "hardswish":
        return torch.nn.functional.hardswish(scores)
    if activation == "identity":
        return scores
    raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Jagged k or v [T, Hkv, D] with each head repeated ``n_rep`` times, [T, Hkv * n_rep, D]: head h of the
    result is head h // n_rep of ``x``, the k/v head that query head h reads under grouped-query attention.
    Differentiable (the repeats' gradients sum into their head); ``x`` itself when ``n_rep`` is 1."""
    if isinstance(n_rep, bool) or not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"n_rep must be an int >= 1 (query heads per k/v head), got {n_rep!r}")
    if x.dim() != 3:
        raise ValueError(f"repeat_kv takes a jagged [T, Hkv, D] tensor, got shape {tuple(x.shape)}")
    if n_rep == 1:
        return x
    t, h, d = x.shape
    return x.unsqueeze(2).expand(t, h, n_rep, d).reshape(t, h * n_rep, d)


def relative_bias_block(rb: RelativeAttentionBias, qs: int, lq: int, ks: int, lk: int) -> torch.Tensor:
    """[Lq, Lk]: the bias of ``rb`` over one sequence whose queries are rows [qs, qs + lq) and keys rows
    [ks, ks + lk) (the definition in :class:`RelativeAttentionBias`), differentiable in its tables."""
    device = rb.positions.device
    i = torch.arange(lq, device=device).view(-1, 1) + (lk - lq)
    j = torch.arange(lk, device=device).view(1, -1)
    bias = rb.positions[(i - j).clamp(0, rb.positions.numel() - 1)]
    if rb.time_weights is not None:
        gap = (rb.q_times[qs:qs + lq].view(-1, 1) - rb.k_times[ks:ks + lk].view(1, -1)).abs().clamp(min=1)
        bucket = (gap.float().log() / rb.bucket_divisor).long().clamp(0, rb.time_weights.numel() - 1)
        bias = bias + rb.time_weights[bucket]
    return bias


def materialize_relative_bias(rb: RelativeAttentionBias, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
                              max_q_len: int, max_k_len: int) -> torch.Tensor:
    """[B, 1, max_q_len, max_k_len]: ``rb`` as a padded additive ``bias`` (zero outside each sequence), for
    kernels that take a materialised bias only. O(B L^2) memory: the fused kernels never build it.

    Computed from the offsets where they are, without reading them back (no host sync on a GPU): the same
    terms as :func:`relative_bias_block`, gathered for every padded (query, key) slot at once."""
    device = rb.positions.device
    q_offsets, k_offsets = q_offsets.to(device), k_offsets.to(device)
    i = torch.arange(max_q_len, device=device).view(1, -1, 1)
    j = torch.arange(max_k_len, device=device).view(1, 1, -1)
    lq = (q_offsets[1:] - q_offsets[:-1]).view(-1, 1, 1)
    lk = (k_offsets[1:] - k_offsets[:-1]).view(-1, 1, 1)
    inside = (i < lq) & (j < lk)  # [B, Lq, Lk]
    bias = rb.positions[(i + (lk - lq) - j).clamp(0, rb.positions.numel() - 1)]
    tq, tk = (0, 0) if rb.time_weights is None else (rb.q_times.numel(), rb.k_times.numel())
    if tq and tk:  # with no query or no key row every slot is padding: the time term would only be masked
        q_rows = (q_offsets[:-1].view(-1, 1, 1) + i).clamp(max=tq - 1)  # padding slots read a valid row
        k_rows = (k_offsets[:-1].view(-1, 1, 1) + j).clamp(max=tk - 1)
        gap = (rb.q_times[q_rows] - rb.k_times[k_rows]).abs().clamp(min=1)
        bucket = (gap.float().log() / rb.bucket_divisor).long().clamp(0, rb.time_weights.numel() - 1)
        bias = bias + rb.time_weights[bucket]
    return torch.where(inside, bias, bias.new_zeros(())).unsqueeze(1)


# ------------------------------------------------------------------------------------------ the reference
# The executable definition of the semantics above: the ``reference`` kernel (registered by
# gemzoo.builtin.attention) and the oracle every kernel's tests compare against.

REFERENCE_CAPABILITIES = AttentionCapabilities(
    activations=frozenset(ACTIVATIONS), window=True, block=True, rotary=True, bias=True, relative_bias=True,
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}), grouped_kv=True)


def reference_attention(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                        norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None,
                        bias=None, relative_bias=None):
    """Per-sequence torch in fp32 (fp64 stays fp64): slow, obvious, and the definition of correct.
    ``bias`` [B, 1 or H, >= Lq, >= Lk] and ``relative_bias`` (a :class:`RelativeAttentionBias`) are added to
    the scaled scores before the mask and the activation. k and v may have fewer heads than q (a divisor of H:
    grouped-query attention), repeated here with :func:`repeat_kv`."""
    q_offsets, k_offsets = check_inputs(
        q, k, v, q_offsets, k_offsets, activation, capabilities=REFERENCE_CAPABILITIES, kernel="reference",
        causal=causal, scale=scale, norm=norm, max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
        window=window, rope_theta=rope_theta, bias=bias, relative_bias=relative_bias)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k.shape[1] != q.shape[1]:  # grouped k/v (checked: Hkv divides H): query head h reads k/v head h // n_rep
        k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // k.shape[1])
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=compute)
    qo, ko = q_offsets.tolist(), k_offsets.tolist()
    pieces = []
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], ko[b], ko[b + 1]
        lq, lk = qe - qs, ke - ks
        if lq == 0:
            continue
        if lk == 0:
            pieces.append(out[qs:qe])
            continue
        qb, kb = q[qs:qe].to(compute), k[ks:ke].to(compute)
        if rope_theta is not None:  # query i at position i + Lk - Lq, key j at j
            qb = apply_rope(qb, torch.arange(lk - lq, lk, device=q.device), rope_theta)
            kb = apply_rope(kb, torch.arange(lk, device=q.device), rope_theta)
        qb, kb = qb.transpose(0, 1), kb.transpose(0, 1)  # [H, Lq, D], [H, Lk, D]
        vb = v[ks:ke].to(compute).transpose(0, 1)
        s = scale * qb @ kb.transpose(1, 2)  # [H, Lq, Lk]
        if bias is not None:
            s = s + bias[b, :, :lq, :lk].to(compute)
        if relative_bias is not None:
            s = s + relative_bias_block(relative_bias, qs, lq, ks, lk).to(compute)
        mask = allowed_mask(lq, lk, causal=causal, window=window, block_size=block_size, device=q.device)
        has_key = mask.any(-1, keepdim=True)  # [Lq, 1]
        if activation == "softmax":
            # masked keys get -inf (a NaN score there is dropped); rows with no allowed key get finite
            # dummy scores and are zeroed below, so NaN from the inputs is the only NaN left
            s = s.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0.0)
            p = torch.softmax(s, dim=-1)
        else:
            p = torch.where(mask, apply_activation(s, activation), 0.0)
            if norm is not None:
                p = p / norm
        o = torch.where(has_key, p @ vb, 0.0)  # no allowed key -> exactly 0
        pieces.append(o.transpose(0, 1))
    if not pieces:
        return out.to(q.dtype)
    return torch.cat(pieces, dim=0).to(q.dtype)  # non-empty sequences, in order, tile [0, Tq)
