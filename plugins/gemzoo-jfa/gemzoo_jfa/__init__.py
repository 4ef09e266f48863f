"""gemzoo-jfa: Jagged Flash Attention in Triton, forward and backward on jagged q/k/v + offsets.

    from gemzoo_jfa import jfa_triton
    out = jfa_triton(q, k, v, q_offsets, k_offsets=None, causal=True, window=None, scale=None)

``gemzoo_jfa.family`` is the kernel family's public launch interface (``KernelOptions``, ``launch_fwd``,
``backward``, ``run_attention``), which gemzoo-gdpa and gemzoo-block-attention build on. Importing this
package does not import Triton; the kernels load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"


def jfa_triton(q, k, v, q_offsets, k_offsets=None, **kw):
    """The Triton path on q's device (CUDA, or CPU under TRITON_INTERPRET=1). See gemzoo_jfa.ops.jfa_triton."""
    from gemzoo_jfa.ops import jfa_triton as _impl

    return _impl(q, k, v, q_offsets, k_offsets, **kw)


def jfa_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    """The registered kernel: Triton on CUDA, the CPU kernel (or reference) elsewhere."""
    from gemzoo_jfa.ops import jfa_attention as _impl

    return _impl(q, k, v, q_offsets, k_offsets, **kw)


__all__ = ["jfa_triton", "jfa_attention", "__version__"]
