"""Attention kernels over jagged sequences.

    out = kernel(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                 norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None)

q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv] -> out [Tq, H, Dv]. For sequence b with lengths Lq, Lk and
shift s = Lk - Lq, key j is allowed for query i iff (not causal or j <= i + s) and
(window is None or i + s - j < window) and (block_size is None or (i + s) // block_size == j // block_size).
softmax: a row with no allowed key outputs 0. Other activations: P = act(S) on allowed keys, / norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

ACTIVATIONS = ("softmax", "silu", "gelu", "gelu_tanh", "relu", "relu2", "leaky_relu", "hardswish", "identity")


@dataclass(frozen=True)
class AttentionCapabilities:
    activations: frozenset[str] = frozenset({"softmax"})
    causal: bool = True
    non_causal: bool = True
    asymmetric: bool = True  # Lq != Lk
    window: bool = False
    block: bool = False
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    backward_devices: frozenset[str] = frozenset({"cpu", "cuda"})
    head_dims: tuple[int, ...] | None = None  # None: any

    def missing(self, req: "AttentionRequest") -> list[str]:
        """Human-readable list of what ``req`` needs that this kernel lacks."""
        out = []
        if req.activation not in self.activations:
            out.append(f"activation={req.activation!r}")
        if req.causal and not self.causal:
            out.append("causal=True")
        if not req.causal and not self.non_causal:
            out.append("causal=False")
        if req.asymmetric and not self.asymmetric:
            out.append("asymmetric Lq != Lk")
        if req.window and not self.window:
            out.append("window")
        if req.block and not self.block:
            out.append("block_size")
        if req.dtype is not None and req.dtype not in self.dtypes:
            out.append(f"dtype {req.dtype}")
        if req.device is not None and req.device not in self.devices:
            out.append(f"device {req.device!r}")
        if req.backward and req.device is not None and req.device not in self.backward_devices:
            out.append(f"backward on {req.device!r}")
        if req.head_dim is not None and self.head_dims is not None and req.head_dim not in self.head_dims:
            out.append(f"head_dim {req.head_dim}")
        return out


@dataclass(frozen=True)
class AttentionRequest:
    """What one attention site of a model needs; checked against capabilities at assembly time."""

    activation: str = "softmax"
    causal: bool = True
    asymmetric: bool = False
    window: bool = False
    block: bool = False
    dtype: torch.dtype | None = None
    device: str | None = None
    backward: bool = True
    head_dim: int | None = None

    def replace(self, **kw) -> "AttentionRequest":
        from dataclasses import replace

        return replace(self, **kw)


@runtime_checkable
class AttentionKernel(Protocol):
    capabilities: AttentionCapabilities

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_offsets: torch.Tensor,
        k_offsets: torch.Tensor | None = None,
        *,
        causal: bool = True,
        activation: str = "softmax",
        scale: float | None = None,
        norm: float | None = None,
        max_q_len: int | None = None,
        max_k_len: int | None = None,
        block_size: int | None = None,
        window: int | None = None,
    ) -> torch.Tensor: ...


@dataclass
class FunctionKernel:
    """Wrap a plain function as a kernel with capabilities (the usual way to register one)."""

    fn: object
    capabilities: AttentionCapabilities = field(default_factory=AttentionCapabilities)
    description: str = ""

    def __call__(self, q, k, v, q_offsets, k_offsets=None, **kw):
        return self.fn(q, k, v, q_offsets, k_offsets, **kw)


def pair_allowed(i: torch.Tensor, j: torch.Tensor, *, causal: bool, window: int | None,
                 block_size: int | None) -> torch.Tensor:
    """DESIGN.md's rule for query positions ``i`` (already shifted by Lk - Lq) and key positions ``j``,
    broadcast against each other."""
    ok = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (i - j) < window
    if block_size is not None:
        ok &= torch.div(i, block_size, rounding_mode="floor") == torch.div(j, block_size, rounding_mode="floor")
    return ok


def allowed_mask(lq: int, lk: int, *, causal: bool, window: int | None, block_size: int | None, device=None):
    """Boolean [lq, lk] mask of allowed (query, key) pairs for one sequence."""
    i = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
    j = torch.arange(lk, device=device).unsqueeze(0)
    return pair_allowed(i, j, causal=causal, window=window, block_size=block_size)


def apply_activation(scores: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(scores)
    if activation == "gelu":
        return torch.nn.functional.gelu(scores)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(scores, approximate="tanh")
    if activation == "relu":
        return torch.relu(scores)
    if activation == "relu2":
        return torch.relu(scores).square()
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu(scores, 0.01)
    if activation == "hardswish":
        return torch.nn.functional.hardswish(scores)
    if activation == "identity":
        return scores
    raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")


def check_inputs(q, k, v, q_offsets, k_offsets, activation: str = "softmax"):
    """Validate shapes and offsets; return ``k_offsets`` (defaulting to ``q_offsets``)."""
    from gemzoo.errors import JaggedShapeError
    from gemzoo.jagged import validate_offsets

    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise JaggedShapeError(f"{name} must be [T, H, D], got shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise JaggedShapeError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [Tk, H]")
    if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]:
        raise JaggedShapeError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on H and D")
    validate_offsets(q_offsets, q.shape[0], device=q.device, name="q_offsets")
    if k_offsets is None:
        k_offsets = q_offsets
        if k.shape[0] != q.shape[0]:
            raise JaggedShapeError("k_offsets is required when k and q have different numbers of rows")
    else:
        validate_offsets(k_offsets, k.shape[0], device=k.device, name="k_offsets")
        if k_offsets.numel() != q_offsets.numel():
            raise JaggedShapeError(
                f"q_offsets has {q_offsets.numel() - 1} sequences but k_offsets has {k_offsets.numel() - 1}"
            )
    return k_offsets
