"""Adagrad for the plain-torch tables' sparse gradients, without a host sync.

torch's Adagrad coalesces each sparse gradient first (sums the rows looked up more than once). On CUDA that
is a host sync per table: the number of distinct rows is read back to size the result. gem-bench's 16 tables
so drained the device queue 16 times at the end of every step, and the optimizer's host work (about 10 ms on
the H200, issue 17's profile) ran with the GPU idle.

Here the duplicate rows are summed into slots of a fixed size, one per looked-up id (sort, segment ids by
cumsum, ``index_add_``); the slots past the last distinct row hold zeros and add nothing. No op's output
size depends on the data, so the update runs on the device behind the backward (``sync_free_update`` even
runs on the meta device, which the tests use as the proof).

The arithmetic is torch's (state += g², param -= clr · g / (sqrt(state) + eps)), with its state names, so
checkpoints move between this class and ``torch.optim.Adagrad``. The duplicate rows' sum may round
differently (another order of addition), so on the CPU, where runs are bit-exact, the default is torch's own
step; ``sync_free=True`` takes this path on every device.
"""

from __future__ import annotations

import torch


def sync_free_update(param: torch.Tensor, state_sum: torch.Tensor, index: torch.Tensor, values: torch.Tensor, *,
                     clr: float, eps: float) -> None:
    """Adagrad on the rows ``index`` of a 2-D ``param`` with gradient rows ``values`` (ids may repeat: their
    gradients add up, as a coalesce would). In place; ``state_sum`` is the running sum of squares."""
    n = index.numel()
    if n == 0:
        return
    index = index.reshape(-1).long()
    ordered, perm = torch.sort(index, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=index.device)
    starts[1:] = ordered[1:] != ordered[:-1]
    segment = torch.cumsum(starts, 0) - 1                               # slot of every looked-up row
    grad = torch.zeros_like(values).index_add_(0, segment, values.index_select(0, perm))
    rows = torch.zeros(n, dtype=torch.long, device=index.device).scatter_(0, segment, ordered)
    used = torch.arange(n, device=index.device) <= segment[-1]          # slots past the last row: zeros
    state_sum.index_add_(0, rows, grad * grad)
    std = state_sum.index_select(0, rows).sqrt_().add_(eps)
    # where(): an unused slot points at row 0 with a zero gradient; with eps = 0 its 0 / 0 must add nothing
    param.index_add_(0, rows, torch.where(used[:, None], grad / std, 0.0), alpha=-clr)


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
        mine = []
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
                grad = p.grad
                values = grad._values()
                sync_free_update(p, state["sum"], grad._indices()[0], -values if group["maximize"] else values,
                                 clr=clr, eps=group["eps"])
                mine.append(p)
        if len(mine) < sum(p.grad is not None for g in self.param_groups for p in g["params"]):
            # the rest through torch's step, with the parameters done here hidden from it
            grads = [p.grad for p in mine]
            for p in mine:
                p.grad = None
            try:
                super().step()
            finally:
                for p, g in zip(mine, grads):
                    p.grad = g
        return loss
