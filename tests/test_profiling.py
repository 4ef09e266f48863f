"""gemzoo.profiling counts each kernel once: record_function spans and CPU operators are not kernels."""

from types import SimpleNamespace

import torch

from gemzoo.profiling import annotations_ms, kernel_ms

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def event(key, device_type, us, annotation=False):
    return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=us, is_user_annotation=annotation)


def test_annotations_and_cpu_ops_are_not_counted_as_kernels():
    events = [
        event("Optimizer.step#AdamW.step", CPU, 0.0),  # the CPU range ...
        event("Optimizer.step#AdamW.step", CUDA, 900.0, annotation=True),  # ... and its GPU span over the next two
        event("multi_tensor_apply_kernel", CUDA, 600.0),
        event("vectorized_elementwise_kernel", CUDA, 300.0),
        event("aten::mm", CPU, 2000.0),  # a CPU operator's device time is its kernel's, listed next
        event("nvjet_sm90_tst_256x160", CUDA, 2000.0),
        event("triton_tem_fused_flex_attention_0", CPU, 700.0),  # Inductor's launch range has the kernel's name
        event("triton_tem_fused_flex_attention_0", CUDA, 700.0),
    ]
    assert kernel_ms(events, calls=2) == {"multi_tensor_apply_kernel": 0.3, "vectorized_elementwise_kernel": 0.15,
                                          "nvjet_sm90_tst_256x160": 1.0, "triton_tem_fused_flex_attention_0": 0.35}
    assert annotations_ms(events, calls=2) == {"Optimizer.step#AdamW.step": 0.45}


def test_without_the_annotation_flag_a_span_is_known_by_its_cpu_range_name():
    events = [SimpleNamespace(key=k, device_type=d, self_device_time_total=us)
              for k, d, us in (("step", CPU, 0.0), ("step", CUDA, 500.0), ("kernel", CUDA, 500.0))]
    assert kernel_ms(events) == {"kernel": 0.5}
    assert annotations_ms(events) == {"step": 0.5}


def test_a_real_cpu_profile_has_no_device_kernels():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("outer"):
            torch.ones(64, 64) @ torch.ones(64, 64)
    assert kernel_ms(prof.key_averages()) == {}


def test_gpu_idle_charges_each_gap_to_what_the_host_was_doing():
    from gemzoo.profiling import gpu_idle

    def x(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    trace = {"traceEvents": [
        x("kernel", "gemm", 0, 100, tid=7), x("kernel", "attn", 50, 100, tid=8),  # overlapping: busy 0..150
        x("kernel", "gemm", 450, 50, tid=7),  # idle 150..450 (300 us)
        x("gpu_memcpy", "HtoD", 520, 30, tid=7),  # idle 500..520 (20 us)
        x("kernel", "gemm", 552, 48, tid=7),  # a 2 us gap: below min_gap_us, not idle
        x("user_annotation", "Optimizer.step#Adagrad.step", 100, 430),
        x("cpu_op", "aten::item", 200, 200), x("cpu_op", "aten::_local_scalar_dense", 210, 180),
        x("cuda_runtime", "cudaStreamSynchronize", 220, 160),
        x("python_function", "loader.py: next", 505, 10),
        x("cpu_op", "aten::sum", 300, 10, tid=2),  # a thread that launches nothing is not charged
    ]}
    r = gpu_idle(trace, steps=2)
    assert r["window_ms"] == 0.3 and r["gaps"] == 1.0
    assert abs(r["idle_ms"] - 0.16) < 1e-12 and abs(r["busy_ms"] - 0.139) < 1e-12  # 150 + 50 + 30 + 48 us over 2 steps
    assert r["by_op"] == {"aten::_local_scalar_dense": 0.15, "loader.py: next": 0.01}
    assert r["by_runtime"] == {"cudaStreamSynchronize": 0.15, "(nothing on a launching thread)": 0.01}
    assert r["by_range"] == {"Optimizer.step#Adagrad.step": 0.16}
    assert gpu_idle({"traceEvents": []})["idle_ms"] == 0.0
