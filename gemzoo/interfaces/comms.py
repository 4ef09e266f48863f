"""Communication backends: make a c10d backend available by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class CommsCapabilities:
    sm_free: bool = False
    implements: frozenset[str] = field(default_factory=frozenset)  # collectives it runs itself
    devices: frozenset[str] = frozenset({"cpu", "cuda"})


@runtime_checkable
class CommsBackend(Protocol):
    capabilities: CommsCapabilities

    def backend_for(self, device_type: str) -> str:
        """The c10d backend string to pass to ``init_process_group`` for ``device_type``."""

    def install(self) -> None:
        """Register the backend with ``torch.distributed.Backend.register_backend`` if needed."""
