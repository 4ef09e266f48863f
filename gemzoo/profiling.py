"""GPU kernel time from torch.profiler, counted once (the benches' profiles: act-quant's step, the host-overhead
cases of the attention kernels).

``key_averages()`` lists a ``record_function`` range twice when CUDA is profiled: once as the CPU range and once
as a GPU "user annotation" whose self device time is the span of the kernels inside it, which are listed as well
(pytorch/pytorch#130730, #144613). Summing every event with device time therefore counts an annotated region's
kernels twice (an optimizer step's ``Optimizer.step#AdamW.step``, for example). Here a device event whose name
is also a CPU event's name is such an annotation and is left out; CPU operators are left out too (their device
time is that of the kernels they launched, listed on their own).
"""

from __future__ import annotations

import torch


def kernel_ms(events, calls: int = 1) -> dict[str, float]:
    """Kernel name -> milliseconds of device time per call, from ``prof.key_averages()`` (or any iterable of
    events with ``key``, ``device_type`` and ``self_device_time_total`` in microseconds) over ``calls`` calls."""
    events = list(events)
    cpu_names = {e.key for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    out: dict[str, float] = {}
    for e in events:
        us = getattr(e, "self_device_time_total", None)
        if us is None:  # older torch
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us and e.device_type != torch.autograd.DeviceType.CPU and e.key not in cpu_names:
            out[e.key] = out.get(e.key, 0.0) + us / calls / 1e3
    return out


def annotations_ms(events, calls: int = 1) -> dict[str, float]:
    """The GPU spans of ``record_function`` ranges (left out of ``kernel_ms``), name -> ms per call."""
    events = list(events)
    cpu_names = {e.key for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    return {e.key: e.self_device_time_total / calls / 1e3 for e in events
            if e.device_type != torch.autograd.DeviceType.CPU and e.key in cpu_names and e.self_device_time_total}
