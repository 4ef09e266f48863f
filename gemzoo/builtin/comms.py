"""Built-in comms backend ``torch``: plain c10d (nccl on GPU, gloo on CPU)."""

from __future__ import annotations

from gemzoo.interfaces.comms import CommsCapabilities
from gemzoo.plugins import hookimpl


class TorchComms:
    capabilities = CommsCapabilities(sm_free=False, implements=frozenset())

    def backend_for(self, device_type: str) -> str:
        return "nccl" if device_type == "cuda" else "gloo"

    def install(self) -> None:
        """c10d's own backends need no registration."""


@hookimpl
def gemzoo_register_comms(register):
    register("torch", TorchComms())
