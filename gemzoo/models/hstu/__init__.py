"""``hstu``: Hierarchical Sequential Transduction Units (Zhai et al., 2024) for next-item retrieval.

One HSTU block over a jagged batch:

    U, V, Q, K = split(SiLU(uvqk(LayerNorm(X))))
    A = SiLU(Q K^T) / n        causal, pointwise (no softmax); n = max sequence length
    X = X + out(dropout(LayerNorm(A V) * U))

The attention is ``JaggedAttention`` with ``activation="silu"``, ``norm=max_len``, ``scale=1`` (the paper
has no 1/sqrt(d)). The relative attention bias of the paper is not included. The retrieval head and
evaluation are shared with sasrec (gemzoo.models.retrieval).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.errors import ConfigError
from gemzoo.interfaces.attention import AttentionRequest
from gemzoo.interfaces.models import ModelSpec
from gemzoo.models.common import JaggedAttention, self_attention_options, self_attention_pairs
from gemzoo.models.retrieval import RetrievalConfig, RetrievalModel
from gemzoo.flops import attention_flops, linear_flops


@dataclass
class HSTUConfig(RetrievalConfig):
    family: str = "hstu"
    qk_dim: int = 0  # per head; 0: embedding_dim // num_heads
    v_dim: int = 0  # per head; 0: embedding_dim // num_heads
    attention_block_size: int = 0  # self-attention blocks from each sequence's start (0: off)
    attention_window: int = 0  # sliding window (0: off)
    rope_theta: float = 0.0  # RoPE base (0: off); these need a kernel that declares them, e.g. "block-attention"


class HSTUBlock(nn.Module):
    is_transformer_block = True

    def __init__(self, d_model: int, num_heads: int, qk_dim: int, v_dim: int, max_len: int, dropout: float):
        super().__init__()
        self.num_heads, self.qk_dim, self.v_dim = num_heads, qk_dim, v_dim
        self.norm = nn.LayerNorm(d_model)
        self.uvqk = nn.Linear(d_model, num_heads * (2 * v_dim + 2 * qk_dim))
        self.attn = JaggedAttention(AttentionRequest(activation="silu", causal=True, head_dim=qk_dim),
                                    norm=float(max_len), scale=1.0)
        self.attn_norm = nn.LayerNorm(num_heads * v_dim)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(num_heads * v_dim, d_model)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        uvqk = F.silu(self.uvqk(self.norm(x)))
        u, v, q, k = uvqk.split([h * self.v_dim, h * self.v_dim, h * self.qk_dim, h * self.qk_dim], dim=1)
        a = self.attn(q.reshape(t, h, self.qk_dim), k.reshape(t, h, self.qk_dim), v.reshape(t, h, self.v_dim),
                      offsets, max_q_len=max_len, max_k_len=max_len)
        y = self.attn_norm(a.reshape(t, h * self.v_dim).to(x.dtype)) * u.to(x.dtype)
        return x + self.out(self.dropout(y)).to(x.dtype)

    def flops(self, lengths: torch.Tensor) -> int:
        tokens = int(lengths.sum())
        h = self.num_heads
        pairs = self_attention_pairs(lengths, causal=True, **self.attn.mask_options())
        attn = attention_flops(pairs, h, self.qk_dim, self.v_dim)  # QK^T over qk_dim, AV over v_dim
        return (linear_flops(tokens, self.uvqk.in_features, self.uvqk.out_features)
                + linear_flops(tokens, self.out.in_features, self.out.out_features) + attn)


class HSTUModel(RetrievalModel):
    family = "hstu"

    def __init__(self, cfg: HSTUConfig, data_info: dict):
        super().__init__(cfg, data_info)
        d, heads = cfg.embedding_dim, cfg.num_heads
        if (not cfg.qk_dim or not cfg.v_dim) and d % heads:
            raise ConfigError(
                f"[model] (hstu): embedding_dim={d} is not divisible by num_heads={heads}; set qk_dim and v_dim"
            )
        qk_dim, v_dim = cfg.qk_dim or d // heads, cfg.v_dim or d // heads
        if qk_dim < 1 or v_dim < 1:
            raise ConfigError(f"[model] (hstu): qk_dim and v_dim must be >= 1, got {qk_dim} and {v_dim}")
        self.blocks = nn.ModuleList(
            HSTUBlock(d, heads, qk_dim, v_dim, self.max_len, cfg.dropout) for _ in range(cfg.num_layers)
        )
        options = self_attention_options(cfg, qk_dim, "hstu")
        for block in self.blocks:
            block.attn.add_options(**options)


def build(cfg: HSTUConfig, data_info: dict) -> HSTUModel:
    return HSTUModel(cfg, data_info)


SPEC = ModelSpec(HSTUConfig, build, "HSTU: pointwise SiLU attention with U gating; sampled-softmax retrieval")
