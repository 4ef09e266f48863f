"""Jagged layout helpers: ``values [T, ...]`` plus int64 ``offsets [B+1]`` (torchrec/fbgemm convention).

Offsets, lengths, positions and the tensor cache only; the padded conversions (C++ op or torch fallback) are
``gemzoo.ops.jagged_to_padded`` / ``padded_to_jagged``, which build on this module.

Rules checked by :func:`validate_offsets`:
  1. offsets is a 1-D int64 tensor with at least one element;
  2. it lives on the same device as the values;
  3. ``offsets[0] == 0``;
  4. offsets never decrease (zero-length sequences are fine);
  5. ``offsets[-1] == T`` (the number of rows of values).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from gemzoo.errors import JaggedShapeError


class TensorCache:
    """Values computed from tensors (offsets, mostly), kept by the tensors' identity and version counters.

    ``get(tensors, key, build)`` returns ``build()``, or its value from an earlier call with the same tensor
    objects, unchanged since (an in-place change bumps ``_version``), and the same ``key``. Entries hold weak
    references, so a freed tensor whose id is reused never matches; the oldest entries go past ``size``.
    Shared values must not be modified by their users.

    Never cached: inference tensors (no version counter), traced calls, and CUDA work off the device's default
    stream. The last covers CUDA graphs: ``torch.cuda.graph`` records on a side stream, where a value cached
    before the capture would be baked into every replay whatever the offsets then hold, so the value is built
    inside the graph; torch.compile's "reduce-overhead" mode warms up and records on a stream of its own, into
    a memory pool where a value kept past the call counts as a leak. A value is never shared across streams
    either (its memory is reused when it is freed, whatever another stream still reads)."""

    def __init__(self, size: int = 32):
        self.size = size
        self.entries: OrderedDict[tuple, tuple] = OrderedDict()

    def get(self, tensors: tuple, key: tuple, build):
        if torch.compiler.is_compiling() or not _default_stream(tensors[0]):
            return build()
        try:  # (ids..., versions..., key...): one flat tuple, hashed once (this runs on every attention call)
            full = (*[id(t) for t in tensors], *[t._version for t in tensors], *key)
        except RuntimeError:  # inference tensors keep no version counter
            return build()
        hit = self.entries.get(full)
        if hit is not None:
            refs = hit[0]
            for i, t in enumerate(tensors):
                if refs[i]() is not t:
                    break
            else:
                self.entries.move_to_end(full)
                return hit[1]
        value = build()
        self.entries[full] = (tuple(weakref.ref(t) for t in tensors), value)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


def _default_stream(t: torch.Tensor) -> bool:
    """Whether work on ``t`` runs on its device's default stream (always, for a CPU tensor). Stream id 0 is
    CUDA's default stream in torch (c10::cuda::CUDAStream)."""
    return not t.is_cuda or torch.cuda.current_stream(t.device).stream_id == 0


def graph_capturing(t: torch.Tensor) -> bool:
    """Whether work on ``t``'s device is being recorded into a CUDA graph (``torch.cuda.graph``, or
    ``torch.compile(mode="reduce-overhead")``). Nothing may then read device values on the host (a sync is an
    error during capture), and a value cached before the capture would be replayed unchanged."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


__all__ = [
    "graph_capturing",
    "validate_offsets",
    "lengths_to_offsets",
    "offsets_to_lengths",
    "max_length",
    "seq_ids",
    "positions",
    "TensorCache",
]


def validate_offsets(offsets: torch.Tensor, total: int | None = None, *, device=None, name: str = "offsets") -> None:
    """Raise :class:`JaggedShapeError` naming the first rule ``offsets`` breaks."""
    if not isinstance(offsets, torch.Tensor):
        raise JaggedShapeError(f"{name} must be a torch.Tensor of int64, got {type(offsets).__name__}")
    if offsets.dtype != torch.int64:
        raise JaggedShapeError(
            f"{name} must have dtype torch.int64, got {offsets.dtype}; convert with {name}.long()"
        )
    if offsets.dim() != 1 or offsets.numel() == 0:
        raise JaggedShapeError(f"{name} must be 1-D with B+1 >= 1 elements, got shape {tuple(offsets.shape)}")
    if device is not None and offsets.device != torch.device(device):
        raise JaggedShapeError(
            f"{name} is on {offsets.device} but the values are on {device}; move it with {name}.to(values.device)"
        )
    first = int(offsets[0])
    if first != 0:
        raise JaggedShapeError(f"{name}[0] must be 0, got {first}")
    if offsets.numel() > 1:
        steps = offsets[1:] - offsets[:-1]
        bad = (steps < 0).nonzero()
        if bad.numel():
            i = int(bad[0, 0]) + 1
            raise JaggedShapeError(
                f"{name} must be non-decreasing, but {name}[{i}]={int(offsets[i])} < {name}[{i - 1}]={int(offsets[i - 1])}"
            )
    last = int(offsets[-1])
    if total is not None and last != total:
        raise JaggedShapeError(
            f"{name}[-1] must equal the number of value rows T={total}, got {last} (at index {offsets.numel() - 1})"
        )


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def max_length(offsets: torch.Tensor) -> int:
    return int(offsets_to_lengths(offsets).max()) if offsets.numel() > 1 else 0


def seq_ids(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Sequence index of every value row, shape [T]."""
    lengths = offsets_to_lengths(offsets)
    total = int(offsets[-1]) if total is None else total
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)


def positions(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Position of every value row inside its own sequence, shape [T]."""
    ids = seq_ids(offsets, total)
    return torch.arange(ids.numel(), device=offsets.device) - offsets[ids]
