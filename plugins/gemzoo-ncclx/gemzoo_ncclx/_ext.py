"""Tolerant JIT loader of the copy-engine C++/CUDA part (plugins/gemzoo-ncclx/csrc/comms).

Built with ``torch.utils.cpp_extension.load`` (ninja) the first time a CUDA collective needs it, into torch's
extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), never into the checkout.
The sources include only pybind11 and the CUDA runtime (no ATen), so the build takes seconds, and ranks that
start together wait on torch's build lock instead of building twice. If the build or the import fails, the
reason is returned (the caller says it once, and its CUDA groups use NCCL). ``GEMZOO_NCCLX_NO_EXTENSION=1``
skips it on purpose.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / "csrc" / "comms"
NAME = "gemzoo_ncclx_ce"


@functools.cache
def load() -> tuple[object | None, str | None]:
    """(module, None) once built and imported, else (None, why)."""
    if os.environ.get("GEMZOO_NCCLX_NO_EXTENSION", "0") not in ("", "0"):
        return None, "GEMZOO_NCCLX_NO_EXTENSION is set"
    sources = [SOURCES / "ncclx_ce.cpp", SOURCES / "ncclx_reduce.cu"]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        return None, f"its sources are missing ({', '.join(missing)}; install gemzoo-ncclx editable: pip install -e)"
    try:
        from torch.utils.cpp_extension import load as jit_load

        module = jit_load(name=NAME, sources=[str(s) for s in sources], extra_include_paths=[str(SOURCES)],
                          extra_cflags=["-O2", "-std=c++17"], extra_cuda_cflags=["-O3", "-std=c++17"],
                          with_cuda=True, verbose=os.environ.get("GEMZOO_NCCLX_VERBOSE_BUILD", "0") == "1")
    except Exception as exc:  # a compiler error, no nvcc, no ninja: the reason, shortened
        text = " ".join(str(exc).split())
        return None, f"{type(exc).__name__}: {text[:400]}"
    return module, None
