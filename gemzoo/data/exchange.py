"""Per-rank loading and moving samples between data-parallel ranks (the batching slot's machinery).

The global batch of a step is ``dataset.train_batch(step)``; its samples are numbered 0..N-1 and rank r of W
holds the contiguous part ``shard_range(N, r, W)`` of it (``torch.tensor_split``'s rule: the first N % W
ranks get one more). ``load_shard`` gives a rank that part only: through ``dataset.train_shard(step, rank,
world_size)`` when the dataset can build part of a batch, else by building the batch and keeping the part.

``rebalance(policy, batch, costs, dp)`` turns this rank's part into the samples the policy gives it:

1. all-gather the per-sample costs (two small collectives: the counts, then the costs);
2. ``policy.assign(global_costs, W)``: the same partition on every rank, checked (each sample once);
3. this rank's ``Route`` through the partition (``route``: what it sends where, what arrives from whom);
4. one all-to-all of the jagged batch: the samples going to each rank, sample-major (``batch.columns()``:
   per-sample row counts, then each column's rows), packed into one byte buffer (an all-to-all of the byte
   counts first), so values and lengths travel together; what arrives is rebuilt (``from_columns``) and put in
   the order ``assign`` gave. Every step of it is a fixed number of vectorised ops (no loop over ranks): at
   8192 ranks a loop per destination and per source cost seconds of host time a step. A batch type without
   ``columns`` is packed field by field, one ``select`` per rank it sends to and a ``cat`` of what arrives.

The result equals ``global_batch.select(groups[rank])`` exactly, as if every rank had built the whole batch
(tests/test_conformance_batching.py checks it on 2 gloo ranks).

``gemzoo.data.lookahead`` schedules the same steps around training: parts built ahead on a host thread, and
partitions computed ahead of their step in workers.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

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


def comm_device(batch) -> torch.device:
    for f in dataclasses.fields(batch) if dataclasses.is_dataclass(batch) else ():
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def gather_costs(costs: torch.Tensor, dp: DataParallelGroup, device=None) -> tuple[torch.Tensor, list[int]]:
    """(float64 costs of the global batch in rank order, the number of samples of each rank)."""
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
    every = every.view(dp.size, width).cpu()
    real = torch.arange(width) < torch.tensor(counts).unsqueeze(1)  # each rank's samples, in rank order
    return every[real], counts


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


@dataclasses.dataclass
class Route:
    """This rank's part of a checked partition (int64 CPU tensors; W ranks, this rank's ``n`` loaded samples).

    ``send_index`` [n]: this rank's samples grouped by the rank they go to (rank order), each group in the order
    that rank trains them; ``send_counts`` [W]: the group sizes. ``recv_counts`` [W]: how many samples arrive
    from each rank; ``order``: the arrived samples (source-rank order) put in the order ``assign`` gave."""

    send_index: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    order: torch.Tensor

    def arrays(self) -> tuple:
        return tuple(t.numpy() for t in (self.send_index, self.send_counts, self.recv_counts, self.order))

    @classmethod
    def from_arrays(cls, arrays) -> Route:
        return cls(*(torch.from_numpy(a) for a in arrays))


def route(groups: list[torch.Tensor], counts: list[int], rank: int) -> Route:
    """This rank's ``Route`` through the partition ``groups`` of a global batch whose rank r loaded ``counts[r]``
    samples (contiguous, in rank order). O(samples + ranks) vectorised work, whatever the world size."""
    world = len(groups)
    sizes = torch.tensor([g.numel() for g in groups], dtype=torch.int64)
    flat = torch.cat(groups) if groups else torch.zeros(0, dtype=torch.int64)
    starts = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    lo, hi = int(starts[rank]), int(starts[rank + 1])
    local = (flat >= lo) & (flat < hi)
    dest = torch.repeat_interleave(torch.arange(world), sizes)
    mine = groups[rank]
    source = torch.bucketize(mine, starts[1:], right=True)
    arrived = torch.argsort(source, stable=True)  # the k-th sample to arrive is mine[arrived[k]]
    return Route(flat[local] - lo, torch.bincount(dest[local], minlength=world),
                 torch.bincount(source, minlength=world), torch.argsort(arrived))


def _transpose_chunks(buf: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``buf`` holds chunks of ``sizes[a, b]`` bytes in row-major order (a, then b): the same chunks in
    column-major order (b, then a). Only the non-empty chunks are touched (at most one per sample and column,
    however many ranks there are), by one split and one cat."""
    flat = sizes.reshape(-1)
    full = flat.nonzero().flatten()
    if full.numel() == 0:
        return buf[:0]
    rows, cols = full // sizes.shape[1], full % sizes.shape[1]
    pieces = buf.split(flat[full].tolist())
    return torch.cat([pieces[i] for i in torch.argsort(cols * sizes.shape[0] + rows).tolist()])


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def exchange(batch, rt: Route, dp: DataParallelGroup):
    """Send this rank's samples ``rt.send_index`` (grouped by destination, ``rt.send_counts``) to their ranks;
    return the samples that arrive, one source rank after another. One all-to-all of byte counts, one of the
    packed bytes; the host work is a fixed number of vectorised ops, however many ranks there are."""
    if not callable(getattr(type(batch), "cat", None)):
        raise PluginError(f"{type(batch).__name__} has no cat(parts) classmethod; moving samples between ranks "
                          "needs one (gemzoo.data.batch.GemBatch.cat is an example)")
    if not (callable(getattr(batch, "columns", None)) and callable(getattr(type(batch), "from_columns", None))):
        return _exchange_fields(batch, rt, dp)
    device = comm_device(batch)
    rows, cols = batch.select(rt.send_index).columns()  # samples in destination order, sample-major
    rows = rows.to(torch.int64).cpu()
    k = rows.shape[1]
    unit = torch.tensor([c.element_size() * math.prod(c.shape[1:]) for c in cols], dtype=torch.int64)
    ends = rt.send_counts.cumsum(0)
    csum = torch.cat([torch.zeros(1, k, dtype=torch.int64), rows.cumsum(0)])
    per_dest = csum[ends] - csum[ends - rt.send_counts]  # [W, k] rows of each column for each destination
    sizes = torch.cat([(rt.send_counts * 8 * k).unsqueeze(1), per_dest * unit], 1)  # bytes [W, 1 + k]
    recv_sizes = torch.empty_like(sizes, device=device)
    dist.all_to_all_single(recv_sizes, sizes.to(device), group=dp.group)
    recv_sizes = recv_sizes.cpu()
    column_major = torch.cat([_flat_bytes(rows.to(device)), *(_flat_bytes(c) for c in cols)])
    out = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, _transpose_chunks(column_major, sizes.t()),
                           output_split_sizes=recv_sizes.sum(1).tolist(),
                           input_split_sizes=sizes.sum(1).tolist(), group=dp.group)
    pieces = _transpose_chunks(out, recv_sizes).split(recv_sizes.sum(0).tolist())  # one per column
    # clone: a piece's byte offset need not be aligned for its dtype
    got_rows = pieces[0].clone().view(torch.int64).reshape(-1, k)
    got = [p.clone().view(c.dtype).reshape(-1, *c.shape[1:]) for p, c in zip(pieces[1:], cols, strict=True)]
    return type(batch).from_columns(batch, got_rows, got)


