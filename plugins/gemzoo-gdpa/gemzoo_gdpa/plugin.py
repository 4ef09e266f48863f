"""gemzoo plugin: registers the ``gdpa`` attention kernel (Triton on CUDA; the C++ ``cpu`` kernel or
``reference`` on CPU tensors, so one config runs on any machine)."""

from __future__ import annotations

from gemzoo.api import hookimpl
from gemzoo_gdpa.ops import KERNEL

GEMZOO_API = ">=1,<2"


@hookimpl
def gemzoo_register_attention(register):
    register("gdpa", KERNEL)
