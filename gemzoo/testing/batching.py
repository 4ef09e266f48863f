"""Batching conformance: ``assign(costs, world_size)`` gives every sample to exactly one rank, the same way
every time, and the global loss and gradient do not depend on the split: the per-rank losses, weighted by each
rank's share of the normaliser (candidates for gem), sum to the whole batch's loss, and so do the gradients.
Costs come from the model's own ``cost_model``, as the trainer's do.

On several gloo ranks (``check_rebalance_on_gloo``), each rank loads only its own part of the global batch
and ``gemzoo.data.exchange.rebalance`` (or the policy's own ``rebalance``) gives it exactly
``global_batch.select(assign(global_costs)[rank])``, bit for bit, for gem batches (synthetic-gem, the costs
from gem's ``cost_model``) and for retrieval batches loaded through a dataset's ``train_shard``, with uneven
parts and a rank with no samples; and the ranks' losses, weighted by their share of the candidates, sum to
the global batch's loss.

    from gemzoo.testing.batching import batching_cases, check_assignment, check_global_loss
    @pytest.mark.parametrize("case", batching_cases(), ids=str)
    def test_assignment(case):
        check_assignment(MY_POLICY, case)

    def test_on_gloo(tmp_path):
        check_rebalance_on_gloo({"mine": MY_POLICY}, tmp_path)   # spawns 2 ranks
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gemzoo import registry
from gemzoo.data.batch import SeqBatch, gather_jagged
from gemzoo.data.exchange import load_shard, rebalance, shard_range
from gemzoo.interfaces.batching import DataParallelGroup
from gemzoo.jagged import lengths_to_offsets
from gemzoo.testing.comms import rank_env, spawn
from gemzoo.testing.memory import tiny_model


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
    def same(xs, ys) -> bool:
        return len(xs) == len(ys) and all(torch.equal(a.long(), b.long()) for a, b in zip(xs, ys, strict=True))

    assert same(groups, policy.assign(costs.clone(), case.world_size)), f"{name}.assign is not deterministic"
    fresh = copy.deepcopy(policy).assign(costs.clone(), case.world_size)
    assert same(groups, fresh), f"{name}.assign depends on state left by an earlier call"
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


class ReverseStride:
    """A policy that moves almost every sample: rank r gets the samples i with i % W == W - 1 - r, last first.
    The gloo check runs it beside the registered ones, so the exchange's order is tested even when every
    registered policy keeps samples where they are."""

    def assign(self, costs: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        idx = torch.arange(costs.numel() - 1, -1, -1)
        return [idx[idx % world_size == world_size - 1 - r] for r in range(world_size)]


class _SeqStream:
    """A retrieval-style dataset that builds only the rows a rank asks for (``train_shard``), with timestamps:
    the per-rank loading path of the exchange, on SeqBatch."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def _rows(self, step: int, lo: int, hi: int):
        lengths = torch.tensor([(7 * (step * self.batch_size + j)) % 11 for j in range(lo, hi)], dtype=torch.long)
        t = int(lengths.sum())
        start = 1000 * step + sum((7 * (step * self.batch_size + j)) % 11 for j in range(lo))
        items = torch.arange(start, start + t)
        return SeqBatch(items, lengths_to_offsets(lengths), items + 1, 10 * items, 10 * items + 5)

    def train_batch(self, step: int):
        return self._rows(step, 0, self.batch_size)

    def train_shard(self, step: int, rank: int, world_size: int):
        return self._rows(step, *shard_range(self.batch_size, rank, world_size))


@dataclass
class _FeatureBatch:
    """A batch with a 2-D per-sample field (dense features [B, 3], float16) beside a jagged one: the exchange
    must keep trailing dims and odd dtypes."""

    feats: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_samples(self) -> int:
        return self.feats.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets.diff()

    def select(self, index):
        index = torch.as_tensor(index, dtype=torch.int64)
        offsets, ids = gather_jagged(self.offsets, index, self.ids)
        return _FeatureBatch(self.feats[index], ids, offsets)

    @classmethod
    def cat(cls, parts):
        return cls(torch.cat([p.feats for p in parts]), torch.cat([p.ids for p in parts]),
                   lengths_to_offsets(torch.cat([p.lengths for p in parts])))


