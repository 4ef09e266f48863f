"""gemzoo plugin: registers the ``gdpa`` attention kernel (Triton on CUDA; the C++ ``cpu`` kernel or
``reference`` on CPU tensors, so one config runs on any machine)."""

from __future__ import annotations

import dataclasses

import gemzoo
from gemzoo.interfaces.attention import ACTIVATIONS, FunctionKernel
from gemzoo_jfa.plugin import FAMILY_CAPABILITIES

POINTWISE = frozenset(a for a in ACTIVATIONS if a != "softmax")


def _gdpa_cuda(q, k, v, q_offsets, k_offsets=None, **kw):
    from gemzoo_gdpa.ops import gdpa_triton

    return gdpa_triton(q, k, v, q_offsets, k_offsets, **kw)


def gdpa_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    """Generalized dot-product attention; CUDA tensors run the Triton kernels, others the CPU kernel (after
    the same capability check, so the fallback accepts nothing gdpa does not declare)."""
    return KERNEL(q, k, v, q_offsets, k_offsets, **kw)


KERNEL = FunctionKernel(
    _gdpa_cuda,
    dataclasses.replace(FAMILY_CAPABILITIES, activations=POINTWISE),  # jfa's family, pointwise instead of softmax
    "Generalized dot-product attention: pointwise activations (" + ", ".join(sorted(POINTWISE)) + ") with "
    "norm, causal/full/window, Lq != Lk (split-K path for short-Q/long-K cross attention); Triton fwd+bwd on "
    "jagged q/k/v sharing jfa's kernels; CPU tensors go to the 'cpu' kernel or 'reference'",
    cpu_fallback="cpu",
)


@gemzoo.hookimpl
def gemzoo_register_attention(register):
    register("gdpa", KERNEL)
