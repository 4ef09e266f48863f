"""gemzoo-gdpa: Generalized Dot-Product Attention (pointwise activations, asymmetric cross attention) in
Triton, forward and backward on jagged q/k/v + offsets.

    from gemzoo_gdpa import gdpa_triton
    out = gdpa_triton(q, k, v, q_offsets, k_offsets=None, causal=True, activation="silu", norm=None)
    out = gdpa_triton(q, k, v, q_offsets, activation="silu", norm=211.0,
                      relative_bias=RelativeAttentionBias(positions, time_weights, next_times, times))

The kernels are gemzoo-jfa's family (one tile loop for softmax and pointwise activations); a relative
attention bias (``gemzoo.api.RelativeAttentionBias``, HSTU's) is computed inside their tiles. Importing
this package does not import Triton; the kernels load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"


def gdpa_triton(q, k, v, q_offsets, k_offsets=None, **kw):
    """The Triton path on q's device (CUDA, or CPU under TRITON_INTERPRET=1). See gemzoo_gdpa.ops.gdpa_triton."""
    from gemzoo_gdpa.ops import gdpa_triton as _impl

    return _impl(q, k, v, q_offsets, k_offsets, **kw)


def gdpa_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    """The registered kernel: Triton on CUDA, the CPU kernel (or reference) elsewhere."""
    from gemzoo_gdpa.ops import gdpa_attention as _impl

    return _impl(q, k, v, q_offsets, k_offsets, **kw)


__all__ = ["gdpa_triton", "gdpa_attention", "__version__"]
