"""CompileWatch: compiles after warm-up are counted once each and named."""

import pytest
import torch

from gemzoo.train.compiles import CompileWatch


def test_counts_only_after_arm_and_reports_each_kernel_once():
    watch = CompileWatch()
    watch.record_triton("attn_fwd_kernel")  # warm-up: compiles are expected
    assert watch.after_warmup == 0 and watch.new_events() == []
    watch.arm()
    watch.record_triton("attn_fwd_kernel")
    watch.record_triton("attn_fwd_kernel")
    watch.record_triton("attn_bwd_dq_kernel")
    assert watch.after_warmup == 3
    events = watch.new_events()
    assert len(events) == 2 and "attn_bwd_dq_kernel" in events[0] and "attn_fwd_kernel" in events[1]
    assert "2x" in events[1]
    assert watch.new_events() == []  # each kernel is named once
    assert "a new tile configuration" in events[0]
    assert watch.triton["attn_fwd_kernel"] == 3  # the whole count, warm-up included


def test_compiles_inside_excluded_are_neither_counted_nor_reported(monkeypatch):
    import gemzoo.train.compiles as compiles

    graphs = [5]
    monkeypatch.setattr(compiles, "_dynamo_graphs", lambda: graphs[0])
    watch = CompileWatch()
    watch.arm()
    with watch.excluded():  # an evaluation: its own graph and kernels, traced once
        graphs[0] += 1
        watch.record_triton("eval_kernel")
    assert watch.after_warmup == 0 and watch.new_events() == []
    graphs[0] += 1  # a training step traced again: a stall, counted and reported
    watch.record_triton("attn_fwd_kernel")
    assert watch.after_warmup == 2
    events = watch.new_events()
    assert len(events) == 2 and "1 new graph" in events[1] and "eval_kernel" not in " ".join(events)


def test_a_changed_specialisation_is_named():
    watch = CompileWatch()
    watch.record_triton("attn_fwd_kernel", "attn_fwd_kernel[num_warps=4](Q: *bf16:16, Tq: i32:16, scale: fp32)")
    watch.arm()
    watch.record_triton("attn_fwd_kernel", "attn_fwd_kernel[num_warps=4](Q: *bf16:16, Tq: i32, scale: fp32)")
    (event,) = watch.new_events()
    assert "Tq i32:16 -> i32" in event and "do_not_specialize" in event and "Q " not in event


def test_hook_chains_the_previous_one_and_is_restored():
    knobs = pytest.importorskip("triton").knobs.runtime
    seen = []

    def previous(*args, **kwargs):
        seen.append(kwargs["fn"].name)
        return None

    before = knobs.jit_cache_hook
    knobs.jit_cache_hook = previous
    try:
        watch = CompileWatch().start()
        assert knobs.jit_cache_hook == watch._hook
        watch.arm()
        fn = type("Info", (), {"name": "my_kernel"})()
        assert knobs.jit_cache_hook(key="k", fn=fn) is None
        assert seen == ["my_kernel"] and watch.after_warmup == 1
        watch.close()
        assert knobs.jit_cache_hook is previous
    finally:
        knobs.jit_cache_hook = before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles kernels only on a GPU")
def test_a_real_triton_kernel_compiles_once_with_do_not_specialize():
    import triton
    import triton.language as tl

    @triton.jit
    def specialised(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    @triton.jit(do_not_specialize=("n",))
    def unspecialised(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.randn(64, device="cuda")
    watch = CompileWatch().start()
    try:
        watch.arm()
        for n in (32, 33, 1):  # divisible by 16, not, and == 1: three specialisations
            specialised[(1,)](x, n, BLOCK=64)
        for n in (32, 33, 1):
            unspecialised[(1,)](x, n, BLOCK=64)
        torch.cuda.synchronize()
        assert watch.triton["specialised"] == 3
        assert watch.triton["unspecialised"] == 1
    finally:
        watch.close()
