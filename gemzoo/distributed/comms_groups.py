"""Process groups per mesh dimension from the comms backend, and what the trainer logs about the backend.

A comms backend that implements ``backend_for_dim`` (``gemzoo.interfaces.comms.MeshDimBackends``) gives some
mesh dimensions their own c10d backend; ``init_mesh`` passes them to ``init_device_mesh`` as its
``backend_override``, so FSDP2, torchrec and the trainer, which take their groups from the mesh, use them
without knowing a backend's name. Every other dimension (and the default group) uses ``backend_for``'s.
"""

from __future__ import annotations

from gemzoo.interfaces.comms import dim_backends


def init_mesh(comms, device_type: str, shape, dim_names):
    """``init_device_mesh(device_type, shape, mesh_dim_names=dim_names)`` with the backend's per-dim groups."""
    from torch.distributed.device_mesh import init_device_mesh

    override = dim_backends(comms, dim_names, device_type)
    kwargs = {"backend_override": override} if override else {}
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(dim_names), **kwargs)


def mesh_group_backends(mesh) -> dict[str, str]:
    """{dim: the c10d backend of this rank's group along it} of a DeviceMesh."""
    import torch.distributed as dist

    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return {name: str(dist.get_backend(mesh.get_group(i))) for i, name in enumerate(names)}


def comms_summary(name: str, comms, mesh=None) -> dict:
    """The trainer's log of the comms backend: name, ``sm_free``, the collectives it runs itself (the rest go to
    c10d), and with several ranks the backend of each mesh dimension's group."""
    out = {"name": name, **comms.capabilities.summary()}
    if mesh is not None:
        out["groups"] = mesh_group_backends(mesh)
    return out
