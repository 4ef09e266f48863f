"""GPU kernel time from torch.profiler, counted once (the benches' profiles: act-quant's step, the host-overhead
cases of the attention kernels).

When CUDA is profiled, ``key_averages()`` also lists each ``record_function`` range (an optimizer's
``Optimizer.step#AdamW.step``, an ``autograd.Function``'s node) as a GPU "user annotation" whose self device time
is the span of the kernels inside it, which are listed as well (pytorch/pytorch#130730, #144613). Summing every
event with device time therefore counts those kernels twice; torch's own table leaves them out by
``is_user_annotation``, and so does this. CPU operators are left out too (in the Kineto profiler their kernels
are listed on their own). Inductor names a kernel's launch range after the kernel, so a name alone does not
tell a span from a kernel; only torch builds without ``is_user_annotation`` fall back to that rule.
"""

from __future__ import annotations

import torch

_CPU = torch.autograd.DeviceType.CPU


def _split(events) -> tuple[list, list]:
    """(kernels, annotations) among the device events."""
    events = list(events)
    device = [e for e in events if e.device_type != _CPU]
    if device and all(hasattr(e, "is_user_annotation") for e in device):
        return [e for e in device if not e.is_user_annotation], [e for e in device if e.is_user_annotation]
    cpu_names = {e.key for e in events if e.device_type == _CPU}  # older torch: a span shares its CPU range's name
    return [e for e in device if e.key not in cpu_names], [e for e in device if e.key in cpu_names]


def _device_us(e) -> float:
    us = getattr(e, "self_device_time_total", None)
    return getattr(e, "self_cuda_time_total", 0.0) if us is None else us


def _per_call(events, calls: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in events:
        if _device_us(e):
            out[e.key] = out.get(e.key, 0.0) + _device_us(e) / calls / 1e3
    return out


def kernel_ms(events, calls: int = 1) -> dict[str, float]:
    """Kernel name -> milliseconds of device time per call, from ``prof.key_averages()`` (or any iterable of
    events with ``key``, ``device_type``, ``self_device_time_total`` in microseconds and, on current torch,
    ``is_user_annotation``) over ``calls`` calls."""
    return _per_call(_split(events)[0], calls)


def annotations_ms(events, calls: int = 1) -> dict[str, float]:
    """The GPU spans of ``record_function`` ranges (left out of ``kernel_ms``), name -> ms per call."""
    return _per_call(_split(events)[1], calls)
