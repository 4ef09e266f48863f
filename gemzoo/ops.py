"""Tolerant loader for the ``gemzoo._C`` extension, with torch fallbacks.

If the extension is missing or was built against another torch, gemzoo warns once and uses the
plain-torch code below, so every op works on every machine.
"""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["extension_available", "extension_info", "jagged_to_padded", "padded_to_jagged"]


@functools.cache
def _load_extension():
    try:
        from gemzoo import _C  # noqa: F401  (registers torch.ops.gemzoo.*)
    except (ImportError, OSError) as exc:
        warnings.warn(
            f"gemzoo._C is unavailable ({exc}); using torch fallbacks. Rebuild with "
            "`pip install --no-build-isolation -e .` to get the C++ ops.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return _C


def extension_available() -> bool:
    return _load_extension() is not None


def extension_info() -> dict:
    ext = _load_extension()
    info = {"loaded": ext is not None, "torch": torch.__version__}
    if ext is not None:
        info["built_with_torch"] = getattr(ext, "TORCH_VERSION", "unknown")
    return info


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad: float = 0.0) -> torch.Tensor:
    lengths = offsets[1:] - offsets[:-1]
    batch = lengths.numel()
    out = values.new_full((batch, max_len, *values.shape[1:]), pad)
    if values.shape[0] == 0 or max_len == 0:
        return out
    from gemzoo.jagged import positions, seq_ids

    ids = seq_ids(offsets, values.shape[0])
    pos = positions(offsets, values.shape[0])
    keep = pos < max_len
    return out.index_put((ids[keep], pos[keep]), values[keep])


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from gemzoo.jagged import positions, seq_ids

    total = int(offsets[-1])
    ids = seq_ids(offsets, total)
    pos = positions(offsets, total)
    return padded[ids, pos]
