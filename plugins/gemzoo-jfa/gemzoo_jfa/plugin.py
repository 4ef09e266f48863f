"""gemzoo plugin: registers the ``jfa`` attention kernel (Triton on CUDA; the C++ ``cpu`` kernel or
``reference`` on CPU tensors, so one config runs on any machine) and ``jfa-fp8`` (its fp8 forward; on CPU
tensors an emulation of it)."""

from __future__ import annotations

from gemzoo.api import hookimpl
from gemzoo_jfa.ops import KERNEL, KERNEL_FP8

GEMZOO_API = ">=1,<2"


@hookimpl
def gemzoo_register_attention(register):
    register("jfa", KERNEL)
    register("jfa-fp8", KERNEL_FP8)