class _FeatureStream:
    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def train_batch(self, step: int):
        n = self.batch_size
        lengths = (torch.arange(n) * 5 + step) % 4
        feats = (torch.arange(3 * n, dtype=torch.float16).reshape(n, 3) + step) / 4
        return _FeatureBatch(feats, torch.arange(int(lengths.sum())) + 100 * step, lengths_to_offsets(lengths))


def batches_equal(a, b) -> list[str]:
    """The fields in which two batches of one dataclass type differ (dtype, shape or any value)."""
    import dataclasses

    if type(a) is not type(b):
        return [f"type {type(a).__name__} != {type(b).__name__}"]
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        same = (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and torch.equal(x, y)) or (not isinstance(x, torch.Tensor) and x == y)
        if not same:
            out.append(f.name)
    return out


def small_gem_stream(batch_size: int):
    """A small synthetic-gem dataset (histories of 0..48 events, 2 sparse tables) for the gloo batching checks."""
    data = registry.get("dataset", "synthetic-gem")
    return data.build(data.config_cls(batch_size=batch_size, max_len=48, median_len=16, min_len=0, max_candidates=4,
                                      num_items=120, num_clusters=4, num_sparse_tables=2, sparse_table_size=30), 0)


def rebalance_rank(rank: int, world: int, port: int, policies: dict, out_dir: str, steps: int = 2) -> None:
    """One rank of ``check_rebalance_on_gloo``: for each policy (a registered name -> None, or an object) and
    each step, the samples it gets from its own part equal the global batch's ``select`` of the partition."""
    rank_env(rank, world, port)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dp = DataParallelGroup(rank, world)
    model, _ = tiny_model(0, d_model=16, batch_size=13)
    model = model.double()
    streams = {"gem": (small_gem_stream(13), model.cost_model), "gem-1": (small_gem_stream(1), model.cost_model),
               "seq-13": (_SeqStream(13), None), "seq-1": (_SeqStream(1), None),  # *-1: a rank has no samples
               "features": (_FeatureStream(13), None)}
    summary = {}
    for name, policy in policies.items():
        policy = registry.get("batching", name) if policy is None else policy
        seen = {}
        for label, (ds, cost) in streams.items():
            cost = cost or (lambda b: (b.lengths.double() ** 2 + b.lengths.double()))
            for step in range(steps):
                full, local = ds.train_batch(step), load_shard(ds, step, rank, world)
                got = rebalance(policy, local, cost(local), dp, name=name)
                groups = policy.assign(cost(full).double(), world)
                want = full.select(torch.as_tensor(groups[rank]).long())
                bad = batches_equal(got, want)
                assert not bad, (f"batching {name!r}, {label} step {step}, rank {rank}: the samples received differ "
                                 f"from the global batch's select of the partition in {bad}")
                seen[f"{label}/{step}"] = int(got.num_samples)
                if label.startswith("gem"):  # the ranks' losses, weighted by their candidates, sum to the global loss
                    with torch.no_grad():
                        part = (model(got).loss * (got.num_candidates / full.num_candidates) if got.num_samples
                                else torch.zeros((), dtype=torch.float64))
                        whole = model(full).loss
                    total = part.detach().clone()
                    dist.all_reduce(total)
                    torch.testing.assert_close(total, whole, rtol=1e-9, atol=0,
                                               msg=lambda m, name=name: f"batching {name!r}: global loss changed: {m}")
        summary[name] = seen
    Path(out_dir, f"batching{rank}.json").write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


def check_rebalance_on_gloo(policies, tmp_path, world: int = 2) -> list[dict]:
    """Spawn ``world`` CPU ranks that check each policy (registered names, or a dict name -> policy object,
    which must pickle) plus ``ReverseStride``; returns every rank's {policy: {case: samples received}}."""
    if isinstance(policies, str):
        policies = [policies]
    policies = dict(policies) if isinstance(policies, dict) else {n: None for n in policies}
    policies.setdefault("reverse-stride (gemzoo.testing)", ReverseStride())
    spawn(rebalance_rank, world, policies, str(tmp_path))
    out = [json.loads(Path(tmp_path, f"batching{r}.json").read_text()) for r in range(world)]
    for name in policies:
        for case in out[0][name]:
            total = sum(o[name][case] for o in out)
            want = 1 if case.split("/")[0].endswith("-1") else 13
            assert total == want, f"batching {name!r}, {case}: {total} samples trained across ranks, want {want}"
    return out
