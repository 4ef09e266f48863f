"""Built-in attention kernels: ``reference`` (the oracle), ``sdpa-padded`` (naive baseline), ``flex``.

The reference itself is :func:`gemzoo.attention.reference_attention`, next to the mask rule; this module
registers it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemzoo.attention import (
    REFERENCE_CAPABILITIES,
    FunctionKernel,
    apply_activation,
    check_inputs,
    pair_allowed,
    reference_attention,
    repeat_kv,
)
from gemzoo.interfaces.attention import ACTIVATIONS, AttentionCapabilities
from gemzoo.jagged import max_length, offsets_to_lengths, positions, seq_ids
from gemzoo.ops import jagged_to_padded, padded_to_jagged
from gemzoo.plugins import hookimpl

ALL = frozenset(ACTIVATIONS)


def _padded_mask(q_lens, k_lens, lq_max, lk_max, causal, window, block_size, device):
    """[B, 1, Lq, Lk] allowed mask including padding (bottom-right causal per sequence)."""
    i = torch.arange(lq_max, device=device).view(1, -1, 1)
    j = torch.arange(lk_max, device=device).view(1, 1, -1)
    ii = i + (k_lens - q_lens).view(-1, 1, 1)
    mask = (i < q_lens.view(-1, 1, 1)) & (j < k_lens.view(-1, 1, 1))
    mask &= pair_allowed(ii, j, causal=causal, window=window, block_size=block_size)
    return mask.unsqueeze(1)


def sdpa_padded_attention(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                          norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None,
                          bias=None, relative_bias=None):
    """Pad to [B, H, Lmax, D], run SDPA (or pointwise attention) with a mask, unpad. The naive baseline.
    ``bias`` (padded [B, 1 or H, >= Lq, >= Lk]) is added to the scaled scores. A ``relative_bias`` is not
    declared (it raises here); an attention site materialises it into ``bias`` for this kernel."""

    q_offsets, k_offsets = check_inputs(
        q, k, v, q_offsets, k_offsets, activation, capabilities=SDPA_PADDED.capabilities, kernel=SDPA_PADDED,
        causal=causal, scale=scale, norm=norm, max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
        window=window, rope_theta=rope_theta, bias=bias, relative_bias=relative_bias)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[1] != q.shape[1]:  # grouped k/v: the naive baseline repeats them to q's heads
        k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // k.shape[1])
    lq_max = max_q_len if max_q_len is not None else max_length(q_offsets)
    lk_max = max_k_len if max_k_len is not None else max_length(k_offsets)
    if q.shape[0] == 0 or lq_max == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    in_dtype = q.dtype
    if q.device.type == "cpu" and in_dtype in (torch.bfloat16, torch.float16):
        # compute in fp32 on CPU, so backward's rowsum(dO * O) sees the fp32 output, not its rounding
        q, k, v = q.float(), k.float(), v.float()
    qp = jagged_to_padded(q, q_offsets, lq_max).transpose(1, 2)  # [B, H, Lq, D]
    kp = jagged_to_padded(k, k_offsets, max(lk_max, 1)).transpose(1, 2)
    vp = jagged_to_padded(v, k_offsets, max(lk_max, 1)).transpose(1, 2)
    q_lens, k_lens = offsets_to_lengths(q_offsets), offsets_to_lengths(k_offsets)
    simple = activation == "softmax" and window is None and block_size is None and bias is None
    if bias is not None:
        bias = bias[:, :, :lq_max, :max(lk_max, 1)].to(qp.dtype)
    if simple and causal and (k_offsets is q_offsets or torch.equal(q_lens, k_lens)):
        # Lq == Lk: top-left causal is bottom-right causal, and padded keys only reach padded queries,
        # so SDPA's own causal kernel (flash) needs no mask at all.
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
        # SDPA's CPU flash kernel can drop a NaN query row; every row here has a key, so NaN q means NaN out
        out = torch.where(qp.isnan().any(-1, keepdim=True), float("nan"), out)
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
            if bias is not None:  # a float mask: the bias on allowed keys, -inf elsewhere
                safe_mask = bias.masked_fill(~safe_mask, float("-inf"))
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=safe_mask, scale=scale)
            out = torch.where(has_key, out, torch.zeros_like(out))
        else:
            s = scale * (qp @ kp.transpose(-1, -2))
            if bias is not None:
                s = s + bias
            p = torch.where(mask, apply_activation(s, activation), 0.0)
            if norm is not None:
                p = p / norm
            out = torch.where(mask.any(-1, keepdim=True), p @ vp, 0.0)
    return padded_to_jagged(out.transpose(1, 2), q_offsets).to(in_dtype)


@torch.compiler.disable
def flex_attention_jagged(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                          norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None,
                          relative_bias=None):
    """FlexAttention over the concatenated batch with a document (+causal/window/block) mask.

    Never traced by an enclosing ``torch.compile`` (``run.compile``'s per-block graphs): there the block mask's
    ``create_block_mask`` and ``flex_attention`` were inlined into the block's dynamic-shape graph, and the
    compiled gem-bench ``flex,bf16`` row of 2026-12-02 ran at 29.6 samples/s with 128 GiB peak (85.3 and
    72.4 GiB eager). The block graph breaks around this call instead; flex keeps its own compiled kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_offsets, k_offsets = check_inputs(
        q, k, v, q_offsets, k_offsets, activation, capabilities=FLEX.capabilities, kernel=FLEX,
        causal=causal, scale=scale, norm=norm, max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
        window=window, rope_theta=rope_theta, relative_bias=relative_bias)  # relative_bias: not declared, raises
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

    v, poisoned = _quarantine_nonfinite_v(v, q_offsets, k_offsets, q_pos[:tq], causal, window, block_size)
    out = _flex(heads_first(q, tq_pad), heads_first(k, tk_pad), heads_first(v, tk_pad), block_mask, scale,
                k.shape[1] != q.shape[1])
    out = out.squeeze(0).transpose(0, 1)[:tq]
    return torch.where(poisoned.view(-1, 1, 1), float("nan"), out)


def _quarantine_nonfinite_v(v, q_offsets, k_offsets, q_pos, causal, window, block_size):
    """NaN rule for flex: its tiles span sequences and multiply masked keys' values by P = 0, so a NaN or
    inf in v would reach other sequences' rows (0 * NaN). Sequences with a non-finite value run with v = 0
    instead, and their query rows that have an allowed key come back NaN. No host sync."""

    b = q_offsets.numel() - 1
    tq, tk = q_pos.shape[0], v.shape[0]
    k_seq, q_seq = seq_ids(k_offsets, tk), seq_ids(q_offsets, tq)
    bad_tok = ~torch.isfinite(v).flatten(1).all(1)
    bad_seq = torch.zeros(b, dtype=torch.int32, device=v.device).index_add_(0, k_seq, bad_tok.int()) > 0
    v = torch.where(bad_seq[k_seq].view(-1, 1, 1), 0.0, v)
    lo, hi = torch.zeros_like(q_pos), k_offsets.diff()[q_seq] - 1  # allowed keys of each query: [lo, hi]
    if causal:
        hi = torch.minimum(hi, q_pos)
    if window is not None:
        lo = torch.maximum(lo, q_pos - window + 1)
    if block_size is not None:
        start = torch.div(q_pos, block_size, rounding_mode="floor") * block_size
        lo, hi = torch.maximum(lo, start), torch.minimum(hi, start + block_size - 1)
    return v, bad_seq[q_seq] & (lo <= hi)


def _bucket(n: int) -> int:
    """Round up to 1/8 of the enclosing power of two (at least 128): few shapes, < 12.5% padding."""
    if n <= 128:
        return 128
    step = max(128, 1 << (n - 1).bit_length() - 3)
    return -(-n // step) * step


_compiled_flex = None


def _flex(q, k, v, block_mask, scale, enable_gqa=False):
    """flex_attention over [1, H, T, D] tensors; ``enable_gqa``: k and v have fewer heads (a divisor of H)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if _compiled_flex is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


REFERENCE = FunctionKernel(
    reference_attention,
    REFERENCE_CAPABILITIES,
    "per-sequence torch oracle (rope_theta and bias included)",
)
SDPA_PADDED = FunctionKernel(
    sdpa_padded_attention,
    AttentionCapabilities(activations=ALL, window=True, block=True, bias=True, grouped_kv=True),
    "pad to the longest sequence, SDPA with a mask, unpad (naive baseline; bias and grouped k/v included)",
)
FLEX = FunctionKernel(
    flex_attention_jagged,
    AttentionCapabilities(window=True, block=True, backward_devices=frozenset({"cuda"}), grouped_kv=True),
    "FlexAttention with a document mask (compiled on GPU; forward only on CPU; grouped k/v by enable_gqa)",
)


@hookimpl
def gemzoo_register_attention(register):
    register("reference", REFERENCE)
    register("sdpa-padded", SDPA_PADDED)
    register("flex", FLEX)
