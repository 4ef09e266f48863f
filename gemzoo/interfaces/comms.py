"""Communication backends: make a c10d backend available by name.

The trainer, FSDP2 and torchrec reach collectives only through ordinary process groups (the default group
and the DeviceMesh's), never by a backend's name: ``install()`` registers the backend with
``torch.distributed.Backend.register_backend``, ``backend_for(device_type)`` names it for
``init_process_group``, and every group made afterwards uses it. A backend may give some mesh dimensions
their own c10d backend (``backend_for_dim``, e.g. copy-engine collectives inside a node and NCCL across
nodes); ``gemzoo.distributed.comms_groups`` builds the mesh with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gemzoo.errors import PluginError

# The collectives a backend can run itself, named as torch.distributed spells them.
COLLECTIVES = frozenset({
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "send", "recv",
})


@dataclass(frozen=True)
class CommsCapabilities:
    """``sm_free``: data moves with copy engines (peer-to-peer copies, symmetric memory), never an SM kernel,
    except for a reduction's arithmetic. ``implements``: the collectives it runs itself (names in
    ``COLLECTIVES``); every other collective it delegates to c10d."""

    sm_free: bool = False
    implements: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        object.__setattr__(self, "implements", frozenset(self.implements))
        unknown = sorted(self.implements - COLLECTIVES)
        if unknown:
            raise PluginError(f"CommsCapabilities.implements names unknown collectives {unknown}; use the "
                              f"torch.distributed names: {', '.join(sorted(COLLECTIVES))}")

    @property
    def delegated(self) -> frozenset[str]:
        """The collectives that go to c10d."""
        return COLLECTIVES - self.implements

    def summary(self) -> dict:
        """What the trainer logs and ``gemzoo plugins`` can show."""
        return {"sm_free": bool(self.sm_free), "implements": sorted(self.implements)}


@runtime_checkable
class CommsBackend(Protocol):
    capabilities: CommsCapabilities

    def backend_for(self, device_type: str) -> str:
        """The c10d backend string to pass to ``init_process_group`` for ``device_type`` ("cpu" or "cuda").
        Every comms backend runs on CPU (gloo as its transport there), so the conformance suite can test it."""

    def install(self) -> None:
        """Register the backend with ``torch.distributed.Backend.register_backend`` if needed (idempotent)."""


@runtime_checkable
class MeshDimBackends(Protocol):
    """Optional: a backend that gives mesh dimensions their own process groups."""

    def backend_for_dim(self, dim: str, device_type: str) -> str | None:
        """The c10d backend string for the process groups of mesh dimension ``dim`` (e.g. "shard",
        "replica", "dp"), or None for the default group's backend."""


def dim_backends(comms, dims, device_type: str) -> dict[str, str]:
    """{dim: backend} for the dims of ``dims`` that ``comms`` gives their own backend ({} when none)."""
    if not isinstance(comms, MeshDimBackends):
        return {}
    out = {}
    for dim in dims:
        backend = comms.backend_for_dim(dim, device_type)
        if backend is not None:
            if not isinstance(backend, str) or not backend:
                raise PluginError(f"comms backend {type(comms).__name__}.backend_for_dim({dim!r}, {device_type!r}) "
                                  f"returned {backend!r}; want a c10d backend name or None")
            out[dim] = backend
    return out
