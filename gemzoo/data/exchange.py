"""Per-rank loading and moving samples between data-parallel ranks (the batching slot's machinery).

The global batch of a step is ``dataset.train_batch(step)``; its samples are numbered 0..N-1 and rank r of W
holds the contiguous part ``shard_range(N, r, W)`` of it (``torch.tensor_split``'s rule: the first N % W
ranks get one more). ``load_shard`` gives a rank that part only: through ``dataset.train_shard(step, rank,
world_size)`` when the dataset can build part of a batch, else by building the batch and keeping the part.

``rebalance(policy, batch, costs, dp)`` turns this rank's part into the samples the policy gives it:

1. all-gather the per-sample costs (two small collectives: the counts, then the costs);
2. ``policy.assign(global_costs, W)``: the same partition on every rank, checked (each sample once);
3. one all-to-all of the jagged batch: every tensor field of every sample going to rank d is packed into
   one byte buffer (an all-to-all of the byte counts first), so values and offsets travel together;
4. the parts received are concatenated (``type(batch).cat``) and put in the order ``assign`` gave.

The result equals ``global_batch.select(groups[rank])`` exactly, as if every rank had built the whole batch
(tests/test_conformance_batching.py checks it on 2 gloo ranks).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from gemzoo.errors import PluginError
from gemzoo.interfaces.batching import DataParallelGroup, custom_rebalance


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank ``rank``'s contiguous part of ``n`` samples (``torch.tensor_split``'s rule)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def load_shard(dataset, step: int, rank: int, world_size: int):
    """This rank's contiguous part of the global batch of ``step``."""
    if world_size == 1:
        return dataset.train_batch(step)
    own = getattr(dataset, "train_shard", None)
    if callable(own):
        return own(step, rank, world_size)
    batch = dataset.train_batch(step)
    start, stop = shard_range(batch.num_samples, rank, world_size)
    return batch.select(torch.arange(start, stop, dtype=torch.int64))


