"""Model and dataset conformance, for every registered family and dataset.

Dataset: ``build(cfg, seed)`` is a ``Dataset``; its batches are ``Batch``es; ``train_batch(step)`` is the same
for the same (seed, step) and differs for another step; ``select`` keeps samples whole (all of them in order
gives the batch back); ``eval_batches`` are the same on every call.

Model: built on ``meta`` (no real memory), ``to_empty`` + seeded ``init_weights`` is bitwise repeatable; the
model is a ``RecModel``; one training step (forward, backward, AdamW) gives a finite loss, a gradient for every
parameter, and changes the weights; ``flops`` > 0 and ``cost_model`` sums to it; ``transformer_blocks`` are
submodules; the evaluator returns floats.

Small configs for gemzoo's own entries are below; any other entry is built from its config class's defaults
unless the caller passes ``model_cfg`` / ``data_cfg`` (keep them small: these run on CPU in CI).

    from gemzoo.testing.models import check_dataset, check_model
    def test_conformance(tmp_path):
        check_model("my-family", tmp_path, model_cfg={"d_model": 16})
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

from gemzoo.interfaces.models import Batch, Dataset, RecModel, transformer_blocks

SMALL_MODEL = {
    "gem": dict(d_model=16, num_layers=1, num_heads=2, embedding_dim=8, mlp_dims=[16, 8]),
    "hstu": dict(embedding_dim=16, num_layers=1, num_heads=2, num_negatives=8, dropout=0.0),
    "sasrec": dict(embedding_dim=16, num_layers=1, num_heads=2, num_negatives=8, dropout=0.0),
}


def _ratings(path: Path, users: int = 16, items: int = 30, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = [f"{u}::{rng.randrange(items) + 1}::{rng.randrange(1, 6)}::{1000 + 10 * i}"
             for u in range(1, users + 1) for i in range(rng.randrange(4, 14))]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


SMALL_DATA = {
    "synthetic-gem": lambda tmp: dict(batch_size=6, max_len=16, median_len=6, min_len=0, max_candidates=3,
                                      num_items=40, num_clusters=3, num_sparse_tables=2, sparse_table_size=16),
    "movielens": lambda tmp: dict(path=_ratings(Path(tmp) / "ratings.dat"), batch_size=6, max_len=8),
}


def build_dataset(name: str, tmp_path, data_cfg: dict | None = None, seed: int = 0):
    from gemzoo import registry

    spec = registry.get("dataset", name)
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    fields = {f.name for f in dataclasses.fields(spec.config_cls)}
    kwargs = data_cfg if data_cfg is not None else SMALL_DATA.get(name, lambda tmp: {})(tmp_path)
    kwargs = {k: v for k, v in kwargs.items() if k in fields}
    return spec.build(spec.config_cls(**kwargs), seed)


def _fields_equal(a, b) -> bool:
    if dataclasses.is_dataclass(a):
        return all(_fields_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def check_dataset(name: str, tmp_path, *, data_cfg: dict | None = None) -> None:
    ds, twin = build_dataset(name, tmp_path, data_cfg), build_dataset(name, tmp_path, data_cfg)
    assert isinstance(ds, Dataset), f"dataset {name!r} builds a {type(ds).__name__}, not a Dataset"
    assert isinstance(ds.info, dict)
    b0 = ds.train_batch(0)
    assert isinstance(b0, Batch), f"dataset {name!r}: train_batch returns a {type(b0).__name__}, not a Batch"
    assert _fields_equal(b0, twin.train_batch(0)), f"dataset {name!r}: train_batch(0) differs between two builds"
    assert _fields_equal(b0, ds.train_batch(0)), f"dataset {name!r}: train_batch(0) differs between two calls"
    assert not _fields_equal(b0, ds.train_batch(1)), f"dataset {name!r}: steps 0 and 1 give the same batch"
    n = b0.num_samples
    assert n > 0 and b0.lengths.shape == (n,) and int(b0.lengths.sum()) == b0.num_tokens
    assert _fields_equal(b0.select(torch.arange(n)), b0), f"dataset {name!r}: select(all) is not the batch"
    part = b0.select(torch.tensor([n - 1, 0]))
    assert part.num_samples == 2 and torch.equal(part.lengths, b0.lengths[[n - 1, 0]])
    assert _fields_equal(b0.to("cpu"), b0)
    evals = ds.eval_batches(2)
    assert len(evals) == 2 and all(isinstance(b, Batch) for b in evals)
    again = ds.eval_batches(2)
    assert len(again) == 2 and all(_fields_equal(a, b) for a, b in zip(evals, again, strict=True)), \
        f"dataset {name!r}: eval batches change"


def partner_dataset(family: str, tmp_path) -> tuple[str, object]:
    """The first registered dataset whose info this family builds from (on meta): (name, dataset)."""
    from gemzoo import registry
    from gemzoo.errors import ConfigError

    spec, tried = registry.get("model", family), []
    for name in registry.names("dataset"):
        ds = build_dataset(name, tmp_path / name)
        try:
            with torch.device("meta"):
                spec.build(spec.config_cls(**SMALL_MODEL.get(family, {})), ds.info)
        except ConfigError as exc:
            tried.append(f"{name}: {exc}")
            continue
        return name, ds
    raise AssertionError(f"model family {family!r} builds from no registered dataset: {'; '.join(tried)}")


def check_model(family: str, tmp_path, *, model_cfg: dict | None = None, dataset=None, seed: int = 0) -> None:
    from gemzoo import registry

    spec = registry.get("model", family)
    ds = dataset if dataset is not None else partner_dataset(family, Path(tmp_path))[1]
    cfg = spec.config_cls(**(model_cfg if model_cfg is not None else SMALL_MODEL.get(family, {})))
    with torch.device("meta"):
        model = spec.build(cfg, ds.info)
    assert isinstance(model, RecModel), f"model {family!r} ({type(model).__name__}) is not a RecModel"
    real = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
    assert not real, f"model {family!r} allocates real memory under torch.device('meta'): {real[:5]}"

    def materialise(m):
        m.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            m.init_weights()
        return m

    model = materialise(model)
    with torch.device("meta"):
        twin = spec.build(cfg, ds.info)
    twin = materialise(twin)
    sa, sb = model.state_dict(), twin.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), \
        f"model {family!r}: two seeded builds differ"
    modules = {id(m) for m in model.modules()}
    blocks = transformer_blocks(model)
    assert all(id(b) in modules for b in blocks), f"model {family!r}: transformer_blocks are not submodules"
    assert isinstance(model.embedding_tables(), list)

    batch = ds.train_batch(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    out = model(batch)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss), f"model {family!r}: loss {out.loss}"
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"model {family!r}: parameters without gradient: {missing[:5]}"
    dense = [p for p in model.parameters() if p.grad is not None and not p.grad.is_sparse]
    torch.optim.AdamW(dense, lr=1e-2).step()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "one step changed nothing"
    flops = model.flops(batch)
    assert isinstance(flops, int) and flops > 0
    cost = model.cost_model(batch)
    assert cost.shape == (batch.num_samples,) and (cost >= 0).all()
    assert abs(float(cost.sum()) - flops) <= 1e-9 * flops, \
        f"model {family!r}: cost_model sums to {float(cost.sum()):.6g}, flops says {flops}"
    ev = model.evaluator()
    model.eval()
    with torch.no_grad():
        for eb in ds.eval_batches(1):
            ev.update(eb)
    metrics = ev.compute()
    assert metrics and all(isinstance(v, float) for v in metrics.values()), metrics
