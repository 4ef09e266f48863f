"""Memory conformance: a policy changes memory, not the math. On a tiny model (gem over synthetic-gem, wide
enough that activation tensors pass act-quant-style size thresholds), one forward+backward with the policy
applied and its ``step_context`` entered gives the loss and every gradient of the same model without it,
within the relative error the policy declares as ``grad_rtol`` (absent: 0, bit-exact, as recompute is).
``apply`` keeps every state-dict name (checkpoints load either way) and ``report()``, when present, is JSON.
A policy that ``needs_compile`` is compared with both sides compiled by ``compile_backend``, on a dense model
(``DenseTiny``: residual MLP blocks) that compiles in seconds.

    from gemzoo.testing.memory import check_memory_policy
    def test_conformance():
        check_memory_policy(MY_POLICY)
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import torch
from torch import nn

from gemzoo import registry
from gemzoo.interfaces.memory import needs_compile, policy_report
from gemzoo.interfaces.models import ModelOutput

# aot_autograd's min-cut partitioner (where activation_memory_budget acts) without inductor's codegen: fast on CPU
COMPILE_BACKEND = "aot_eager_decomp_partition"


def declared_tolerance(policy) -> float:
    """The relative error of loss and gradients the policy promises (``grad_rtol``; 0 when it declares none)."""
    tol = getattr(policy, "grad_rtol", 0.0)
    if not isinstance(tol, (int, float)) or not 0 <= tol < 1:
        raise AssertionError(f"{type(policy).__name__}.grad_rtol must be a number in [0, 1), got {tol!r}")
    return float(tol)


def tiny_model(seed: int = 0, *, d_model: int = 32, batch_size: int = 16, sparse_tables: int = 2):
    """(model, batch): a gem model over a synthetic-gem batch, built as the trainer builds it (meta, to_empty,
    init_weights), in fp32 on CPU with the ``reference`` attention kernel and no dropout."""
    data = registry.get("dataset", "synthetic-gem")
    ds = data.build(data.config_cls(batch_size=batch_size, max_len=48, median_len=16, min_len=0, max_candidates=4,
                                    num_items=120, num_clusters=4, num_sparse_tables=sparse_tables,
                                    sparse_table_size=30), seed)
    spec = registry.get("model", "gem")
    with torch.device("meta"):
        model = spec.build(spec.config_cls(d_model=d_model, num_layers=1, num_heads=2, embedding_dim=16,
                                           mlp_dims=[32, 16], dropout=0.0), ds.info)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model, ds.train_batch(0)


class _Block(nn.Module):
    is_transformer_block = True

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class DenseTiny(nn.Module):
    """Two residual MLP blocks and a regression head over [tokens, width]: what a compiled policy is checked on
    (a jagged model's per-sequence Python breaks graphs and takes minutes to compile on CPU)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def transformer_blocks(self):
        return list(self.blocks)

    def forward(self, batch):
        x = batch["x"]
        for block in self.blocks:
            x = block(x)
        return ModelOutput(torch.nn.functional.mse_loss(self.head(x).squeeze(-1), batch["y"]), {})


def dense_tiny(seed: int = 0, tokens: int = 256, width: int = 32):
    torch.manual_seed(seed)
    return DenseTiny(width), {"x": torch.randn(tokens, width), "y": torch.randn(tokens)}


def _loss_and_grads(model, batch, policy=None, compile_backend: str | None = None):
    forward = torch.compile(model, backend=compile_backend) if compile_backend else model
    ctx = policy.step_context() if policy is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        loss = forward(batch).loss
        loss.backward()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def check_memory_policy(policy, *, seed: int = 0, compile_backend: str = COMPILE_BACKEND,
                        model_and_batch=None) -> dict[str, float]:
    """Loss and every gradient with ``policy`` against without it; returns the relative errors."""
    compiled = needs_compile(policy)
    model, batch = model_and_batch or (dense_tiny(seed) if compiled else tiny_model(seed))
    twin = copy.deepcopy(model)
    backend = compile_backend if compiled else None
    if compiled:
        torch._dynamo.reset()
    ref_loss, ref_grads = _loss_and_grads(model, batch, None, backend)
    names = set(twin.state_dict())
    cfg = SimpleNamespace(run=SimpleNamespace(compile=compiled))
    out = policy.apply(twin, cfg)
    twin = twin if out is None else out
    assert set(twin.state_dict()) == names, (
        f"{type(policy).__name__}.apply renamed state-dict entries: {sorted(names ^ set(twin.state_dict()))}")
    if compiled:
        torch._dynamo.reset()
    loss, grads = _loss_and_grads(twin, batch, policy, backend)
    tol = declared_tolerance(policy)
    assert grads.keys() == ref_grads.keys(), (
        f"{type(policy).__name__}: gradients for {sorted(grads.keys() ^ ref_grads.keys())} appear or vanish")
    errors = {"loss": _rel(loss, ref_loss), **{n: _rel(g, ref_grads[n]) for n, g in grads.items()}}
    if tol == 0:
        bad = {n: e for n, e in errors.items() if e != 0}
        assert not bad, (f"{type(policy).__name__} declares no grad_rtol (bit-exact) but changed "
                         f"{len(bad)} of loss/gradients, e.g. {dict(list(bad.items())[:3])}; declare the "
                         "relative error it promises as grad_rtol")
    else:
        bad = {n: e for n, e in errors.items() if not e <= tol}
        assert not bad, f"{type(policy).__name__}: relative error over its grad_rtol {tol:g}: {bad}"
    report = policy_report(policy)
    json.dumps(report)  # the trainer writes it to metrics.jsonl
    return errors


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if torch.equal(a, b):
        return 0.0
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
