"""Model FLOP counting over real (unpadded) tokens: the numerator of MFU, used by every model family.

PaLM's definition, for every family alike: a matmul of [m, k] x [k, n] is 2mkn FLOPs forward
and backward is twice forward (dgrad + wgrad), so 3x in all; attention counts allowed (query, key) pairs
only, 2*H*(D + Dv) per pair forward (QK^T and PV) and 3x that forward+backward (12*H*D per pair when
Dv = D). Nothing is counted for recompute (activation checkpointing, FlashAttention's backward) or padding.
Kernel benchmarks use FlashAttention's convention instead (14*H*D per pair, recompute included) so that
their TFLOP/s compare with published kernel figures; MFU never does.

Models import this module, not ``gemzoo.train``.
"""

from __future__ import annotations

import torch

FWD_BWD = 3  # backward costs two forward matmuls (dgrad + wgrad)


def linear_flops(tokens: int, in_features: int, out_features: int, *, backward: bool = True) -> int:
    f = 2 * tokens * in_features * out_features
    return f * FWD_BWD if backward else f


def attention_pairs(q_lens: torch.Tensor, k_lens: torch.Tensor | None = None, *, causal: bool = True,
                    window: int | None = None, block_size: int | None = None) -> int:
    """Number of allowed (query, key) pairs, bottom-right causal, summed over the batch (``block_size``:
    only pairs in one block of positions counted from each sequence's start, as the mask rule of gemzoo.interfaces.attention)."""
    q_lens = q_lens.long().cpu()
    k_lens = q_lens if k_lens is None else k_lens.long().cpu()
    if not causal and window is None and block_size is None:
        return int((q_lens * k_lens).sum())
    total = 0
    for lq, lk in zip(q_lens.tolist(), k_lens.tolist(), strict=True):
        if lq == 0 or lk == 0:
            continue
        i = torch.arange(lq) + (lk - lq)  # last allowed key index per query
        hi = i.clamp(max=lk - 1) if causal else torch.full_like(i, lk - 1)
        lo = (i - window + 1).clamp(min=0) if window is not None else torch.zeros_like(i)
        if block_size is not None:
            start = torch.div(i, block_size, rounding_mode="floor") * block_size
            lo, hi = torch.maximum(lo, start), torch.minimum(hi, start + block_size - 1)
        total += int((hi - lo + 1).clamp(min=0).sum())
    return total


def attention_flops(pairs: int, heads: int, head_dim: int, v_dim: int | None = None, *,
                    backward: bool = True) -> int:
    """PaLM-style attention FLOPs: 2*H*(D + Dv) per allowed pair forward, 3x that with backward."""
    f = 2 * pairs * heads * (head_dim + (head_dim if v_dim is None else v_dim))
    return f * FWD_BWD if backward else f


def sample_pairs(q_lens: torch.Tensor, k_lens: torch.Tensor | None = None, *, causal: bool = True,
                 window: int | None = None, block_size: int | None = None) -> torch.Tensor:
    """Allowed (query, key) pairs of each sequence, int64 ``[B]`` (bottom-right causal); sums to
    ``attention_pairs``. Tensors in, tensors out, so per-sample costs (a model's ``cost_model``) use the same
    ``linear_flops`` / ``attention_flops`` as ``flops``: both are elementwise in tokens and pairs."""
    q_lens = q_lens.long().cpu()
    k_lens = q_lens if k_lens is None else k_lens.long().cpu()
    if window is None and block_size is None:
        if not causal:
            return q_lens * k_lens
        # query i (of Lq) sees keys 0..i + Lk - Lq: the last m = min(Lq, Lk) queries see Lk - m + 1 .. Lk keys
        m = torch.minimum(q_lens, k_lens)
        return m * k_lens - m * (m - 1) // 2
    return torch.tensor([attention_pairs(q_lens[b:b + 1], k_lens[b:b + 1], causal=causal, window=window,
                                         block_size=block_size) for b in range(q_lens.numel())], dtype=torch.long)
