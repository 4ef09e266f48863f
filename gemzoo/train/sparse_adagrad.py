"""Adagrad for the plain-torch tables' sparse gradients, without a host sync.

torch's Adagrad coalesces each sparse gradient first (sums the rows looked up more than once). On CUDA that
is a host sync per table: the number of distinct rows is read back to size the result. gem-bench's 16 tables
so drained the device queue 16 times at the end of every step, and the optimizer's host work (about 10 ms on
the H200, the compiled gem-bench step profile) ran with the GPU idle.

Here the duplicate rows are summed into slots of a fixed size, one per looked-up id (sort, segment ids by
cumsum, ``index_add_``); the slots past the last distinct row hold zeros and add nothing. No op's output
size depends on the data, so the update runs on the device behind the backward (``sync_free_update`` even
runs on the meta device, which the tests use as the proof). Every table of a step goes through one batch of
ops (``sync_free_update_many``: one sort of all their lookups, one segment sum), so the step's launches do not
grow 14 to a table.

The arithmetic is torch's (state += g², param -= clr · g / (sqrt(state) + eps)), with its state names, so
checkpoints move between this class and ``torch.optim.Adagrad``. The duplicate rows' sum may round
differently (another order of addition), so on the CPU, where runs are bit-exact, the default is torch's own
step; ``sync_free=True`` takes this path on every device.
"""

from __future__ import annotations

import itertools

import torch

_LAYOUTS: dict = {}  # (device, lookups per table, rows per table) -> (first_pos, row_offset), each [N] int64


def _layout(device, counts: tuple[int, ...], rows: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """For the lookups of several tables laid end to end (table t's ``counts[t]`` at position o_t): each lookup's
    table start o_t and its table's row offset in one key space. Filled on the device (no host copy, so no sync),
    once per layout: a step's shapes repeat."""
    key = (str(device), counts, rows)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) > 64:
            _LAYOUTS.clear()
        # strict=False: _starts(()) is [0]
        first = [torch.full((n,), o, dtype=torch.long, device=device)
                 for n, o in zip(counts, _starts(counts), strict=False)]
        offset = [torch.full((n,), r, dtype=torch.long, device=device)
                  for n, r in zip(counts, _starts(rows), strict=False)]
        _LAYOUTS[key] = (torch.cat(first), torch.cat(offset))
    return _LAYOUTS[key]


def _starts(sizes: tuple[int, ...]) -> list[int]:
    """Where each of consecutive blocks of ``sizes`` begins."""
    return list(itertools.accumulate(sizes[:-1], initial=0))


def sync_free_update(param: torch.Tensor, state_sum: torch.Tensor, index: torch.Tensor, values: torch.Tensor, *,
                     clr: float, eps: float) -> None:
    """Adagrad on the rows ``index`` of a 2-D ``param`` with gradient rows ``values`` (ids may repeat: their
    gradients add up, as a coalesce would). In place; ``state_sum`` is the running sum of squares."""
    sync_free_update_many([(param, state_sum, index, values, clr)], eps=eps)


def sync_free_update_many(updates, *, eps: float) -> None:
    """``sync_free_update`` for several tables at once: ``updates`` is a list of (param, state_sum, index, values,
    clr). Tables of one device, dtype and width share each op (one sort of every lookup, one segment sum, one
    square root), so the per-table ops are only the three that touch a table's own rows: about 3T + 20 ops for
    T tables instead of about 14T. gem-bench's shape (16 tables, 192 lookups each, width 128; counted on the CPU
    with torch.profiler, 2026-12-02): 175 top-level aten calls a step (views included) instead of 624, 15.8 against
    26.0 ms of CPU time there. Not yet timed on the H200, where the per-table version's step had 14.3 ms of GPU
    idle inside it (the compiled gem-bench step profile)."""
    groups: dict = {}
    for u in updates:
        param, _, index, values, _ = u
        if index.numel():
            groups.setdefault((param.device, param.dtype, param.shape[1], values.dtype), []).append(u)
    for group in groups.values():
        _update_group(group, eps)