def _comm_device(batch) -> torch.device:
    for f in dataclasses.fields(batch) if dataclasses.is_dataclass(batch) else ():
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def gather_costs(costs: torch.Tensor, dp: DataParallelGroup, device=None) -> tuple[torch.Tensor, list[int]]:
    """(float64 costs of the global batch in rank order, the number of samples of each rank)."""
    import torch.distributed as dist

    device = device or torch.device("cpu")
    local = costs.detach().to(device=device, dtype=torch.float64).reshape(-1)
    counts = torch.zeros(dp.size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(counts, torch.tensor([local.numel()], dtype=torch.int64, device=device),
                                group=dp.group)
    counts = counts.tolist()
    width = max(counts)
    padded = torch.zeros(width, dtype=torch.float64, device=device)
    padded[:local.numel()] = local
    every = torch.empty(dp.size * width, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, padded, group=dp.group)
    every = every.view(dp.size, width)
    return torch.cat([every[r, :c] for r, c in enumerate(counts)]).cpu(), counts


def check_costs(costs: torch.Tensor) -> None:
    """A PluginError when a per-sample cost is NaN, infinite or negative (a partition of them means nothing)."""
    bad = (~torch.isfinite(costs) | (costs < 0)).nonzero().flatten()
    if bad.numel():
        raise PluginError(f"the model's cost_model gave costs {costs[bad[:5]].tolist()} for samples "
                          f"{bad[:5].tolist()} of the global batch; per-sample costs must be finite and >= 0")


def check_groups(groups, n: int, world_size: int, name: str) -> list[torch.Tensor]:
    """The partition as int64 tensors; a PluginError naming the policy when it is not one."""
    if not isinstance(groups, (list, tuple)) or len(groups) != world_size:
        raise PluginError(f"batching policy {name!r}: assign returned {type(groups).__name__} of "
                          f"{len(groups) if hasattr(groups, '__len__') else '?'} groups, want a list of {world_size}")
    groups = [torch.as_tensor(g).reshape(-1).cpu() for g in groups]
    bad = [r for r, g in enumerate(groups) if g.is_floating_point() or g.is_complex() or g.dtype == torch.bool]
    if bad:
        raise PluginError(f"batching policy {name!r}: group {bad[0]} has dtype {groups[bad[0]].dtype}, want int64")
    groups = [g.long() for g in groups]
    flat = torch.cat(groups) if groups else torch.zeros(0, dtype=torch.long)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise PluginError(f"batching policy {name!r}: assign gave indices outside [0, {n})")
    counts = torch.bincount(flat, minlength=n)
    if flat.numel() != n or bool((counts != 1).any()):
        missing = (counts == 0).nonzero().flatten()[:5].tolist()
        twice = (counts > 1).nonzero().flatten()[:5].tolist()
        raise PluginError(f"batching policy {name!r}: every sample must go to exactly one rank; samples "
                          f"{missing} are unassigned and {twice} assigned more than once")
    return groups


def _tensor_fields(batch) -> list[str]:
    if not dataclasses.is_dataclass(batch):
        raise PluginError(f"{type(batch).__name__} is not a dataclass: moving samples between ranks needs a batch "
                          "whose tensors are dataclass fields (as gemzoo.data.batch's), or a policy with its own "
                          "rebalance")
    return [f.name for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]


def exchange(batch, send: list[torch.Tensor], dp: DataParallelGroup) -> list:
    """Send this rank's samples ``send[d]`` (local indices, in that order) to rank d; return the parts
    received, one per source rank in rank order. One all-to-all of byte counts, one of the packed bytes."""
    import torch.distributed as dist

    if not callable(getattr(type(batch), "cat", None)):
        raise PluginError(f"{type(batch).__name__} has no cat(parts) classmethod; moving samples between ranks "
                          "needs one (gemzoo.data.batch.GemBatch.cat is an example)")
    names = _tensor_fields(batch)
    device = _comm_device(batch)
    parts = [batch.select(idx) for idx in send]
    # bytes of each field of the part for each destination
    sizes = torch.tensor([[getattr(p, f).numel() * getattr(p, f).element_size() for f in names] for p in parts],
                         dtype=torch.int64).reshape(dp.size, len(names))
    recv_sizes = torch.empty_like(sizes, device=device)
    dist.all_to_all_single(recv_sizes, sizes.to(device), group=dp.group)
    recv_sizes = recv_sizes.cpu()
    payload = [getattr(p, f).contiguous().reshape(-1).view(torch.uint8) for p in parts for f in names]
    out = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
    send_buf = torch.cat(payload).to(device) if payload else torch.zeros(0, dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, send_buf, output_split_sizes=recv_sizes.sum(1).tolist(),
                           input_split_sizes=sizes.sum(1).tolist(), group=dp.group)
    received, chunks = [], out.split(recv_sizes.reshape(-1).tolist())
    for src in range(dp.size):
        fields = {}
        for j, f in enumerate(names):
            like = getattr(batch, f)
            raw = chunks[src * len(names) + j]
            row = math.prod(like.shape[1:])
            n = raw.numel() // like.element_size()
            # clone: a chunk's byte offset need not be aligned for its dtype
            fields[f] = raw.clone().view(like.dtype).reshape(n // row if row else 0, *like.shape[1:])
        received.append(dataclasses.replace(batch, **fields))
    return received


def rebalance(policy, batch, costs: torch.Tensor, dp: DataParallelGroup, *, name: str | None = None):
    """This rank's samples under ``policy``, from this rank's part ``batch`` and its per-sample ``costs``."""
    name = name or type(policy).__name__
    own = custom_rebalance(policy)
    if own is not None:
        return own(batch, costs, dp)
    if dp.size == 1:
        groups = check_groups(policy.assign(costs.detach().double().cpu(), 1), batch.num_samples, 1, name)
        return batch.select(groups[0])
    everything, counts = gather_costs(costs, dp, _comm_device(batch))
    check_costs(everything)
    groups = check_groups(policy.assign(everything, dp.size), everything.numel(), dp.size, name)
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    lo, hi = starts[dp.rank], starts[dp.rank + 1]
    send = [g[(g >= lo) & (g < hi)] - lo for g in groups]  # in the order rank d trains them
    parts = exchange(batch, send, dp)
    merged = type(batch).cat(parts)
    mine = groups[dp.rank]
    owner = torch.bucketize(mine, torch.tensor(starts[1:], dtype=torch.long), right=True)
    arrived = torch.argsort(owner, stable=True)  # merged[k] is mine[arrived[k]]
    return merged.select(torch.argsort(arrived))
