"""Batching conformance: ``assign(costs, world_size)`` gives every sample to exactly one rank, the same way
every time, and the global loss and gradient do not depend on the split: the per-rank losses, weighted by each
rank's share of the normaliser (candidates for gem), sum to the whole batch's loss, and so do the gradients.
Costs come from the model's own ``cost_model``, as the trainer's will.

    from gemzoo.testing.batching import batching_cases, check_assignment, check_global_loss
    @pytest.mark.parametrize("case", batching_cases(), ids=str)
    def test_assignment(case):
        check_assignment(MY_POLICY, case)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchingCase:
    samples: int
    world_size: int
    costs: str = "lognormal"  # lognormal | uniform | zeros | one-heavy
    seed: int = 0

    def make_costs(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        n = self.samples
        if self.costs == "uniform":
            return torch.ones(n, dtype=torch.float64)
        if self.costs == "zeros":
            return torch.zeros(n, dtype=torch.float64)
        if self.costs == "one-heavy":
            c = torch.ones(n, dtype=torch.float64)
            c[n // 2 if n else 0:][:1] = 1e6
            return c
        lengths = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 1.0 + 3.0).round()
        return lengths**2 + 10 * lengths  # attention pairs + linear work, as a cost model gives

    def __str__(self) -> str:
        return f"n{self.samples}-w{self.world_size}-{self.costs}-s{self.seed}"


def batching_cases() -> list[BatchingCase]:
    return [BatchingCase(32, 2), BatchingCase(33, 4, seed=1), BatchingCase(16, 1), BatchingCase(12, 3, "uniform"),
            BatchingCase(8, 2, "zeros"), BatchingCase(9, 2, "one-heavy"), BatchingCase(3, 4), BatchingCase(0, 2)]


def check_assignment(policy, case: BatchingCase) -> list[torch.Tensor]:
    """Exactly once, integer indices, ``world_size`` groups, deterministic (and independent of the input's
    storage: a copy of the costs gives the same groups)."""
    costs = case.make_costs()
    groups = policy.assign(costs, case.world_size)
    name = type(policy).__name__
    assert len(groups) == case.world_size, f"{name}.assign returned {len(groups)} groups for {case.world_size} ranks"
    for r, g in enumerate(groups):
        assert isinstance(g, torch.Tensor) and g.dim() == 1, f"{name}: group {r} is not a 1-D tensor"
        assert not g.is_floating_point() and not g.is_complex(), f"{name}: group {r} has dtype {g.dtype}, want int64"
    flat = torch.cat([g.long() for g in groups]) if groups else torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(flat, minlength=case.samples) if flat.numel() else torch.zeros(case.samples)
    assert flat.numel() == 0 or (int(flat.min()) >= 0 and int(flat.max()) < case.samples), \
        f"{name}: indices outside [0, {case.samples})"
    missing, twice = (counts == 0).nonzero().flatten().tolist(), (counts > 1).nonzero().flatten().tolist()
    assert not missing and not twice, f"{name}: samples {missing[:5]} unassigned, {twice[:5]} assigned twice"
    again = policy.assign(costs.clone(), case.world_size)
    assert all(torch.equal(a.long(), b.long()) for a, b in zip(groups, again)), f"{name}.assign is not deterministic"
    fresh = copy.deepcopy(policy).assign(costs.clone(), case.world_size)
    assert all(torch.equal(a.long(), b.long()) for a, b in zip(groups, fresh)), \
        f"{name}.assign depends on state left by an earlier call"
    return groups


def check_global_loss(policy, model, batch, world_size: int, *, weight=None, rtol: float = 1e-5) -> None:
    """Split ``batch`` with ``policy.assign(model.cost_model(batch), world_size)``; each rank's loss times its
    share of the normaliser (``weight(batch)``: number of loss terms, default ``num_samples``) sums to the
    whole batch's loss, and the gradients to its gradients (each within ``rtol`` in norm: rounding is far
    below it, a wrong weight or a lost sample far above)."""
    weight = weight or (lambda b: b.num_samples)
    groups = policy.assign(model.cost_model(batch), world_size)
    total = weight(batch)

    def loss_and_grads(b):
        model.zero_grad(set_to_none=True)
        loss = model(b).loss
        loss.backward()
        return loss.detach(), {n: p.grad.to_dense().clone() if p.grad.is_sparse else p.grad.clone()
                               for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want_grads = loss_and_grads(batch)
    got_loss, got_grads = torch.zeros((), dtype=want_loss.dtype), {}
    for g in groups:
        part = batch.select(g.long())
        w = weight(part)
        if w == 0:
            continue
        loss, grads = loss_and_grads(part)
        got_loss = got_loss + loss * (w / total)
        for n, gr in grads.items():
            got_grads[n] = got_grads.get(n, 0) + gr * (w / total)
    torch.testing.assert_close(got_loss, want_loss, rtol=rtol, atol=0)
    for n, gr in want_grads.items():
        got = got_grads.get(n, torch.zeros_like(gr))
        err = float((got.double() - gr.double()).norm() / gr.double().norm().clamp_min(1e-30))
        assert err <= rtol, f"{type(policy).__name__}: the gradient of {n} depends on the split (relative error {err:.3g})"
