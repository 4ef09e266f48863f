"""gemzoo-block-attention: block-sparse jagged attention (GEM's BlockAttention) with fused RoPE.

    from gemzoo_block_attention import block_attention_triton
    out = block_attention_triton(q, k, v, q_offsets, k_offsets=None, block_size=64, window=None,
                                 rope_theta=None, causal=True, activation="softmax")

Each query attends only to keys of its own block of ``block_size`` positions (counted from each sequence's
start, bottom-right aligned when Lq != Lk), optionally also inside a sliding ``window``; ``rope_theta``
rotates q and k inside the kernels. The Triton kernels are gemzoo-jfa's one family (softmax and GDPA's
pointwise activations). Importing this package does not import Triton.
"""

from __future__ import annotations

__version__ = "0.1.0"


def block_attention_triton(q, k, v, q_offsets, k_offsets=None, **options):
    """The Triton path on q's device (CUDA, or CPU under TRITON_INTERPRET=1). See gemzoo_block_attention.ops."""
    from gemzoo_block_attention.ops import block_attention_triton as _impl

    return _impl(q, k, v, q_offsets, k_offsets, **options)


def block_attention(q, k, v, q_offsets, k_offsets=None, **options):
    """The registered kernel: Triton on CUDA; on CPU the 'cpu' kernel (RoPE applied in torch) or 'reference'."""
    from gemzoo_block_attention.ops import KERNEL

    return KERNEL(q, k, v, q_offsets, k_offsets, **options)


__all__ = ["block_attention_triton", "block_attention", "__version__"]
