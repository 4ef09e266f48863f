"""The fp8 forward (KernelOptions.fp8, the registered ``jfa-fp8`` kernel) on CPU: options and their errors, the
launch path without host syncs (meta tensors, kernels stubbed), the CPU emulation (inputs quantised and back,
straight-through gradients) and the pairing with FP8 linears on gem-tiny. The Triton kernels themselves run
under the interpreter in test_interpreter.py (group fp8) and on the GPU in test_gpu.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gemzoo.api import lengths_to_offsets, registry

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "gem-tiny.toml")  # the repository's, whatever the cwd


class _NoLaunch:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, kwargs.get("FP8", 0)))


def test_fp8_option_is_checked():
    from gemzoo_jfa.family import FP8_MODES, KernelOptions

    assert FP8_MODES == ("off", "qk", "qkv") and KernelOptions().fp8 == "off"
    with pytest.raises(ValueError, match="fp8='e5m2'.*off, qk, qkv"):
        KernelOptions(fp8="e5m2")


def _meta(lengths=(5, 0, 130, 7, 48), h=2, d=64):
    off = lengths_to_offsets(torch.tensor(list(lengths))).to("meta")
    q, k, v = (torch.empty(sum(lengths), h, d, device="meta", dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, off


@pytest.mark.parametrize("mode", ["qk", "qkv"])
def test_fp8_launch_path_reads_no_device_value_and_backward_recomputes(monkeypatch, mode):
    """Quantisation, schedules and launches run without a host sync (meta tensors: any read raises); the
    backward launches the forward again without fp8 (out and lse of the unquantised inputs) before dk/dv, dq."""
    from gemzoo_jfa import family, kernels

    calls = []
    for name in ("attn_fwd_kernel", "attn_bwd_preprocess", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel",
                 "quant_fp8_kernel"):
        monkeypatch.setattr(kernels, name, _NoLaunch(name, calls))
    q, k, v, off = _meta()
    out, lse = torch.empty_like(q), torch.empty(2, q.shape[0], device="meta")
    opts = family.KernelOptions(fp8=mode)
    family.launch_fwd(q, k, v, off, off, True, 0.125, -1, out, lse, options=opts)
    assert [n for n, _ in calls].count("quant_fp8_kernel") == (3 if mode == "qkv" else 2)
    assert {f for n, f in calls if n == "attn_fwd_kernel"} == {2 if mode == "qkv" else 1}
    calls.clear()
    family.backward(torch.empty_like(q), q, k, v, out, lse, off, off, True, 0.125, -1, options=opts)
    names = [n for n, _ in calls]
    assert "quant_fp8_kernel" not in names and names.index("attn_fwd_kernel") < names.index("attn_bwd_dkdv_kernel")
    assert {f for n, f in calls if n == "attn_fwd_kernel"} == {0}


def test_fp8_errors_name_the_problem_and_fix():
    from gemzoo_jfa import family

    from gemzoo.api import ACTIVATION_CODES

    q, k, v, off = _meta()
    out, lse = torch.empty_like(q), torch.empty(2, q.shape[0], device="meta")
    with pytest.raises(ValueError, match="needs softmax.*use fp8='qk'"):
        family.launch_fwd(q, k, v, off, off, False, 0.125, -1, out, lse, ACTIVATION_CODES["silu"], 1.0,
                          options=family.KernelOptions(fp8="qkv"))
    with pytest.raises(ValueError, match="RoPE.*rotate q and k first"):
        family.launch_fwd(q, k, v, off, off, True, 0.125, -1, out, lse, rope_theta=10000.0,
                          options=family.KernelOptions(fp8="qk"))
    with pytest.raises(ValueError, match="power of two"):
        family.quantize_fp8(q, off, 48)
    with pytest.raises(ValueError, match="fp8='qk' or 'qkv'.*'jfa' kernel"):
        registry.get("attention", "jfa-fp8")(*(torch.zeros(3, 1, 8) for _ in range(3)), torch.tensor([0, 3]),
                                              fp8="off")


def test_fp8_tiles_and_scale_blocks():
    """On CUDA "qkv" takes 128 x 64 forward tiles (D <= 128), and the scale blocks follow the main tiles; the
    CPU emulation takes CUDA's blocks."""
    from gemzoo_jfa.family import KernelOptions, fp8_blocks

    q = torch.empty(10, 2, 128, dtype=torch.bfloat16)
    assert fp8_blocks(q, KernelOptions(fp8="qk"), "cuda") == (128, 128)
    assert fp8_blocks(q, KernelOptions(fp8="qkv"), "cuda") == (128, 64)
    # D = 256: the pointer tiles (fp8 keeps pointer loads there)
    assert fp8_blocks(torch.empty(10, 2, 256, dtype=torch.bfloat16), KernelOptions(fp8="qkv"), "cuda") == (128, 32)
    assert fp8_blocks(q.float(), KernelOptions(fp8="qk"), "cuda") == (64, 64)  # fp32's halved tiles
    assert fp8_blocks(q, KernelOptions(fp8="qkv")) == (16, 16)  # the interpreter's tiles


