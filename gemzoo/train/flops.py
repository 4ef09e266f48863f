"""Model FLOP counting over real (unpadded) tokens; the numerator of MFU.

Conventions (BENCHMARKS.md): a matmul of [m, k] x [k, n] is 2mkn FLOPs forward and 3x that for
forward+backward. Attention counts allowed (query, key) pairs: 4*H*D per pair forward (QK^T and PV),
14*H*D per pair forward+backward; causal self-attention has L(L+1)/2 pairs per sequence, which the
benchmark tables approximate as L^2/2.
"""

from __future__ import annotations

import torch

FWD_BWD = 3  # backward costs two forward matmuls (dgrad + wgrad)

# Dense bf16 peak FLOP/s per device name substring. MFU reports which peak it used.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}


def linear_flops(tokens: int, in_features: int, out_features: int, *, backward: bool = True) -> int:
    f = 2 * tokens * in_features * out_features
    return f * FWD_BWD if backward else f


def attention_pairs(q_lens: torch.Tensor, k_lens: torch.Tensor | None = None, *, causal: bool = True,
                    window: int | None = None) -> int:
    """Number of allowed (query, key) pairs, bottom-right causal, summed over the batch."""
    q_lens = q_lens.long().cpu()
    k_lens = q_lens if k_lens is None else k_lens.long().cpu()
    if not causal and window is None:
        return int((q_lens * k_lens).sum())
    total = 0
    for lq, lk in zip(q_lens.tolist(), k_lens.tolist()):
        if lq == 0 or lk == 0:
            continue
        i = torch.arange(lq) + (lk - lq)  # last allowed key index per query
        hi = i.clamp(max=lk - 1) if causal else torch.full_like(i, lk - 1)
        lo = (i - window + 1).clamp(min=0) if window is not None else torch.zeros_like(i)
        total += int((hi - lo + 1).clamp(min=0).sum())
    return total


def attention_flops(pairs: int, heads: int, head_dim: int, *, backward: bool = True) -> int:
    return (14 if backward else 4) * heads * head_dim * pairs


def peak_flops(device: torch.device | str, override: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where it came from). ``override`` (config ``run.peak_tflops``) wins."""
    if override:
        return float(override) * 1e12, f"config ({override:g} TFLOP/s)"
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_FLOPS.items():
            if key in name:
                return peak, f"{key} bf16 dense ({peak / 1e12:g} TFLOP/s)"
        return 989e12, f"unknown GPU {name!r}, assumed H100-class 989 TFLOP/s"
    return 1e12, "CPU (nominal 1 TFLOP/s; set run.peak_tflops for a real figure)"
