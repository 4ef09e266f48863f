"""Built-in attention kernels: ``reference`` (the oracle), ``sdpa-padded`` (naive baseline), ``flex``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemzoo.interfaces.attention import (
    ACTIVATIONS,
    AttentionCapabilities,
    FunctionKernel,
    allowed_mask,
    pair_allowed,
    apply_activation,
    check_inputs,
)
from gemzoo.plugins import hookimpl

ALL = frozenset(ACTIVATIONS)


def reference_attention(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                        norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None):
    """Per-sequence torch in fp32 (fp64 stays fp64): slow, obvious, and the definition of correct."""
    q_offsets, k_offsets = check_inputs(
        q, k, v, q_offsets, k_offsets, activation, capabilities=REFERENCE.capabilities, kernel=REFERENCE,
        causal=causal, scale=scale, norm=norm, max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
        window=window, rope_theta=rope_theta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
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
        qb = q[qs:qe].to(compute).transpose(0, 1)  # [H, Lq, D]
        kb = k[ks:ke].to(compute).transpose(0, 1)
        vb = v[ks:ke].to(compute).transpose(0, 1)
        s = scale * qb @ kb.transpose(1, 2)  # [H, Lq, Lk]
        mask = allowed_mask(lq, lk, causal=causal, window=window, block_size=block_size, device=q.device)
        if activation == "softmax":
            s = s.masked_fill(~mask, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no allowed key -> 0
            p = torch.where(mask, p, torch.zeros_like(p))
        else:
            p = apply_activation(s, activation) * mask
            if norm is not None:
                p = p / norm
        pieces.append((p @ vb).transpose(0, 1))
    if not pieces:
        return out.to(q.dtype)
    return torch.cat(pieces, dim=0).to(q.dtype)  # non-empty sequences, in order, tile [0, Tq)


def _padded_mask(q_lens, k_lens, lq_max, lk_max, causal, window, block_size, device):
    """[B, 1, Lq, Lk] allowed mask including padding (bottom-right causal per sequence)."""
    i = torch.arange(lq_max, device=device).view(1, -1, 1)
    j = torch.arange(lk_max, device=device).view(1, 1, -1)
    ii = i + (k_lens - q_lens).view(-1, 1, 1)
    mask = (i < q_lens.view(-1, 1, 1)) & (j < k_lens.view(-1, 1, 1))
    mask &= pair_allowed(ii, j, causal=causal, window=window, block_size=block_size)
    return mask.unsqueeze(1)


def sdpa_padded_attention(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                          norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None):
    """Pad to [B, H, Lmax, D], run SDPA (or pointwise attention) with a mask, unpad. The naive baseline."""
    from gemzoo.jagged import jagged_to_padded, max_length, offsets_to_lengths, padded_to_jagged

    q_offsets, k_offsets = check_inputs(
        q, k, v, q_offsets, k_offsets, activation, capabilities=SDPA_PADDED.capabilities, kernel=SDPA_PADDED,
        causal=causal, scale=scale, norm=norm, max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
        window=window, rope_theta=rope_theta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lq_max = max_q_len if max_q_len is not None else max_length(q_offsets)
    lk_max = max_k_len if max_k_len is not None else max_length(k_offsets)
    if q.shape[0] == 0 or lq_max == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    qp = jagged_to_padded(q, q_offsets, lq_max).transpose(1, 2)  # [B, H, Lq, D]
    kp = jagged_to_padded(k, k_offsets, max(lk_max, 1)).transpose(1, 2)
    vp = jagged_to_padded(v, k_offsets, max(lk_max, 1)).transpose(1, 2)
    q_lens, k_lens = offsets_to_lengths(q_offsets), offsets_to_lengths(k_offsets)
    simple = activation == "softmax" and window is None and block_size is None
    if simple and causal and (k_offsets is q_offsets or torch.equal(q_lens, k_lens)):
        # Lq == Lk: top-left causal is bottom-right causal, and padded keys only reach padded queries,
        # so SDPA's own causal kernel (flash) needs no mask at all.
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
    elif simple and not causal:
        has_key = (k_lens > 0).view(-1, 1, 1, 1)
        key_mask = torch.arange(kp.shape[2], device=q.device).view(1, 1, 1, -1) < k_lens.view(-1, 1, 1, 1)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=key_mask | ~has_key, scale=scale)
        out = torch.where(has_key, out, torch.zeros_like(out))
    else:
        mask = _padded_mask(q_lens, k_lens, lq_max, max(lk_max, 1), causal, window, block_size, q.device)
        if activation == "softmax":
            has_key = mask.any(-1, keepdim=True)
            safe_mask = mask | ~has_key  # let empty rows see every key (finite softmax), then zero them
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=safe_mask, scale=scale)
            out = torch.where(has_key, out, torch.zeros_like(out))
        else:
            s = scale * (qp @ kp.transpose(-1, -2))
            p = apply_activation(s, activation) * mask
            if norm is not None:
                p = p / norm
            out = p @ vp
    return padded_to_jagged(out.transpose(1, 2), q_offsets)


def flex_attention_jagged(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                          norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None):
    """FlexAttention over the concatenated batch with a document (+causal/window/block) mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    from gemzoo.jagged import positions, seq_ids

    q_offsets, k_offsets = check_inputs(
        q, k, v, q_offsets, k_offsets, activation, capabilities=FLEX.capabilities, kernel=FLEX,
        causal=causal, scale=scale, norm=norm, max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
        window=window, rope_theta=rope_theta)
    tq, tk = q.shape[0], k.shape[0]
    if tq == 0:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    if tk == 0:
        return q.new_zeros(tq, q.shape[1], v.shape[2])
    # Pad the token axis to a bucket so the compiled kernel sees few distinct shapes; padded rows get
    # document ids that match nothing, so they neither attend nor are attended to.
    tq_pad, tk_pad = _bucket(tq), _bucket(tk)
    q_doc = torch.cat([seq_ids(q_offsets, tq), q.new_full((tq_pad - tq,), -1, dtype=torch.long)])
    k_doc = torch.cat([seq_ids(k_offsets, tk), k.new_full((tk_pad - tk,), -2, dtype=torch.long)])
    q_lens, k_lens = q_offsets.diff(), k_offsets.diff()
    q_pos = positions(q_offsets, tq) + (k_lens - q_lens)[seq_ids(q_offsets, tq)]  # bottom-right aligned
    q_pos = torch.cat([q_pos, q_pos.new_zeros(tq_pad - tq)])
    k_pos = torch.cat([positions(k_offsets, tk), q_pos.new_zeros(tk_pad - tk)])

    def mask_mod(b, h, qi, kj):
        ok = q_doc[qi] == k_doc[kj]
        if causal:
            ok = ok & (k_pos[kj] <= q_pos[qi])
        if window is not None:
            ok = ok & (q_pos[qi] - k_pos[kj] < window)
        if block_size is not None:
            ok = ok & (q_pos[qi] // block_size == k_pos[kj] // block_size)
        return ok

    block_mask = create_block_mask(mask_mod, None, None, tq_pad, tk_pad, device=q.device,
                                   _compile=q.device.type == "cuda")

    def heads_first(t, total):
        t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, total - t.shape[0]))
        return t.transpose(0, 1).unsqueeze(0)

    out = _flex(heads_first(q, tq_pad), heads_first(k, tk_pad), heads_first(v, tk_pad), block_mask, scale)
    return out.squeeze(0).transpose(0, 1)[:tq]


def _bucket(n: int) -> int:
    """Round up to 1/8 of the enclosing power of two (at least 128): few shapes, < 12.5% padding."""
    if n <= 128:
        return 128
    step = max(128, 1 << (n - 1).bit_length() - 3)
    return -(-n // step) * step


_compiled_flex = None


def _flex(q, k, v, block_mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    if _compiled_flex is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale)


REFERENCE = FunctionKernel(
    reference_attention,
    AttentionCapabilities(activations=ALL, window=True, block=True,
                          dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})),
    "per-sequence torch oracle",
)
SDPA_PADDED = FunctionKernel(
    sdpa_padded_attention,
    AttentionCapabilities(activations=ALL, window=True, block=True),
    "pad to the longest sequence, SDPA with a mask, unpad (naive baseline)",
)
FLEX = FunctionKernel(
    flex_attention_jagged,
    AttentionCapabilities(window=True, block=True, backward_devices=frozenset({"cuda"})),
    "FlexAttention with a document mask (compiled on GPU; forward only on CPU)",
)


@hookimpl
def gemzoo_register_attention(register):
    register("reference", REFERENCE)
    register("sdpa-padded", SDPA_PADDED)
    register("flex", FLEX)
