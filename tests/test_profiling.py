"""gemzoo.profiling counts each kernel once: record_function spans and CPU operators are not kernels."""

from types import SimpleNamespace

import torch

from gemzoo.profiling import annotations_ms, kernel_ms

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def event(key, device_type, us):
    return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=us)


def test_annotations_and_cpu_ops_are_not_counted_as_kernels():
    events = [
        event("Optimizer.step#AdamW.step", CPU, 0.0),  # the CPU range ...
        event("Optimizer.step#AdamW.step", CUDA, 900.0),  # ... and its GPU span, which covers the two kernels below
        event("multi_tensor_apply_kernel", CUDA, 600.0),
        event("vectorized_elementwise_kernel", CUDA, 300.0),
        event("aten::mm", CPU, 2000.0),  # a CPU operator's device time is its kernel's, listed next
        event("nvjet_sm90_tst_256x160", CUDA, 2000.0),
    ]
    assert kernel_ms(events, calls=2) == {"multi_tensor_apply_kernel": 0.3, "vectorized_elementwise_kernel": 0.15,
                                          "nvjet_sm90_tst_256x160": 1.0}
    assert annotations_ms(events, calls=2) == {"Optimizer.step#AdamW.step": 0.45}


def test_a_real_cpu_profile_has_no_device_kernels():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("outer"):
            torch.ones(64, 64) @ torch.ones(64, 64)
    assert kernel_ms(prof.key_averages()) == {}
