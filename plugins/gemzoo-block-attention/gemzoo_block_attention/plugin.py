"""gemzoo plugin: registers the ``block-attention`` attention kernel (Triton on CUDA; on CPU tensors the C++
``cpu`` kernel with RoPE applied in torch, or ``reference``, after the same capability check)."""

from __future__ import annotations

import dataclasses

import gemzoo
from gemzoo.interfaces.attention import ACTIVATIONS, FunctionKernel, check_inputs
from gemzoo_jfa.plugin import FAMILY_CAPABILITIES


def _block_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    if q.device.type == "cuda":
        from gemzoo_block_attention.ops import block_attention_triton

        return block_attention_triton(q, k, v, q_offsets, k_offsets, **kw)
    # CPU: the same check as the Triton path, then the C++ kernel (rotary applied in torch first; autograd
    # goes through the rotation) or the reference when the extension is not built
    q_offsets, k_offsets = check_inputs(q, k, v, q_offsets, k_offsets, capabilities=KERNEL.capabilities,
                                        kernel=KERNEL, **kw)
    from gemzoo import registry

    theta = kw.pop("rope_theta", None)
    if theta is not None:
        from gemzoo_block_attention.ops import rope_jagged

        q, k = rope_jagged(q, k, q_offsets, k_offsets, theta)
    name = "cpu" if "cpu" in registry.names("attention") else "reference"
    return registry.get("attention", name)(q, k, v, q_offsets, k_offsets, **kw)


KERNEL = FunctionKernel(
    _block_attention,
    # jfa's family plus blocks and RoPE; softmax and every pointwise activation (jfa's shared tile loop)
    dataclasses.replace(FAMILY_CAPABILITIES, activations=frozenset(ACTIVATIONS), block=True, rotary=True),
    "Block-sparse jagged attention (GEM BlockAttention): block_size blocks from each sequence's start, "
    "optional sliding window, fused RoPE (rope_theta), softmax or pointwise activations; Triton fwd+bwd on "
    "jfa's kernel family, grid over allowed tiles only; CPU tensors go to the 'cpu' kernel or 'reference'",
)


@gemzoo.hookimpl
def gemzoo_register_attention(register):
    register("block-attention", KERNEL)
