"""GPU kernel time from torch.profiler, counted once (the benches' profiles: act-quant's step, the host-overhead
cases of the attention kernels); where the GPU waits (``gpu_idle``); calls recorded into a CUDA graph
(``cuda_graph``), which time the kernels without the host.

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


# -- where the GPU waits ---------------------------------------------------------------------------------

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")


def gpu_idle(trace: dict, *, min_gap_us: float = 5.0, steps: int = 1, top: int = 15) -> dict:
    """Where the GPU waits, from a chrome trace (``prof.export_chrome_trace``; the dict of its JSON).

    The GPU is busy while any kernel, copy or memset runs (all streams together). Every gap of at least
    ``min_gap_us`` between the first and the last of them is idle time, charged to what the host was doing at
    the gap's midpoint: the innermost CPU operator (``cpu_op``; or the innermost Python function where no
    operator runs), the innermost CUDA runtime or driver call (``cudaStreamSynchronize`` means the host waited
    for the GPU, so the gap is the launch latency after a sync; ``cudaLaunchKernel``: host-bound launching) and
    the outermost ``record_function`` range (``user_annotation``, e.g. ``Optimizer.step#Adagrad.step``), on the
    host threads that launch work. Returns ms per step (``steps`` profiled steps): {"window_ms", "busy_ms",
    "idle_ms", "gaps", "by_op", "by_runtime", "by_range"}, each ``by_*`` the ``top`` largest."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in _GPU_CATS)
    out = {"window_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "by_op": {}, "by_runtime": {}, "by_range": {}}
    if not gpu:
        return out
    busy, gaps = 0.0, []
    start, end = gpu[0]
    for s, e in gpu[1:]:
        if s > end:
            busy += end - start
            if s - end >= min_gap_us:
                gaps.append((end, s))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    host = [e for e in events if e.get("cat") in _HOST_CATS]
    launchers = {(e.get("pid"), e.get("tid")) for e in host if e.get("cat") == "cuda_runtime"}
    host = sorted((e for e in host if (e.get("pid"), e.get("tid")) in launchers), key=lambda e: float(e["ts"]))
    charged: dict[str, dict[str, float]] = {"by_op": {}, "by_runtime": {}, "by_range": {}}
    # one sweep in time order (the gaps are): the host events open at each gap's midpoint, kept as a short list
    # of the ranges not yet ended (their nesting depth), so a trace of many events and gaps stays linear
    active: list[dict] = []
    nxt = 0
    for g0, g1 in gaps:
        mid, length = (g0 + g1) / 2, (g1 - g0) / 1e3 / steps
        while nxt < len(host) and float(host[nxt]["ts"]) <= mid:
            active.append(host[nxt])
            nxt += 1
        active = [e for e in active if float(e["ts"]) + float(e["dur"]) >= mid]
        picks = {
            "by_op": min((e for e in active if e["cat"] == "cpu_op"), key=lambda e: e["dur"], default=None)
            or min((e for e in active if e["cat"] == "python_function"), key=lambda e: e["dur"], default=None),
            "by_runtime": min((e for e in active if e["cat"] in ("cuda_runtime", "cuda_driver")),
                              key=lambda e: e["dur"], default=None),
            "by_range": max((e for e in active if e["cat"] == "user_annotation"), key=lambda e: e["dur"],
                            default=None),
        }
        for key, e in picks.items():
            name = e["name"] if e is not None else "(nothing on a launching thread)"
            charged[key][name] = charged[key].get(name, 0.0) + length
    out.update(window_ms=(end - gpu[0][0]) / 1e3 / steps, busy_ms=busy / 1e3 / steps,
               idle_ms=sum(g1 - g0 for g0, g1 in gaps) / 1e3 / steps, gaps=len(gaps) / steps)
    for key, table in charged.items():
        out[key] = dict(sorted(table.items(), key=lambda kv: -kv[1])[:top])
    return out


# -- CUDA graphs ------------------------------------------------------------------------------------------------


def cuda_graph(fn, *, warmup: int = 3):
    """``fn()`` recorded into a CUDA graph, as ``(graph, what the recorded call returned)``: ``graph.replay()``
    runs its kernels again on whatever its input buffers then hold, with no host work between them, and the
    returned tensors are the buffers each replay writes. ``warmup`` calls run first on a side stream, as torch
    documents for graphs with autograd: they compile kernels and settle caches, so the recorded call launches
    only what every call would. ``fn`` must not read device values on the host (capture fails if it does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result
