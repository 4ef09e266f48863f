"""The executor of a :class:`~gemzoo_sharding_2d.layout.Layout`: pooled lookups of tables sharded within a group
of G ranks, an all-to-all inside the group, and the replica traffic of the two strategies.

One step on rank (replica r, group rank g):

1. ``fully_sharded`` only: all-gather over the replica group the R pieces of this rank's group shard (each
   replica stores 1/R of the rows of every block), into one leaf tensor that collects the gradient.
2. Input all-to-all inside the group (int64): for every (feature, block) pair the per-sample count of this
   rank's ids that fall in the block, and those ids as block-local rows; a header all-to-all first gives each
   owner the sender's batch size and id count.
3. Each owner pools (sum) its rows per sample and per pair, and a float all-to-all sends the pooled
   [B_sender, cols] pieces back (torchrec's pooled output dist: row-wise pieces are partial sums, summed by the
   requester; column blocks are concatenated). ``mean`` pooling divides by the sample's id count afterwards.
4. Backward: the pooled gradients go back to the owners by the reverse all-to-all; autograd's index backward
   adds them into the rows.
5. ``Planner.sync`` (after the trainer's optimizer step) finishes the update: ``replicated`` all-reduces the
   group shard's gradient over the replica group (``replica_sync = "gradients"``, exact) or averages weights
   and Adagrad state every ``sync_every`` steps (``"weights"``, torchrec DMPCollection.sync); ``fully_sharded``
   reduce-scatters the gathered gradient so each replica updates its own 1/R piece. Adagrad is torch's
   element-wise Adagrad, op for op, so a run matches the one-process run that trains whole tables.

Every collective adds the bytes this rank hands to it to :data:`CommCounter` categories (an all-to-all's own
chunk included), which the tests compare with ``gemzoo plan``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gemzoo.api import CheckpointError, JaggedShapeError
from gemzoo_sharding_2d.layout import Block, Layout

EPS = 1e-10  # torch.optim.Adagrad's default eps


class CommCounter:
    """Bytes this rank handed to each kind of collective, cumulative."""

    CATEGORIES = ("a2a_ids", "a2a_pooled_fwd", "a2a_pooled_bwd", "replica_sync", "replica_all_gather",
                  "replica_reduce_scatter")

    def __init__(self):
        self.bytes = defaultdict(int)
        self.offrank = defaultdict(int)  # all-to-all bytes that leave the rank (its own chunk excluded)
        self.calls = defaultdict(int)

    def add(self, category: str, nbytes: int, offrank: int | None = None) -> None:
        self.bytes[category] += int(nbytes)
        self.offrank[category] += int(nbytes if offrank is None else offrank)
        self.calls[category] += 1

    def snapshot(self) -> dict:
        return {"bytes": dict(self.bytes), "offrank": dict(self.offrank), "calls": dict(self.calls)}


class Groups:
    """This rank's place in the (replica, shard) mesh and the two process groups (None where a dim is 1)."""

    def __init__(self, mesh=None, group_size: int = 1, replicas: int = 1):
        self.G, self.R = group_size, replicas
        self.g = self.r = 0
        self.shard = self.replica = None
        self.world = 1
        if mesh is not None:
            self.g, self.r = mesh.get_local_rank("shard"), mesh.get_local_rank("replica")
            self.shard = mesh.get_group("shard") if group_size > 1 else None
            self.replica = mesh.get_group("replica") if replicas > 1 else None
            self.world = group_size * replicas

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.g == 0 and self.r == 0


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse all-to-all; counts bytes."""

    @staticmethod
    def forward(ctx, x, send, recv, group, counter, me, fwd, bwd):
        ctx.args = (send, recv, group, counter, me, bwd)
        return _a2a(x, send, recv, group, counter, me, fwd)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, counter, me, bwd = ctx.args
        return _a2a(grad.contiguous(), recv, send, group, counter, me, bwd), None, None, None, None, None, None, None


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group, counter: CommCounter, me: int, category: str):
    out = x.new_empty(sum(recv))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    size = x.element_size()
    counter.add(category, x.numel() * size, (x.numel() - send[me]) * size)
    return out


class TableView:
    """A sharded table (or its Adagrad state) as ``gemzoo.distributed.state`` sees ShardedTensors: the whole
    size, this rank's pieces (``local_shards()``: views into the flat storage, with their offsets) and a
    collective ``gather(dst=0, out=...)``. So the trainer's checkpoints hold whole tables whatever the layout,
    and load them back into any layout with ``copy_into_shards``."""

    class _Meta:
        def __init__(self, offsets, sizes):
            self.shard_offsets, self.shard_sizes = list(offsets), list(sizes)

    class _Shard:
        def __init__(self, tensor, offsets):
            self.tensor = tensor
            self.metadata = TableView._Meta(offsets, tensor.shape)

    def __init__(self, shape, dtype, pieces, owner: ShardedTables):
        self.shape, self.dtype = torch.Size(shape), dtype
        self._shards = [TableView._Shard(t, off) for t, off in pieces]
        self._owner = owner

    def size(self) -> torch.Size:
        return self.shape

    def local_shards(self):
        return list(self._shards)

    def gather(self, dst: int = 0, out: torch.Tensor | None = None) -> None:
        whole = self._owner.gather_whole({"t": self})
        if out is not None and "t" in whole:
            out.copy_(whole["t"])


class ShardedTables(nn.Module):
    """Stands in for ``sparse_arch.ebc``: ``forward(keys, values, lengths) -> [B, sum(dim)]`` like gemzoo's
    plain-torch collection, with the state-dict names ``embedding_bags.<table>.weight`` of both engines (sharded
    tables as :class:`TableView`, data-parallel ones as ordinary parameters)."""

    def __init__(self, layout: Layout, weights: dict[str, torch.Tensor], groups: Groups, features: list[str]):
        super().__init__()
        self.layout, self.groups = layout, groups
        self.counter = CommCounter()
        self.features = list(features)
        self.table_of = {f: t for t, s in layout.tables.items() for f in s.feature_names}
        self.factor = groups.R if layout.strategy == "fully_sharded" else 1  # pieces each block is stored in
        self.blocks = layout.local_blocks(groups.g)
        # flat storage: per local block, chunk rows (ceil(rows / factor)) x cols, this replica's chunk
        self.seg, off = [], 0
        for b in self.blocks:
            chunk = math.ceil(b.rows / self.factor) if b.rows else 0
            self.seg.append((off, chunk))
            off += chunk * b.cols
        device = next(iter(weights.values())).device if weights else torch.device("cpu")
        self.flat = nn.Parameter(torch.zeros(off, dtype=torch.float32, device=device))
        self.state_sum = torch.zeros(off, dtype=torch.float32, device=device)  # Adagrad accumulators (not a buffer:
        # the state-dict names stay the engines'); the planner's state_dict gives them as whole tables
        with torch.no_grad():
            for b, (view, rows) in zip(self.blocks, self._pieces(self.flat.data), strict=True):
                view.copy_(weights[b.table][rows, b.col_off:b.col_off + b.cols])
        self.embedding_bags = nn.ModuleDict()
        for name in layout.data_parallel():
            holder = nn.Module()
            holder.weight = nn.Parameter(weights[name].detach().clone())
            self.embedding_bags[name] = holder
        # pairs routed to each group rank, in one order every rank knows: (feature index, block)
        self.pairs = {d: [] for d in range(groups.G)}
        for i, f in enumerate(self.features):
            for b in layout.blocks[self.table_of[f]]:
                self.pairs[b.rank].append((i, b))
        self.local_index = {id(b): k for k, b in enumerate(self.blocks)}
        self._gathered = None
        self._steps = 0
        self.register_state_dict_post_hook(ShardedTables._add_views)

    # ---- storage ---------------------------------------------------------------------------------------------
    def _pieces(self, flat: torch.Tensor):
        """(view, slice of the block's table rows) of this rank's stored piece of every local block."""
        out = []
        for b, (o, chunk) in zip(self.blocks, self.seg, strict=True):
            start = b.row_off + self.groups.r * chunk if self.factor > 1 else b.row_off
            n = max(0, min(b.row_off + b.rows - start, chunk))
            view = flat[o:o + chunk * b.cols].view(chunk, b.cols)[:n]
            out.append((view, slice(start, start + n)))
        return out

    def views(self, flat: torch.Tensor) -> dict[str, TableView]:
        """{table: TableView} of ``flat`` (the weights or the Adagrad state) for the sharded tables."""
        by_table = defaultdict(list)
        for b, (view, rows) in zip(self.blocks, self._pieces(flat), strict=True):
            by_table[b.table].append((view, (rows.start, b.col_off)))
        return {t: TableView((s.num_embeddings, s.embedding_dim), flat.dtype, by_table.get(t, []), self)
                for t, s in self.layout.tables.items() if self.layout.blocks[t]}

    @staticmethod
    def _add_views(module, state, prefix, local_metadata):
        state.pop(prefix + "flat", None)
        for t, view in module.views(module.flat.data).items():
            state[f"{prefix}embedding_bags.{t}.weight"] = view

    def primary(self) -> bool:
        """This rank's pieces go into a checkpoint: every rank's when fully sharded, replica 0's otherwise."""
        return self.factor > 1 or self.groups.r == 0

    def gather_whole(self, views: dict[str, TableView]) -> dict[str, torch.Tensor]:
        """Whole tensors of ``views`` on the main rank ({} elsewhere); every rank calls it (one gather_object)."""
        pieces = []
        if self.primary():
            for name, v in views.items():
                pieces += [(name, tuple(v.shape), tuple(s.metadata.shard_offsets), s.tensor.detach().cpu())
                           for s in v.local_shards()]
        if self.groups.distributed:
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(pieces, gathered, dst=0)
            if dist.get_rank() != 0:
                return {}
            pieces = [p for rank_pieces in gathered for p in rank_pieces]
        whole = {}
        for name, shape, (r0, c0), t in pieces:
            w = whole.setdefault(name, torch.zeros(shape, dtype=t.dtype))
            w[r0:r0 + t.shape[0], c0:c0 + t.shape[1]] = t
        return whole

    @torch.no_grad()
    def load_pieces(self, flat: torch.Tensor, whole: dict[str, torch.Tensor], what: str) -> list[str]:
        """Copy whole tensors into this rank's pieces of ``flat``; the names ``whole`` lacks."""
        missing = []
        for name, view in self.views(flat).items():
            if name not in whole:
                missing.append(name)
                continue
            if tuple(whole[name].shape) != tuple(view.shape):
                raise CheckpointError(f"{what} of table {name!r} is {list(whole[name].shape)} in the checkpoint but "
                                      f"{list(view.shape)} in this model; resume with the [data] / [model] config "
                                      "the checkpoint was written with")
            for s in view.local_shards():
                r0, c0 = s.metadata.shard_offsets
                s.tensor.copy_(whole[name][r0:r0 + s.tensor.shape[0], c0:c0 + s.tensor.shape[1]])
        return missing

    def memory(self) -> dict:
        """Bytes of table storage on this rank: sharded weights, their Adagrad state, data-parallel tables, and
        the whole tables' size for comparison."""
        dp = sum(m.weight.numel() * m.weight.element_size() for m in self.embedding_bags.values())
        return {"weights": self.flat.numel() * 4, "state": self.state_sum.numel() * 4, "data_parallel": dp,
                "whole": sum(s.numel * 4 for s in self.layout.tables.values())}

    # ---- forward ---------------------------------------------------------------------------------------------
    def _materialise(self) -> torch.Tensor:
        """The flat storage of the whole group shard: ``flat`` itself, or (fully_sharded) the R pieces
        all-gathered over the replica group into a leaf that collects the step's gradient."""
        if self.factor == 1:
            return self.flat
        out = self.flat.new_empty(self.flat.numel() * self.factor)
        dist.all_gather_into_tensor(out, self.flat.detach().contiguous(), group=self.groups.replica)
        self.counter.add("replica_all_gather", self.flat.numel() * 4)
        if torch.is_grad_enabled() and self.training:
            out.requires_grad_(True)
            self._gathered = out
        return out

    def _block_weight(self, full: torch.Tensor, b: Block) -> torch.Tensor:
        """[factor, chunk, cols] view of block ``b`` in the materialised flat storage."""
        o, chunk = self.seg[self.local_index[id(b)]]
        return full.view(self.factor, -1)[:, o:o + chunk * b.cols].view(self.factor, chunk, b.cols)

    # Never traced: collectives with data-dependent splits and host-side routing (graph breaks anyway).
    @torch.compiler.disable
    def forward(self, keys, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        keys = list(keys)
        nf = len(keys)
        B = lengths.numel() // max(nf, 1)
        per_key = lengths.view(nf, B)
        starts = [0] + torch.cumsum(per_key.sum(1), 0).tolist()
        sample = torch.arange(B, device=values.device)
        ids_of, sid_of = [], []
        for i, key in enumerate(keys):
            ids = values[starts[i]:starts[i + 1]]
            spec = self.layout.tables[self.table_of[key]]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_embeddings):
                raise JaggedShapeError(f"feature {key!r} has ids outside [0, {spec.num_embeddings}) for table "
                                       f"{spec.name!r}")
            ids_of.append(ids)
            sid_of.append(torch.repeat_interleave(sample, per_key[i]))
        pooled = self._sharded_lookup(self._materialise(), ids_of, sid_of, B) if any(self.pairs.values()) else {}
        outs = []
        for i, key in enumerate(keys):
            t = self.table_of[key]
            spec = self.layout.tables[t]
            if not self.layout.blocks[t]:  # data-parallel: whole on every rank
                offsets = torch.zeros(B + 1, dtype=torch.int64, device=values.device)
                torch.cumsum(per_key[i], 0, out=offsets[1:])
                outs.append(F.embedding_bag(ids_of[i], self.embedding_bags[t].weight, offsets, mode=spec.pooling,
                                            include_last_offset=True))
                continue
            cols = pooled[i]
            out = torch.cat([sum(cols[c]) for c in sorted(cols)], dim=1)
            if spec.pooling == "mean":
                out = out / per_key[i].clamp(min=1).to(out.dtype).unsqueeze(1)
            outs.append(out)
        return torch.cat(outs, dim=1)

    def _sharded_lookup(self, full, ids_of, sid_of, B):
        G, me = self.groups.G, self.groups.g
        dev = full.device
        # what this rank sends each group rank: per pair the per-sample counts, then the block-local ids
        counts, ids = [[] for _ in range(G)], [[] for _ in range(G)]
        for d in range(G):
            for i, b in self.pairs[d]:
                v, s = ids_of[i], sid_of[i]
                if b.rows != self.layout.tables[b.table].num_embeddings:
                    keep = (v >= b.row_off) & (v < b.row_off + b.rows)
                    v, s = v[keep], s[keep]
                counts[d].append(torch.bincount(s, minlength=B))
                ids[d].append(v - b.row_off)
        send_int = [torch.cat(counts[d] + ids[d]) if counts[d] else torch.zeros(0, dtype=torch.int64, device=dev)
                    for d in range(G)]
        n_ids = [sum(x.numel() for x in ids[d]) for d in range(G)]
        if G > 1:
            header = torch.tensor([[B, n] for n in n_ids], dtype=torch.int64, device=dev).view(-1)
            got = _a2a(header, [2] * G, [2] * G, self.groups.shard, self.counter, me, "a2a_ids").view(G, 2).tolist()
            mine = len(self.pairs[me])
            recv = [mine * bs + n for bs, n in got]
            flat_in = _a2a(torch.cat(send_int), [x.numel() for x in send_int], recv, self.groups.shard,
                           self.counter, me, "a2a_ids")
            incoming = list(zip([bs for bs, _ in got], torch.split(flat_in, recv), strict=False))
        else:
            incoming = [(B, send_int[0])]
        # owner side: pool this rank's rows for every source and pair
        send_f, send_sizes = [], []
        for bs, buf in incoming:
            npair = len(self.pairs[me])
            cnt, rest = buf[:npair * bs].view(npair, bs), buf[npair * bs:]
            pos = 0
            parts = []
            for k, (_, b) in enumerate(self.pairs[me]):
                n = int(cnt[k].sum())
                local = rest[pos:pos + n]
                pos += n
                o, chunk = self.seg[self.local_index[id(b)]]
                w = self._block_weight(full, b)
                rows = w[torch.div(local, max(chunk, 1), rounding_mode="floor"), local % max(chunk, 1)]
                sid = torch.repeat_interleave(torch.arange(bs, device=dev), cnt[k])
                parts.append(torch.zeros(bs, b.cols, dtype=full.dtype, device=dev).index_add(0, sid, rows).view(-1))
            send_f.append(torch.cat(parts) if parts else full.new_zeros(0))
            send_sizes.append(send_f[-1].numel())
        if G > 1:
            recv_sizes = [sum(B * b.cols for _, b in self.pairs[d]) for d in range(G)]
            back = _AllToAll.apply(torch.cat(send_f), send_sizes, recv_sizes, self.groups.shard, self.counter, me,
                                   "a2a_pooled_fwd", "a2a_pooled_bwd")
            from_owner = torch.split(back, recv_sizes)
        else:
            from_owner = send_f
        pooled = defaultdict(lambda: defaultdict(list))  # feature -> col_off -> [B, cols] pieces
        for d in range(G):
            pos = 0
            for i, b in self.pairs[d]:
                n = B * b.cols
                pooled[i][b.col_off].append(from_owner[d][pos:pos + n].view(B, b.cols))
                pos += n
        return pooled

    # ---- update (Planner.sync) -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, step: int, lr: float, replica_sync: str, sync_every: int) -> None:
        """Adagrad on this rank's stored piece, after the replica traffic of the strategy."""
        gr, world = self.groups, self.groups.world
        if self.factor > 1:
            full_grad = self._gathered.grad if self._gathered is not None and self._gathered.grad is not None \
                else torch.zeros(self.flat.numel() * self.factor, device=self.flat.device)
            grad = torch.empty_like(self.flat)
            dist.reduce_scatter_tensor(grad, full_grad.contiguous(), group=gr.replica)
            self.counter.add("replica_reduce_scatter", full_grad.numel() * 4)
            grad /= world
            self._gathered = None
        else:
            grad = self.flat.grad if self.flat.grad is not None else torch.zeros_like(self.flat)
            if grad.is_sparse:
                grad = grad.to_dense()
            if replica_sync == "gradients":
                if gr.replica is not None:
                    dist.all_reduce(grad, group=gr.replica)
                    self.counter.add("replica_sync", grad.numel() * 4)
                grad /= world
            else:
                grad /= gr.G  # each group's own mean gradient, as torchrec's gradient division gives
        self.state_sum.addcmul_(grad, grad, value=1)
        std = self.state_sum.sqrt().add_(EPS)
        self.flat.data.addcdiv_(grad, std, value=-lr)
        self.flat.grad = None
        self._steps += 1
        if self.factor == 1 and replica_sync == "weights" and gr.replica is not None and (step + 1) % sync_every == 0:
            for t in (self.flat.data, self.state_sum):
                dist.all_reduce(t, group=gr.replica)
                t /= gr.R
                self.counter.add("replica_sync", t.numel() * 4)
