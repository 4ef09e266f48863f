"""Registers the comms backend ``ncclx``: SM-free all-gather, all-to-all and reduce-scatter.

NCCL's collectives are kernels on the SMs, so communication that overlaps compute slows the GEMMs it overlaps.
GEM uses NCCLX (host-driven, zero-copy CTran) to move those bytes without SMs. ``ncclx`` does the same inside
one node with CUDA's copy engines: each rank's data sits in a staging buffer the other ranks map with CUDA IPC,
and every rank pulls what it needs with ``cudaMemcpyAsync`` on a dedicated stream, ordered by (IPC) events and
driven from the host. Reduce-scatter adds the pulled chunks with a kernel limited to ``reduce_blocks`` thread
blocks (so at most that many SMs). On CPU the same schedule runs over gloo point-to-point, which is what CI
tests. Everything else (all_reduce, broadcast, barrier, ...) is NCCL's (CUDA) or gloo's (CPU).

``install()`` registers the c10d backend ``ncclx`` (``torch.distributed.Backend.register_backend``), so the
default group, DeviceMesh's groups, FSDP2 and torchrec use it through ordinary process groups.

Options (``[plugins.options.ncclx]``, validated by ``NcclxOptions``)::

    chunk_bytes = 33554432   # largest piece one copy moves; pieces from every peer alternate, and
                             # reduce-scatter reduces piece j while piece j+1 is copied
    reduce_blocks = 10       # thread blocks (so SMs at most) of reduce-scatter's reduction kernel on CUDA:
                             # ~51 GB/s each on the H200, so 10 keep up with one NVLink direction (~450 GB/s)
"""

from __future__ import annotations

from dataclasses import dataclass

from gemzoo.api import CommsCapabilities, ConfigError, TakesOptions, bounded, hookimpl

GEMZOO_API = ">=1,<2"

BACKEND = "ncclx"
IMPLEMENTS = frozenset({"all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter",
                        "all_to_all_single", "all_to_all"})


@dataclass(frozen=True)
class NcclxOptions:
    chunk_bytes: int = bounded(32 << 20, min=16)  # largest piece one copy moves (pieces of all peers alternate)
    reduce_blocks: int = bounded(10, min=1)  # CUDA thread blocks (so SMs at most) of reduce-scatter's reduction

    def __post_init__(self):
        where = "plugins.options.ncclx"
        for name, low in (("chunk_bytes", 16), ("reduce_blocks", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ConfigError(f"{where}.{name} must be an integer >= {low}, got {value!r}")


class NcclxComms(TakesOptions):
    """SM-free collectives: copy-engine pulls over NVLink on CUDA, gloo point-to-point on CPU; the rest is c10d."""

    capabilities = CommsCapabilities(sm_free=True, implements=IMPLEMENTS)
    options_cls = NcclxOptions
    description = ("SM-free all-gather / all-to-all / reduce-scatter: copy-engine P2P pulls (CUDA IPC), "
                   "gloo p2p on CPU; the rest is c10d")

    def backend_for(self, device_type: str) -> str:
        return BACKEND

    def install(self) -> None:
        """Register (or re-point, for new options) the c10d backend ``ncclx`` for CPU and CUDA tensors."""
        import torch.distributed as dist

        from gemzoo_ncclx.process_group import make_creator

        dist.Backend.register_backend(BACKEND, make_creator(self.options), devices=["cpu", "cuda"])

    def __repr__(self) -> str:
        return f"NcclxComms({self.options})"


@hookimpl
def gemzoo_register_comms(register):
    register(BACKEND, NcclxComms())