def _exchange_fields(batch, rt: Route, dp: DataParallelGroup):
    """``exchange`` for a batch type without ``columns``/``from_columns``: each tensor field of each part
    packed (a select per destination and a cat of the parts, for the ranks that send or receive samples)."""
    names = _tensor_fields(batch)
    device = comm_device(batch)
    sends = rt.send_index.split(rt.send_counts.tolist())
    to = rt.send_counts.nonzero().flatten().tolist()
    parts = [batch.select(sends[d]) for d in to]
    sizes = torch.zeros(dp.size, len(names), dtype=torch.int64)
    if to:
        sizes[to] = torch.tensor([[getattr(p, f).numel() * getattr(p, f).element_size() for f in names]
                                  for p in parts], dtype=torch.int64)
    recv_sizes = torch.empty_like(sizes, device=device)
    dist.all_to_all_single(recv_sizes, sizes.to(device), group=dp.group)
    recv_sizes = recv_sizes.cpu()
    payload = [_flat_bytes(getattr(p, f)) for p in parts for f in names]
    out = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
    send_buf = torch.cat(payload).to(device) if payload else torch.zeros(0, dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, send_buf, output_split_sizes=recv_sizes.sum(1).tolist(),
                           input_split_sizes=sizes.sum(1).tolist(), group=dp.group)
    received, chunks = [], out.split(recv_sizes.reshape(-1).tolist())
    for src in rt.recv_counts.nonzero().flatten().tolist():
        fields = {}
        for j, f in enumerate(names):
            like = getattr(batch, f)
            raw = chunks[src * len(names) + j]
            row = math.prod(like.shape[1:])
            n = raw.numel() // like.element_size()
            fields[f] = raw.clone().view(like.dtype).reshape(n // row if row else 0, *like.shape[1:])
        received.append(dataclasses.replace(batch, **fields))
    return type(batch).cat(received) if received else batch.select(torch.zeros(0, dtype=torch.int64))


def partition_checked(policy, costs: torch.Tensor, world_size: int, name: str) -> tuple[list[torch.Tensor], float]:
    """(``policy.assign(costs, world_size)`` checked, its seconds): step 2 of ``rebalance``, no collectives.
    Bad costs raise here, so ahead of time they raise at the step that uses them, as in the synchronous path."""
    t0 = time.perf_counter()
    check_costs(costs)
    groups = check_groups(policy.assign(costs, world_size), costs.numel(), world_size, name)
    return groups, time.perf_counter() - t0


def route_checked(policy, costs: torch.Tensor, counts: list[int], rank: int, name: str) -> tuple[Route, float]:
    """This rank's ``route`` through ``partition_checked``, and the seconds of both (what a ``PartitionWorker``
    runs: it hands back a few KB for this rank, not the whole partition)."""
    t0 = time.perf_counter()
    groups, _ = partition_checked(policy, costs, len(counts), name)
    return route(groups, counts, rank), time.perf_counter() - t0


def deliver(batch, rt: Route, dp: DataParallelGroup):
    """Steps 3-4 of ``rebalance`` once the route is known: this rank's samples, in the order ``assign`` gave."""
    return exchange(batch, rt, dp).select(rt.order)


def rebalance(policy, batch, costs: torch.Tensor, dp: DataParallelGroup, *, name: str | None = None):
    """This rank's samples under ``policy``, from this rank's part ``batch`` and its per-sample ``costs``."""
    name = name or type(policy).__name__
    own = custom_rebalance(policy)
    if own is not None:
        return own(batch, costs, dp)
    if dp.size == 1:
        groups = check_groups(policy.assign(costs.detach().double().cpu(), 1), batch.num_samples, 1, name)
        return batch.select(groups[0])
    everything, counts = gather_costs(costs, dp, comm_device(batch))
    rt, _ = route_checked(policy, everything, counts, dp.rank, name)
    return deliver(batch, rt, dp)
