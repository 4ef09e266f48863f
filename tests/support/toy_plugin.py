"""A tiny third-party-style plugin (model + dataset) used to test the trainer on its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import gemzoo
from gemzoo.attention import JaggedAttention
from gemzoo.flops import attention_flops, attention_pairs, linear_flops, sample_pairs
from gemzoo.interfaces import AttentionRequest, DatasetSpec, ModelOutput, ModelSpec
from gemzoo.jagged import lengths_to_offsets


@dataclass
class ToyModelConfig:
    family: str = "toy"
    d_model: int = 16
    heads: int = 2
    dropout: float = 0.1


@dataclass
class ToyDataConfig:
    source: str = "toy-data"
    batch_size: int = 8
    max_len: int = 12
    vocab: int = 50


@dataclass
class ToyBatch:
    ids: torch.Tensor
    offsets: torch.Tensor
    labels: torch.Tensor

    def to(self, device):
        return ToyBatch(self.ids.to(device), self.offsets.to(device), self.labels.to(device))

    @property
    def lengths(self):
        return self.offsets.diff()

    @property
    def num_samples(self):
        return self.offsets.numel() - 1

    @property
    def num_tokens(self):
        return self.ids.numel()

    def select(self, idx):
        idx = idx.tolist()
        parts = [self.ids[self.offsets[i]:self.offsets[i + 1]] for i in idx]
        lens = torch.tensor([p.numel() for p in parts], dtype=torch.long)
        ids = torch.cat(parts) if parts else self.ids[:0]
        return ToyBatch(ids, lengths_to_offsets(lens), self.labels[idx])


class ToyDataset:
    def __init__(self, cfg: ToyDataConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.info = {"vocab": cfg.vocab}

    def _batch(self, key: int) -> ToyBatch:
        g = torch.Generator().manual_seed(key)
        lens = torch.randint(0, self.cfg.max_len + 1, (self.cfg.batch_size,), generator=g)
        ids = torch.randint(0, self.cfg.vocab, (int(lens.sum()),), generator=g)
        off = lengths_to_offsets(lens)
        # label: does the sequence contain an id below vocab/4?
        labels = torch.tensor([float((ids[off[i]:off[i + 1]] < self.cfg.vocab // 4).any())
                               for i in range(len(lens))])
        return ToyBatch(ids, off, labels)

    def train_batch(self, step: int) -> ToyBatch:
        return self._batch(self.seed * 1_000_003 + step)

    def eval_batches(self, n: int):
        return [self._batch(-(i + 1) - self.seed * 7919) for i in range(n)]


class ToyModel(nn.Module):
    def __init__(self, cfg: ToyModelConfig, info: dict):
        super().__init__()
        self.cfg = cfg
        self.sparse_arch = None
        self.emb = nn.Embedding(info["vocab"], cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn = JaggedAttention(AttentionRequest(causal=True))
        self.drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(cfg.d_model, 1)

    def init_weights(self):
        nn.init.normal_(self.emb.weight, std=0.5)
        for lin in (self.qkv, self.head):
            nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
            nn.init.zeros_(lin.bias)

    def embedding_tables(self):
        return []

    def transformer_blocks(self):
        return []

    def logits(self, batch):
        h, d = self.cfg.heads, self.cfg.d_model
        x = self.emb(batch.ids)
        q, k, v = self.qkv(x).float().view(-1, 3, h, d // h).unbind(1)
        y = self.attn(q, k, v, batch.offsets).reshape(-1, d)
        y = self.drop(x + y.to(x.dtype))
        pooled = torch.zeros(batch.num_samples, d, dtype=y.dtype, device=y.device)
        seg = torch.repeat_interleave(torch.arange(batch.num_samples, device=y.device), batch.lengths)
        pooled = pooled.index_add(0, seg, y)
        return self.head(pooled).float().squeeze(-1)

    def forward(self, batch):
        loss = F.binary_cross_entropy_with_logits(self.logits(batch), batch.labels)
        return ModelOutput(loss, {})

    def flops(self, batch):
        t, d = batch.num_tokens, self.cfg.d_model
        pairs = attention_pairs(batch.lengths)
        return linear_flops(t, d, 3 * d) + attention_flops(pairs, self.cfg.heads, d // self.cfg.heads)

    def cost_model(self, batch):
        lengths, d = batch.lengths.long(), self.cfg.d_model
        pairs = sample_pairs(lengths, causal=True)
        return (linear_flops(lengths, d, 3 * d) + attention_flops(pairs, self.cfg.heads, d // self.cfg.heads)).double()

    def evaluator(self):
        model = self

        class Acc:
            right = total = 0

            def update(self, batch):
                pred = model.logits(batch) > 0
                self.right += int((pred == batch.labels.bool()).sum())
                self.total += batch.num_samples

            def compute(self):
                return {"accuracy": self.right / max(self.total, 1)}

        return Acc()


class ToyPlugin:
    @gemzoo.hookimpl
    def gemzoo_register_models(self, register):
        register("toy", ModelSpec(ToyModelConfig, ToyModel, "tiny test model"))

    @gemzoo.hookimpl
    def gemzoo_register_datasets(self, register):
        register("toy-data", DatasetSpec(ToyDataConfig, ToyDataset, "tiny test data"))


def install(registry) -> None:
    registry.reset()
    registry.host().register(ToyPlugin(), name="toy-plugin", distribution="gemzoo-toy-tests")


TOY_CONFIG = {
    # cpu even on a GPU machine: these tests pin CPU semantics (bit-exact resume; CUDA's atomics are not)
    "run": {"name": "toy", "steps": 30, "seed": 0, "log_every": 5, "device": "cpu"},
    "model": {"family": "toy"},
    "data": {"source": "toy-data"},
    "optim": {"lr": 1e-2},
    "eval": {"every": 10, "batches": 4},
    "checkpoint": {"every": 10, "keep": 2},
}
