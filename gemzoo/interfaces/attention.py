"""Attention kernels over jagged sequences: the declarations (what a kernel is, what a site asks for).

    out = kernel(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                 norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None)

q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv] -> out [Tq, H, Dv]. With grouped k/v (GQA/MQA, a kernel declaring
``grouped_kv``) k and v have Hkv heads, Hkv dividing H, and query head h attends with k/v head h // (H / Hkv). For sequence b with lengths Lq, Lk and
shift s = Lk - Lq, key j is allowed for query i iff (not causal or j <= i + s) and
(window is None or i + s - j < window) and (block_size is None or (i + s) // block_size == j // block_size).
softmax: a row with no allowed key outputs 0. Other activations: P = act(S) on allowed keys, / norm.
NaN stays in its own sequence. docs/attention.md has the whole contract.

This module holds the declarations only: :data:`ACTIVATIONS`, :class:`AttentionCapabilities`,
:class:`AttentionRequest` and the :class:`AttentionKernel` Protocol. The executable semantics (mask rule,
RoPE, activations, the reference oracle), the input checks and the model-side attention sites live in the
:mod:`gemzoo.attention` package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

ACTIVATIONS = ("softmax", "silu", "gelu", "gelu_tanh", "relu", "relu2", "leaky_relu", "hardswish", "identity")


# HSTU's time buckets: floor(ln(gap in seconds) / 0.301), about log base 1.35 of the gap
TIME_BUCKET_DIVISOR = 0.301


@dataclass(frozen=True)
class RelativeAttentionBias:
    """A learned relative attention bias that a kernel computes inside its tiles, never as a [B, L, L] tensor
    (HSTU's relative position and time-bucket bias). For query i and key j of one sequence (shift s = Lk - Lq):

        bias(i, j) = positions[clamp(i + s - j, 0, P - 1)]
                   + time_weights[clamp(trunc(log(float32(max(|q_times[i] - k_times[j]|, 1))) / bucket_divisor),
                                        0, NB)]

    added to the scaled score of every head before the mask and the activation. ``positions`` is [P] and
    ``time_weights`` [NB + 1] (or None: positions only), both floating and differentiable; ``q_times`` [Tq] and
    ``k_times`` [Tk] are int64 timestamps (seconds), given exactly when ``time_weights`` is. HSTU compares
    each query at the time of the item that follows it (q_times = next_times) with each key's own time.
    The log is taken in float32, as HSTU's reference implementation takes it.
    """

    positions: torch.Tensor
    time_weights: torch.Tensor | None = None
    q_times: torch.Tensor | None = None
    k_times: torch.Tensor | None = None
    bucket_divisor: float = TIME_BUCKET_DIVISOR


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
    rotary: bool = False  # rope_theta
    bias: bool = False  # an additive score bias, bias= [B, 1 or H, >= Lq, >= Lk] padded
    relative_bias: bool = False  # relative_bias= a RelativeAttentionBias, computed inside the tiles
    grouped_kv: bool = False  # k/v with fewer heads than q (GQA/MQA): Hkv divides Hq, q head h reads h // (Hq/Hkv)

    def missing(self, req: AttentionRequest) -> list[str]:
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
        if req.rotary and not self.rotary:
            out.append("rope_theta (rotary)")
        if req.bias and not self.bias:
            out.append("bias (additive attention bias)")
        if req.relative_bias and not self.relative_bias:
            out.append("relative_bias (fused relative position/time bias)")
        if req.grouped_kv and not self.grouped_kv:
            out.append("grouped_kv (k/v with fewer heads than q)")
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
    rotary: bool = False
    bias: bool = False
    relative_bias: bool = False
    grouped_kv: bool = False  # k/v have fewer heads than q (GQA/MQA)

    def replace(self, **kw) -> AttentionRequest:
        return dataclasses.replace(self, **kw)


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
        rope_theta: float | None = None,
        relative_bias: RelativeAttentionBias | None = None,
    ) -> torch.Tensor: ...
