"""MFU's denominator: the peak FLOP/s of the device. The numerator (model FLOPs, PaLM definition) lives in
``gemzoo.flops``, beside the models that count them."""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s per device name substring. MFU reports which peak it used.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}


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