def _update_group(group, eps: float) -> None:
    device = group[0][0].device
    counts = tuple(u[2].numel() for u in group)
    first_pos, row_offset = _layout(device, counts, tuple(u[0].shape[0] for u in group))
    n = first_pos.numel()
    keys = torch.cat([u[2].reshape(-1) for u in group]).long() + row_offset  # table t's rows after t-1's
    values = torch.cat([u[3] for u in group]) if len(group) > 1 else group[0][3]
    ordered, perm = torch.sort(keys, stable=True)  # table by table (the offsets), ids ascending within each
    starts = torch.ones(n, dtype=torch.bool, device=device)
    starts[1:] = ordered[1:] != ordered[:-1]
    segment = torch.cumsum(starts, 0) - 1
    # a lookup's slot: its distinct row's rank within its table, placed in that table's range [o_t, o_t + n_t)
    # (the first lookup of every table starts a segment: the tables' key ranges do not overlap)
    slot = segment - (segment[first_pos] - first_pos)
    grad = torch.zeros_like(values).index_add_(0, slot, values.index_select(0, perm))
    rows = torch.zeros(n, dtype=torch.long, device=device).scatter_(0, slot, ordered - row_offset)
    used = torch.zeros(n, dtype=torch.bool, device=device).scatter_(0, slot, True)  # unused slots: row 0, grad 0
    square = grad * grad
    spans = [(lo, lo + count) for lo, count in zip(_starts(counts), counts, strict=False)]
    for (_, state_sum, _, _, _), (a, b) in zip(group, spans, strict=True):
        state_sum.index_add_(0, rows[a:b], square[a:b])
    std = torch.cat([u[1].index_select(0, rows[a:b]) for u, (a, b) in zip(group, spans, strict=True)]).sqrt_().add_(eps)
    # where(): an unused slot points at row 0 with a zero gradient; with eps = 0 its 0 / 0 must add nothing
    step = torch.where(used[:, None], grad / std, 0.0)
    for (param, _, _, _, clr), (a, b) in zip(group, spans, strict=True):
        param.index_add_(0, rows[a:b], step[a:b], alpha=-clr)


class SparseAdagrad(torch.optim.Adagrad):
    """``torch.optim.Adagrad`` whose sparse-gradient step is ``sync_free_update`` (off the CPU by default).

    Dense gradients, sparse gradients of more than one sparse dim and (by default) CPU tensors take torch's
    own step. Hyper-parameters, state and ``state_dict`` are Adagrad's."""

    def __init__(self, params, *args, sync_free: bool | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.sync_free = sync_free

    def _takes(self, p: torch.Tensor) -> bool:
        g = p.grad
        if g is None or not g.is_sparse or g.sparse_dim() != 1 or p.dim() != 2:
            return False
        return self.sync_free if self.sync_free is not None else p.device.type != "cpu"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mine, updates = [], {}
        for group in self.param_groups:
            for p in group["params"]:
                if not self._takes(p):
                    continue
                if group["weight_decay"] != 0:  # torch's message for the same case
                    raise RuntimeError("weight_decay option is not compatible with sparse gradients")
                state = self.state[p]
                state["step"] += 1
                step = float(state["step"])  # a CPU tensor (Adagrad keeps steps on the host): no sync
                clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
                values = p.grad._values()
                updates.setdefault(group["eps"], []).append(
                    (p, state["sum"], p.grad._indices()[0], -values if group["maximize"] else values, clr))
                mine.append(p)
        for eps, group_updates in updates.items():  # every table in one batch of ops (per eps)
            sync_free_update_many(group_updates, eps=eps)
        if len(mine) < sum(p.grad is not None for g in self.param_groups for p in g["params"]):
            # the rest through torch's step, with the parameters done here hidden from it
            grads = [p.grad for p in mine]
            for p in mine:
                p.grad = None
            try:
                super().step()
            finally:
                for p, g in zip(mine, grads, strict=True):
                    p.grad = g
        return loss
