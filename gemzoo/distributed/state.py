"""Sharded state <-> whole tensors, for checkpoints that reshard.

Saving, every rank calls the gathers (they are collective) and rank 0 gets whole tensors, which
``gemzoo.train.checkpoint`` writes; loading, each rank copies its own pieces out of the whole tensors. A
checkpoint therefore does not depend on the layout it was written under: torchrec ShardedTensors (sharded
tables), FSDP2 and tensor-parallel DTensors (transformer blocks) and plain tensors all become whole tensors, in
the model's own layout: a fused projection whose rows tensor parallelism put in rank order
(``dense.to_rank_rows``) is written in its original order and reordered for the layout it loads into.
"""

from __future__ import annotations

from typing import Any

import torch

from gemzoo.distributed.dense import from_rank_rows, rank_rows, to_rank_rows
from gemzoo.errors import CheckpointError


def is_sharded(t) -> bool:
    """A torchrec/torch ShardedTensor (local shards plus their offsets in the whole tensor)."""
    return hasattr(t, "local_shards") and hasattr(t, "gather")


def whole_size(t) -> tuple[int, ...]:
    """The whole tensor's shape; a torch ShardedTensor's read from its metadata (its ``size()`` and ``dtype`` go
    through the deprecated ``__torch_function__`` and warn on every call), another sharded view's (a planner's
    own, with ``local_shards``, ``gather`` and ``size()``) from ``size()``."""
    if not is_sharded(t):
        return tuple(t.shape)
    return tuple(t.metadata().size) if callable(getattr(t, "metadata", None)) else tuple(t.size())


def whole_dtype(t) -> torch.dtype:
    if is_sharded(t) and callable(getattr(t, "metadata", None)):
        return t.metadata().tensor_properties.dtype
    return t.dtype


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _block(offsets, sizes) -> tuple[slice, ...]:
    """The index of one shard inside the whole tensor."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


def copy_into_shards(sharded, full: torch.Tensor) -> None:
    """Copy this rank's pieces of the whole tensor ``full`` into a ShardedTensor's local shards."""
    for shard in sharded.local_shards():
        shard.tensor.copy_(full[_block(shard.metadata.shard_offsets, shard.metadata.shard_sizes)])


# ---- model state --------------------------------------------------------------------------------
def shape_mismatches(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> list[tuple[str, tuple, tuple]]:
    """(name, saved shape, model shape) for each saved tensor whose shape differs from the model's (whole) one."""
    out = []
    for name, value in model.state_dict().items():
        if name in full and tuple(full[name].shape) != whole_size(value):
            out.append((name, tuple(full[name].shape), whole_size(value)))
    return out


