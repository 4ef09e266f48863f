"""MFU's numerator, checked against a count made by hooking every matmul (torch's FlopCounterMode).

Every registered model family runs one forward and backward with an attention kernel that computes only
allowed (query, key) pairs, one query row at a time, so the matmuls torch sees are exactly the useful
ones; their FLOPs, forward and backward, must equal ``model.flops(batch)`` (PaLM's definition: matmuls
2mnk, backward twice forward, attention counted on allowed pairs).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gemzoo
from gemzoo.attention import FunctionKernel, allowed_mask, apply_activation, attention_sites
from gemzoo.data.movielens import MovieLensConfig, MovieLensDataset
from gemzoo.data.synthetic import SyntheticGemConfig, SyntheticGemDataset
from gemzoo.flops import attention_flops, linear_flops
from gemzoo.interfaces.attention import AttentionCapabilities
from gemzoo.testing.timeouts import hang_guard

SMALL = {
    "gem": dict(d_model=16, num_layers=2, num_heads=2, embedding_dim=8, mlp_dims=[16, 8]),
    "hstu": dict(embedding_dim=16, num_layers=2, num_heads=2, num_negatives=8, dropout=0.0),
    "sasrec": dict(embedding_dim=16, num_layers=2, num_heads=2, num_negatives=8, dropout=0.0),
}


def pairwise_attention(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                       norm=None, window=None, block_size=None, **_hints):
    """Attention over allowed pairs only: one [H, 1, D] x [H, D, n] product per query row."""
    k_offsets = q_offsets if k_offsets is None else k_offsets
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = []
    for b in range(q_offsets.numel() - 1):
        q0, q1, k0, k1 = int(q_offsets[b]), int(q_offsets[b + 1]), int(k_offsets[b]), int(k_offsets[b + 1])
        mask = allowed_mask(q1 - q0, k1 - k0, causal=causal, window=window, block_size=block_size)
        for i in range(q1 - q0):
            keys = mask[i].nonzero().squeeze(1) + k0
            if keys.numel() == 0:
                rows.append(q.new_zeros(q.shape[1], v.shape[2]))
                continue
            s = torch.bmm(q[q0 + i].unsqueeze(1), k[keys].permute(1, 2, 0)) * scale  # [H, 1, n]
            p = torch.softmax(s, -1) if activation == "softmax" else apply_activation(s, activation)
            if norm is not None and activation != "softmax":
                p = p / norm
            rows.append(torch.bmm(p, v[keys].transpose(0, 1)).squeeze(1))  # [H, Dv]
    if not rows:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    return torch.stack(rows)


PAIRWISE = FunctionKernel(pairwise_attention, AttentionCapabilities(
    activations=frozenset({"softmax", "silu", "gelu", "relu", "identity"}), window=True, block=True))


def _ratings(path, users=12, items=30, seed=0):
    rng = random.Random(seed)
    lines = [f"{u}::{rng.randrange(items) + 1}::3::{1000 + 10 * i}"
             for u in range(1, users + 1) for i in range(rng.randrange(5, 12))]
    path.write_text("\n".join(lines) + "\n")


def _dataset(family, tmp_path):
    if family == "gem":
        return SyntheticGemDataset(SyntheticGemConfig(batch_size=4, max_len=12, median_len=6, min_len=0,
                                                      max_candidates=3, num_items=50, num_clusters=3,
                                                      num_sparse_tables=2, sparse_table_size=20), seed=0)
    _ratings(tmp_path / "ratings.dat")
    return MovieLensDataset(MovieLensConfig(path=str(tmp_path / "ratings.dat"), batch_size=4, max_len=8), seed=0)


@pytest.mark.parametrize("family", gemzoo.registry.names("model"))
def test_model_flops_equal_the_counted_matmuls(family, tmp_path):
    if family not in SMALL:
        pytest.skip(f"no small config for model family {family!r} in this test")
    ds = _dataset(family, tmp_path)
    spec = gemzoo.registry.get("model", family)
    with torch.device("meta"):
        model = spec.build(spec.config_cls(**SMALL[family]), ds.info)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    for site in attention_sites(model).values():
        site.set_kernel("pairwise", PAIRWISE)
    batch = ds.train_batch(0)
    counter = FlopCounterMode(display=False)
    with counter:
        model(batch).loss.backward()
    counted, claimed = counter.get_total_flops(), model.flops(batch)
    if family in ("hstu", "sasrec"):  # the positive logit is a row-wise dot product, (user * pos).sum(-1):
        positions = int((batch.targets >= 0).sum())  # a [P, d] x [d, 1] matmul that torch does not see as one
        counted += linear_flops(positions, model.cfg.embedding_dim, 1)
    assert counted > 0
    assert claimed == counted, f"{family}: model.flops says {claimed:,}, the matmuls did {counted:,}"


def test_attention_flops_follow_palm():
    """4*H*D per pair forward, backward twice forward (12*H*D), no recompute; Dv may differ from D."""
    assert attention_flops(10, 2, 8, backward=False) == 4 * 2 * 8 * 10
    assert attention_flops(10, 2, 8) == 12 * 2 * 8 * 10
    assert attention_flops(10, 2, 8, 4) == 3 * 2 * 10 * 2 * (8 + 4)
    assert linear_flops(5, 3, 7) == 3 * 2 * 5 * 3 * 7


@pytest.mark.multiprocess
def test_models_count_flops_without_the_trainer():
    """Layers: the model families import ``gemzoo.flops``, never ``gemzoo.train``."""
    import subprocess
    import sys

    code = ("import sys, gemzoo.models.gem, gemzoo.models.hstu, gemzoo.models.retrieval, gemzoo.flops; "
            "print(sorted(m for m in sys.modules if m.startswith('gemzoo.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=hang_guard(300)).stdout.strip()
    assert out == "[]", f"importing the models pulled in {out}"
