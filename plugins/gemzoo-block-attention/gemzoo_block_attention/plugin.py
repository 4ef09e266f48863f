"""gemzoo plugin: registers the ``block-attention`` attention kernel (Triton on CUDA; on CPU tensors the C++
``cpu`` kernel with RoPE applied in torch, or ``reference``, after the same capability check)."""

from __future__ import annotations

from gemzoo.api import hookimpl
from gemzoo_block_attention.ops import KERNEL

GEMZOO_API = ">=1,<2"


@hookimpl
def gemzoo_register_attention(register):
    register("block-attention", KERNEL)