def test_fp8_qkv_tiles_are_one_options_object_per_call_signature():
    """The launch plans are keyed by the options object: "qkv"'s tiles must come back as the same object from
    call to call, or every call would plan its launches again on the host."""
    from gemzoo_jfa.family import KernelOptions, fp8_options

    q, options = torch.empty(10, 2, 64, dtype=torch.bfloat16), KernelOptions(fp8="qkv")
    first = fp8_options(q, options, "cuda")
    assert first is not options and first.configs.fwd.block_n == 64
    assert fp8_options(q, options, "cuda") is first
    assert fp8_options(q, KernelOptions(fp8="qk"), "cuda").configs is None


@pytest.mark.parametrize("mode", ["qk", "qkv"])
def test_cpu_emulation_quantises_inputs_and_passes_gradients_straight_through(mode):
    from gemzoo_jfa.family import KernelOptions, dequantize_fp8, fp8_blocks, quantize_fp8_reference

    fp8, plain = registry.get("attention", "jfa-fp8"), registry.get("attention", "jfa")
    gen = torch.Generator().manual_seed(3)
    off = lengths_to_offsets(torch.tensor([70, 0, 150, 9]))
    q, k, v = (torch.randn(229, 2, 32, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(229, 2, 32, generator=gen)
    out = fp8(q, k, v, off, causal=True, window=40, fp8=mode)
    out.backward(grad)
    fp8_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref_out = plain(q, k, v, off, causal=True, window=40)
    ref_out.backward(grad)
    for mine, theirs in zip(fp8_grads, (q.grad, k.grad, v.grad), strict=True):
        assert torch.equal(mine, theirs)  # the gradients of the unquantised attention
    blocks = fp8_blocks(q, KernelOptions(fp8=mode), "cuda")  # fp32: 64 x 64 ("qk"), 128 x 64 ("qkv")

    def qdq(x, block):
        return dequantize_fp8(*quantize_fp8_reference(x.detach(), off, block), x.dtype)

    with torch.no_grad():
        emulated = plain(qdq(q, blocks[0]), qdq(k, blocks[1]), qdq(v, blocks[1]) if mode == "qkv" else v, off,
                         causal=True, window=40)
    assert torch.equal(out.detach(), emulated)
    err = float((out.detach() - ref_out.detach()).pow(2).mean().sqrt() / v.detach().pow(2).mean().sqrt())
    assert 1e-4 < err < 2e-2, err  # e4m3 rounding shows, within the bound


def test_fp8_attention_with_fp8_linears_trains_gem_tiny_on_cpu(tmp_path):
    """jfa-fp8 (CPU emulation) with the fp8-tensorwise precision policy: a few gem-tiny steps, finite losses."""
    if "fp8-tensorwise" not in registry.names("precision"):
        pytest.skip("gemzoo-mxfp8 (fp8-tensorwise) is not installed")
    from gemzoo.api import load_config, train

    cfg = load_config(TINY, plugins="jfa-fp8,fp8-tensorwise",
                      overrides=["run.steps=3", "run.log_every=1", "data.batch_size=8", "eval.every=0",
                                 "checkpoint.every=0", "run.device=cpu"])
    assert cfg.plugins.attention == "jfa-fp8" and cfg.plugins.precision == "fp8-tensorwise"
    result = train(cfg, out_dir=tmp_path / "run", progress=False)
    losses = [row["loss"] for row in result.history]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