def rank_row_names(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """{parameter name: (parts, tp)} of the parameters whose rows tensor parallelism keeps in rank order."""

    return {name: rank_rows(p) for name, p in model.named_parameters() if rank_rows(p) is not None}


def _whole(value: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """A DTensor's whole tensor in the model's own row order."""

    value = value.full_tensor()
    return from_rank_rows(value, *rows) if rows is not None else value


def _local(value, full: torch.Tensor, rows: tuple[int, int] | None):
    """This rank's DTensor piece (laid out like ``value``) of the whole tensor ``full``."""
    from torch.distributed.tensor import distribute_tensor

    full = to_rank_rows(full, *rows) if rows is not None else full
    return distribute_tensor(full.detach().to(value.dtype), value.device_mesh, value.placements)


def gather_full_state(state: dict[str, Any], is_main: bool,
                      rows: dict[str, tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors on the main rank for a state dict that may hold ShardedTensors and DTensors. ``rows``:
    :func:`rank_row_names` of the model, whose tensors are put back in the model's own order.

    Every rank must call it (each ShardedTensor is gathered collectively); other ranks get {}.
    """
    full = {}
    for name, value in state.items():
        if is_sharded(value):
            out = torch.empty(whole_size(value), dtype=whole_dtype(value)) if is_main else None
            value.gather(dst=0, out=out)
            value = out
        elif is_dtensor(value):
            value = _whole(value, (rows or {}).get(name))
        if is_main:
            full[name] = value
    return full


@torch.no_grad()
def load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load full tensors into ``model``, copying into the local shards of sharded tables; (missing, unexpected)."""
    mismatched = shape_mismatches(model, full)
    if mismatched:
        raise CheckpointError("the checkpoint does not fit this model: " + "; ".join(
            f"{name} is {list(saved)} in the checkpoint but {list(own)} in the model" for name, saved, own in mismatched[:5]))
    own = model.state_dict()
    rows = rank_row_names(model)
    missing = [k for k in own if k not in full]
    unexpected = [k for k in full if k not in own]
    plain = {}
    for name, value in own.items():
        if name not in full:
            continue
        if is_sharded(value):
            copy_into_shards(value, full[name])
        elif is_dtensor(value):
            value.copy_(_local(value, full[name], rows.get(name)))
        else:
            plain[name] = full[name]
    result = model.load_state_dict(plain, strict=False)
    if result.unexpected_keys:  # a wrapper whose state_dict names differ from its load path
        raise CheckpointError(f"these saved tensors did not load into the model: {result.unexpected_keys[:5]}")
    return missing, unexpected


# ---- optimizer state ----------------------------------------------------------------------------
def optimizer_rank_rows(opt: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    """{state-dict id: (parts, tp)} of ``opt``'s parameters whose rows are in rank order (tensor parallelism)."""

    params = [p for group in opt.param_groups for p in group["params"]]
    return {i: rank_rows(p) for i, p in enumerate(params) if rank_rows(p) is not None}


def gather_optimizer_state(state: dict, rows: dict[int, tuple[int, int]] | None = None) -> dict:
    """Optimizer state with FSDP2 / tensor-parallel DTensor entries made whole (collective on every rank);
    ``rows``: :func:`optimizer_rank_rows`, whose entries are put back in the parameter's own row order."""
    out = {"param_groups": state["param_groups"], "state": {}}
    for pid, pstate in state["state"].items():
        out["state"][pid] = {k: (_whole(v, (rows or {}).get(pid)) if is_dtensor(v) else v) for k, v in pstate.items()}
    return out


def redistribute_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After loading whole tensors, shard each state entry like its FSDP2 / tensor-parallel parameter again."""

    for p, pstate in opt.state.items():
        if not is_dtensor(p):
            continue
        for k, v in pstate.items():
            if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.shape == p.shape:
                pstate[k] = _local(p, v.to(p.dtype), rank_rows(p))


# ---- state whose names differ between ranks (e.g. a fused optimizer lists only the tables a rank stores) ----
def gather_pieces(values: dict[str, Any], is_main: bool, group=None) -> dict[str, torch.Tensor]:
    """Whole tensors on the main rank (of ``group``, default the world), {} elsewhere; every rank calls it.

    ``values`` maps names to ShardedTensors or plain tensors, and may hold other names on each rank, so a
    per-name collective would not line up: the local shards travel to the main rank with their offsets instead
    (one ``gather_object``)."""
    import torch.distributed as dist

    pieces = []
    for name, value in values.items():
        if is_sharded(value):
            pieces += [(name, whole_size(value), tuple(s.metadata.shard_offsets), s.tensor.detach().cpu())
                       for s in value.local_shards()]
        else:
            pieces.append((name, tuple(value.shape), (0,) * value.dim(), value.detach().cpu()))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group) if is_main else None
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        dist.gather_object(pieces, gathered, dst=dst, group=group)
        pieces = [p for rank_pieces in gathered for p in rank_pieces] if is_main else []
    full = {}
    for name, size, offsets, tensor in pieces:
        whole = full.setdefault(name, torch.zeros(size, dtype=tensor.dtype))
        whole[_block(offsets, tensor.shape)] = tensor
    return full


@torch.no_grad()
def scatter_pieces(values: dict[str, Any], full: dict[str, torch.Tensor]) -> list[str]:
    """Copy whole tensors into this rank's ``values`` (ShardedTensors or plain); returns the names ``full`` lacks."""
    missing = []
    for name, value in values.items():
        if name not in full:
            missing.append(name)
        elif is_sharded(value):
            copy_into_shards(value, full[name])
        else:
            value.copy_(full[name])
    return missing
