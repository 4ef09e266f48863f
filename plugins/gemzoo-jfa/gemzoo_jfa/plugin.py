"""gemzoo plugin: registers the ``jfa`` attention kernel (Triton on CUDA; the C++ ``cpu`` kernel or
``reference`` on CPU tensors, so one config runs on any machine)."""

from __future__ import annotations

import torch

import gemzoo
from gemzoo.interfaces.attention import AttentionCapabilities, FunctionKernel

# What every kernel of jfa's Triton family serves (jfa itself; gdpa and block-attention widen it with
# dataclasses.replace): causal, full and sliding-window masks, Lq != Lk, fp32/bf16/fp16, forward and backward
# on CUDA (Triton) and CPU (the fallback), head dims up to 256.
FAMILY_CAPABILITIES = AttentionCapabilities(
    activations=frozenset({"softmax"}),
    causal=True,
    non_causal=True,
    asymmetric=True,
    window=True,
    block=False,
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    devices=frozenset({"cpu", "cuda"}),
    backward_devices=frozenset({"cpu", "cuda"}),
    head_dims=tuple(range(1, 257)),
)


def _jfa_cuda(q, k, v, q_offsets, k_offsets=None, **kw):
    from gemzoo_jfa.ops import jfa_triton

    return jfa_triton(q, k, v, q_offsets, k_offsets, **kw)


def jfa_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    """Jagged flash attention; CUDA tensors run the Triton kernels, others the CPU kernel (after the same
    capability check, so the fallback accepts nothing jfa does not declare)."""
    return KERNEL(q, k, v, q_offsets, k_offsets, **kw)


KERNEL = FunctionKernel(
    _jfa_cuda,
    FAMILY_CAPABILITIES,
    "Jagged flash attention (Triton, fwd+bwd on jagged q/k/v, longest-first work schedule); CPU tensors "
    "go to the 'cpu' kernel or 'reference'",
    cpu_fallback="cpu",
)


@gemzoo.hookimpl
def gemzoo_register_attention(register):
    register("jfa", KERNEL)
