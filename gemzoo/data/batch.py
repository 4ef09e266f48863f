"""Batch types. Every tensor field moves with ``.to(device)``; jagged fields are values + int64 offsets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gemzoo.jagged import lengths_to_offsets


def gather_jagged(offsets: torch.Tensor, index: torch.Tensor, *values: torch.Tensor):
    """Sequences ``index`` (in that order) of jagged ``values`` sharing ``offsets``: (new_offsets, *new_values)."""
    index = torch.as_tensor(index, dtype=torch.int64, device=offsets.device)
    lengths = (offsets[1:] - offsets[:-1])[index]
    new_offsets = lengths_to_offsets(lengths)
    total = int(new_offsets[-1])
    owner = torch.repeat_interleave(torch.arange(index.numel(), device=offsets.device), lengths, output_size=total)
    rows = offsets[index][owner] + torch.arange(total, device=offsets.device) - new_offsets[owner]
    return (new_offsets, *(v[rows] for v in values))


class _Movable:
    """Moving and pinning for the batch dataclasses: every tensor field moves with ``to``.

    ``moved_from`` is the host batch this one was copied from, set by ``to`` when every tensor goes from the
    host to a device (None otherwise). It is a plain attribute, not a dataclass field: ``dataclasses.replace``,
    ``select`` and every other way of making a new batch leave it unset, so only the direct copy of a host
    batch ever claims one, and :meth:`host_view` still checks that the shapes agree before trusting it."""

    moved_from: _Movable | None = None

    def to(self, device, non_blocking: bool = False):
        """The batch on ``device``. Moved off the host, it records the host batch it came from
        (``moved_from``, read through :meth:`host_view`)."""
        tensors = [getattr(self, f.name) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)]
        changes = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        moved = dataclasses.replace(self, **changes)
        if torch.device(device).type != "cpu" and tensors and all(t.device.type == "cpu" for t in tensors):
            moved.moved_from = self
        return moved

    def host_view(self):
        """This batch with its tensors on the host: the one it was moved from (no copy, no wait), else itself
        (also when a field was replaced since: the shapes must still agree)."""
        host = self.moved_from
        if host is None:
            return self
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(host, f.name)
            if isinstance(mine, torch.Tensor) != isinstance(theirs, torch.Tensor) or (
                    isinstance(mine, torch.Tensor) and mine.shape != theirs.shape):
                return self
        return host

    def pin_memory(self):
        changes = {f.name: getattr(self, f.name).pin_memory() for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **changes)


def to_device(batch, device):
    """``batch.to(device)``; to a GPU from pinned host memory and without blocking, so the copy queues behind
    the work already on the device instead of waiting for it (a pageable copy would)."""
    device = torch.device(device)
    if device.type == "cuda" and callable(getattr(batch, "pin_memory", None)):
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


@dataclass
class GemBatch(_Movable):
    """One batch of B users for ranking.

    history_items [T] / history_offsets [B+1]: each user's item-id history, oldest first (may be empty).
    cand_items [C] / cand_offsets [B+1]: each user's candidates (1..K); click, conversion [C] in {0, 1}.
    sparse_keys / sparse_values [N] / sparse_lengths [F*B]: pooled sparse features, KeyedJaggedTensor
    layout (key-major).
    """

    history_items: torch.Tensor
    history_offsets: torch.Tensor
    cand_items: torch.Tensor
    cand_offsets: torch.Tensor
    click: torch.Tensor
    conversion: torch.Tensor
    sparse_keys: tuple[str, ...]
    sparse_values: torch.Tensor
    sparse_lengths: torch.Tensor

    @property
    def num_samples(self) -> int:
        return self.history_offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        """Real history events (the sequence tower's tokens)."""
        return self.history_items.numel()

    @property
    def num_candidates(self) -> int:
        return self.cand_items.numel()

    @property
    def lengths(self) -> torch.Tensor:
        return self.history_offsets[1:] - self.history_offsets[:-1]

    @property
    def cand_lengths(self) -> torch.Tensor:
        return self.cand_offsets[1:] - self.cand_offsets[:-1]

    def select(self, index) -> GemBatch:
        """The samples ``index`` (a list or int64 tensor of sample positions), in that order."""
        index = torch.as_tensor(index, dtype=torch.int64)
        hist_off, hist = gather_jagged(self.history_offsets, index, self.history_items)
        cand_off, cand, click, conv = gather_jagged(self.cand_offsets, index, self.cand_items, self.click,
                                                    self.conversion)
        n_keys, batch = len(self.sparse_keys), self.num_samples
        bags = (torch.arange(n_keys).unsqueeze(1) * batch + index.unsqueeze(0)).reshape(-1)  # key-major
        sp_off, sp_vals = gather_jagged(lengths_to_offsets(self.sparse_lengths), bags, self.sparse_values)
        return GemBatch(hist, hist_off, cand, cand_off, click, conv, self.sparse_keys, sp_vals,
                        (sp_off[1:] - sp_off[:-1]).to(self.sparse_lengths.dtype))

    def columns(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The batch sample-major, for moving samples between ranks (``gemzoo.data.exchange``): (rows [B, 6]
        int64, columns); column j holds every sample's ``rows[:, j]`` rows, one sample after another:
        history items; candidates, clicks, conversions; each sample's F bag lengths, then its F bags' values
        (the key-major sparse layout turned sample-major). ``from_columns`` is the inverse."""
        n, n_keys = self.num_samples, len(self.sparse_keys)
        dev = self.sparse_lengths.device
        lens = self.sparse_lengths.reshape(n_keys, n).t()  # [B, F]
        bags = (torch.arange(n, device=dev).unsqueeze(1) + n * torch.arange(n_keys, device=dev)).reshape(-1)
        _, values = gather_jagged(lengths_to_offsets(self.sparse_lengths), bags, self.sparse_values)
        cand = self.cand_lengths
        rows = torch.stack([self.lengths, cand, cand, cand, torch.full_like(cand, n_keys), lens.sum(1).long()], 1)
        return rows, [self.history_items, self.cand_items, self.click, self.conversion, lens.reshape(-1), values]

    @classmethod
    def from_columns(cls, like: GemBatch, rows: torch.Tensor, columns: list[torch.Tensor]) -> GemBatch:
        """The batch whose ``columns()`` are (``rows``, ``columns``); ``like`` gives what is not per sample."""
        hist, cand, click, conv, lens, values = columns
        n, n_keys = rows.shape[0], len(like.sparse_keys)
        dev = lens.device
        bags = (torch.arange(n_keys, device=dev).unsqueeze(1) + n_keys * torch.arange(n, device=dev)).reshape(-1)
        _, key_major = gather_jagged(lengths_to_offsets(lens), bags, values)
        return cls(hist, lengths_to_offsets(rows[:, 0]), cand, lengths_to_offsets(rows[:, 1]), click, conv,
                   like.sparse_keys, key_major, lens.reshape(n, n_keys).t().reshape(-1))

    @classmethod
    def cat(cls, parts: list[GemBatch]) -> GemBatch:
        """The samples of ``parts``, one batch after another (what ``select`` of their union gives)."""
        if not parts:
            raise ValueError("GemBatch.cat needs at least one batch")
        keys = parts[0].sparse_keys
        odd = [i for i, p in enumerate(parts) if p.sparse_keys != keys]
        if odd:
            raise ValueError(f"GemBatch.cat: batch {odd[0]} has sparse keys {parts[odd[0]].sparse_keys}, "
                             f"batch 0 has {keys}")
        n_keys = len(keys)
        lens = [p.sparse_lengths.reshape(n_keys, p.num_samples) for p in parts]  # key-major
        per_key = [p.sparse_values.split(ln.sum(1).tolist()) for p, ln in zip(parts, lens, strict=True)]
        values = [chunks[k] for k in range(n_keys) for chunks in per_key]
        return GemBatch(
            history_items=torch.cat([p.history_items for p in parts]),
            history_offsets=lengths_to_offsets(torch.cat([p.lengths for p in parts])),
            cand_items=torch.cat([p.cand_items for p in parts]),
            cand_offsets=lengths_to_offsets(torch.cat([p.cand_lengths for p in parts])),
            click=torch.cat([p.click for p in parts]), conversion=torch.cat([p.conversion for p in parts]),
            sparse_keys=keys, sparse_values=torch.cat(values) if values else parts[0].sparse_values[:0],
            sparse_lengths=torch.cat(lens, dim=1).reshape(-1))


@dataclass
class SeqBatch(_Movable):
    """One batch of B user sequences for next-item retrieval.

    items [T] / offsets [B+1]: input items, oldest first. targets [T]: the item that follows each input
    position, or -1 where there is nothing to predict (evaluation batches set only the last position).
    times [T] (optional): each input item's timestamp; next_times [T] (optional): the timestamp of the event
    that follows each position (the target's, or the held-out item's at the last evaluated position).
    """

    items: torch.Tensor
    offsets: torch.Tensor
    targets: torch.Tensor
    times: torch.Tensor | None = None
    next_times: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.items.numel()

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def select(self, index) -> SeqBatch:
        """The samples ``index`` (a list or int64 tensor of sample positions), in that order."""
        timed = self.times is not None and self.next_times is not None
        extra = (self.times, self.next_times) if timed else ()
        offsets, items, targets, *times = gather_jagged(self.offsets, torch.as_tensor(index, dtype=torch.int64),
                                                        self.items, self.targets, *extra)
        return SeqBatch(items, offsets, targets, *times)

    def columns(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Sample-major, for moving samples between ranks: (rows [B, k] int64, columns), each column every
        sample's rows one after another: items, targets (and times, next times). ``from_columns`` inverts it."""
        timed = self.times is not None and self.next_times is not None
        cols = [self.items, self.targets, *((self.times, self.next_times) if timed else ())]
        return self.lengths.unsqueeze(1).expand(-1, len(cols)).contiguous(), cols

    @classmethod
    def from_columns(cls, like: SeqBatch, rows: torch.Tensor, columns: list[torch.Tensor]) -> SeqBatch:
        items, targets, *times = columns
        return cls(items, lengths_to_offsets(rows[:, 0]), targets, *times)

    @classmethod
    def cat(cls, parts: list[SeqBatch]) -> SeqBatch:
        """The samples of ``parts``, one batch after another (what ``select`` of their union gives)."""
        if not parts:
            raise ValueError("SeqBatch.cat needs at least one batch")
        timed = {p.times is not None and p.next_times is not None for p in parts}
        if len(timed) > 1:
            raise ValueError("SeqBatch.cat: some batches have times and some do not")
        extra = (torch.cat([p.times for p in parts]), torch.cat([p.next_times for p in parts])) if timed.pop() else ()
        return SeqBatch(torch.cat([p.items for p in parts]), lengths_to_offsets(torch.cat([p.lengths for p in parts])),
                        torch.cat([p.targets for p in parts]), *extra)
