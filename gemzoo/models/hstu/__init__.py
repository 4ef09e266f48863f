"""``hstu``: Hierarchical Sequential Transduction Units (Zhai et al., 2024) for next-item retrieval.

One HSTU block over a jagged batch:

    U, V, Q, K = split(SiLU(uvqk(LayerNorm(X))))
    A = SiLU(Q K^T) / n        causal, pointwise (no softmax); n = attention_norm (0: the data's max_len)
    X = X + out(dropout(LayerNorm(A V) * U))

The attention is ``JaggedAttention`` with ``activation="silu"``, ``norm=max_len``, ``scale=1`` (the paper
has no 1/sqrt(d)). ``relative_bias`` adds the paper's relative attention bias to QK^T before the SiLU, each
block with its own weights: ``"position"`` a learned w[i - j]; ``"position_time"`` also a learned weight per
time bucket floor(ln(max(|t_next(i) - t_j|, 1)) / 0.301), clamped to [0, time_buckets], where t_next(i) is
the timestamp of the item that follows query i (the batch's ``next_times``). The site then requests the
``bias`` capability. The retrieval head and evaluation are shared with sasrec (gemzoo.models.retrieval).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.attention import JaggedAttention
from gemzoo.errors import ConfigError
from gemzoo.flops import attention_flops, linear_flops, sample_pairs
from gemzoo.interfaces.attention import TIME_BUCKET_DIVISOR, AttentionRequest
from gemzoo.interfaces.models import ModelSpec
from gemzoo.interfaces.options import bounded
from gemzoo.models.common import init_weights, self_attention_options, self_attention_pairs
from gemzoo.models.retrieval import RetrievalConfig, RetrievalModel, trunc_normal
from gemzoo.ops import jagged_to_padded


@dataclass
class HSTUConfig(RetrievalConfig):
    family: str = "hstu"
    qk_dim: int = 0  # per head; 0: embedding_dim // num_heads
    v_dim: int = 0  # per head; 0: embedding_dim // num_heads
    attention_block_size: int = 0  # self-attention blocks from each sequence's start (0: off)
    attention_window: int = 0  # sliding window (0: off)
    rope_theta: float = 0.0  # RoPE base (0: off); these need a kernel that declares them, e.g. "block-attention"
    uvqk_bias: bool = True  # a bias on the uvqk projection (the reference has none)
    relative_bias: str = "none"  # "none", "position" or "position_time" (needs timestamps in the data)
    time_buckets: int = 128
    # n of A = SiLU(QK^T) / n; 0: the data's max_len. The HSTU reference divides by its padded length, max_len
    # plus the 10 it reserves and the next item (211 for ML-1M's 200); the LayerNorm after A V does not cancel it
    # at initialisation (A V / n is far below its eps), so the value matters
    attention_norm: float = bounded(0.0, min=0)


class RelativeBias(nn.Module):
    """One block's learned relative attention bias: ``pos[i - j]`` (+ ``time[bucket]``)."""

    def __init__(self, max_len: int, time_buckets: int | None):
        super().__init__()
        self.pos = nn.Parameter(torch.empty(max_len))
        self.time = nn.Parameter(torch.empty(time_buckets + 1)) if time_buckets is not None else None

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.02)

    def forward(self, distance: torch.Tensor, bucket: torch.Tensor | None) -> torch.Tensor:
        """[B, 1, L, L] from relative distances and time buckets (both [B, L, L], int64)."""
        bias = self.pos[distance]
        if self.time is not None:
            bias = bias + self.time[bucket]
        return bias.unsqueeze(1)


def time_buckets(times: torch.Tensor, next_times: torch.Tensor, offsets: torch.Tensor, longest: int,
                 num_buckets: int) -> torch.Tensor:
    """[B, L, L] bucket of t_next(i) - t_j for query i and key j of each sequence (padding: bucket 0)."""
    t = jagged_to_padded(times.unsqueeze(1).double(), offsets, longest).squeeze(-1)  # [B, L]
    tn = jagged_to_padded(next_times.unsqueeze(1).double(), offsets, longest).squeeze(-1)
    gap = (tn.unsqueeze(2) - t.unsqueeze(1)).abs().clamp(min=1.0)  # float64: exact for integer timestamps
    # the log in float32, as the reference takes it (torch.log of an int64 tensor): in float64 a few gaps whose
    # log lands next to a bucket edge fall one bucket apart
    return (gap.float().log() / TIME_BUCKET_DIVISOR).long().clamp(0, num_buckets)


class HSTUBlock(nn.Module):
    is_transformer_block = True

    def __init__(self, d_model: int, num_heads: int, qk_dim: int, v_dim: int, max_len: int, dropout: float, *,
                 affine: bool = True, uvqk_bias: bool = True, relative_bias: str = "none", time_buckets: int = 128,
                 attention_norm: float = 0.0):
        super().__init__()
        self.num_heads, self.qk_dim, self.v_dim = num_heads, qk_dim, v_dim
        eps = 1e-5 if affine else 1e-6  # the reference's F.layer_norm(eps=1e-6) has no affine parameters
        self.norm = nn.LayerNorm(d_model, eps=eps, elementwise_affine=affine)
        self.uvqk = nn.Linear(d_model, num_heads * (2 * v_dim + 2 * qk_dim), bias=uvqk_bias)
        self.attn = JaggedAttention(AttentionRequest(activation="silu", causal=True, head_dim=qk_dim,
                                                     bias=relative_bias != "none"),
                                    norm=float(attention_norm or max_len), scale=1.0)
        self.attn_norm = nn.LayerNorm(num_heads * v_dim, eps=eps, elementwise_affine=affine)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(num_heads * v_dim, d_model)
        self.rel_bias = (RelativeBias(max_len, time_buckets if relative_bias == "position_time" else None)
                         if relative_bias != "none" else None)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None,
                relative: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """``relative``: (distance, bucket) for this batch when the block has a relative bias."""
        uvqk = F.silu(self.uvqk(self.norm(x)))
        # heads from the projection's output width: this rank's under run.mesh tp
        t, h = x.shape[0], uvqk.shape[1] // (2 * self.v_dim + 2 * self.qk_dim)
        u, v, q, k = uvqk.split([h * self.v_dim, h * self.v_dim, h * self.qk_dim, h * self.qk_dim], dim=1)
        extra = {}
        if self.rel_bias is not None:
            if relative is None:
                raise ValueError("this HSTU block has a relative attention bias: pass relative=(distance, bucket)")
            extra["bias"] = self.rel_bias(*relative)
        a = self.attn(q.reshape(t, h, self.qk_dim), k.reshape(t, h, self.qk_dim), v.reshape(t, h, self.v_dim),
                      offsets, max_q_len=max_len, max_k_len=max_len, **extra)
        y = self.attn_norm(a.reshape(t, h * self.v_dim).to(x.dtype)) * u.to(x.dtype)
        return x + self.out(self.dropout(y)).to(x.dtype)

    def tp_plan(self) -> dict[str, str]:
        """Tensor parallelism (``run.mesh`` tp): uvqk column-wise with its four parts (u | v | q | k) each split by
        heads, out row-wise; attn_norm normalises over every head's output, so its statistics are summed over tp;
        the relative bias, added for every head, gets its gradient summed over tp."""
        h, v, qk = self.num_heads, self.v_dim, self.qk_dim
        plan = {"uvqk": f"colwise:{h * v},{h * v},{h * qk},{h * qk}", "attn_norm": "layernorm", "out": "rowwise"}
        if self.rel_bias is not None:
            plan["rel_bias"] = "sum_grad"
        return plan

    def flops(self, lengths: torch.Tensor) -> int:
        tokens = int(lengths.sum())
        h = self.num_heads
        pairs = self_attention_pairs(lengths, causal=True, **self.attn.mask_options())
        attn = attention_flops(pairs, h, self.qk_dim, self.v_dim)  # QK^T over qk_dim, AV over v_dim
        return (linear_flops(tokens, self.uvqk.in_features, self.uvqk.out_features)
                + linear_flops(tokens, self.out.in_features, self.out.out_features) + attn)

    def sample_flops(self, lengths: torch.Tensor) -> torch.Tensor:
        """int64 [B]: each sequence's share of ``flops(lengths)``."""
        lengths = lengths.long().cpu()
        attn = attention_flops(sample_pairs(lengths, causal=True, **self.attn.mask_options()), self.num_heads, self.qk_dim, self.v_dim)
        return (linear_flops(lengths, self.uvqk.in_features, self.uvqk.out_features)
                + linear_flops(lengths, self.out.in_features, self.out.out_features) + attn)


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
        if cfg.relative_bias not in ("none", "position", "position_time"):
            raise ConfigError(f"[model] (hstu): relative_bias must be 'none', 'position' or 'position_time', "
                              f"got {cfg.relative_bias!r}")
        if cfg.time_buckets < 1:
            raise ConfigError(f"[model] (hstu): time_buckets must be >= 1, got {cfg.time_buckets}")
        if cfg.relative_bias == "position_time" and not data_info.get("timestamps"):
            raise ConfigError("[model] (hstu): relative_bias = 'position_time' needs timestamps, which this dataset "
                              "does not provide; use relative_bias = 'position'")
        self.blocks = nn.ModuleList(
            HSTUBlock(d, heads, qk_dim, v_dim, self.max_len, cfg.dropout, affine=cfg.norm_affine,
                      uvqk_bias=cfg.uvqk_bias, relative_bias=cfg.relative_bias, time_buckets=cfg.time_buckets,
                      attention_norm=cfg.attention_norm)
            for _ in range(cfg.num_layers)
        )
        options = self_attention_options(cfg, qk_dim, "hstu")
        for block in self.blocks:
            block.attn.add_options(**options)

    def _bias_modules(self) -> list[nn.Module]:
        return [b.rel_bias for b in self.blocks if b.rel_bias is not None]

    def init_weights(self) -> None:
        if self.cfg.init == "reference":
            self.reference_init()
            return
        init_weights(self, std=self.cfg.init_std, skip=tuple(self._bias_modules()))
        for m in self._bias_modules():
            m.reset_parameters()

    def reference_init(self) -> None:
        """As the reference: items truncated normal 0.02, positions Xavier-normal, uvqk normal 0.02 (bias 0),
        output Xavier-uniform with torch's default bias, relative-bias weights normal 0.02, norms 1 / 0."""
        with torch.no_grad():
            trunc_normal(self.item_emb.weight, 0.02)
            nn.init.xavier_normal_(self.pos_emb.weight)
            for block in self.blocks:
                block.uvqk.weight.normal_(0.0, 0.02)
                if block.uvqk.bias is not None:
                    block.uvqk.bias.zero_()
                nn.init.xavier_uniform_(block.out.weight)
                bound = block.out.in_features ** -0.5
                block.out.bias.uniform_(-bound, bound)
                for norm in (block.norm, block.attn_norm):
                    if norm.weight is not None:
                        norm.weight.fill_(1.0)
                        norm.bias.zero_()
                if block.rel_bias is not None:
                    block.rel_bias.reset_parameters()

    def run_blocks(self, x: torch.Tensor, batch, longest: int) -> torch.Tensor:
        relative = None
        if self._bias_modules():
            i = torch.arange(longest, device=x.device)
            distance = (i.view(-1, 1) - i.view(1, -1)).clamp(0, self.max_len - 1)  # [L, L]: i - j, causal part
            distance = distance.expand(batch.offsets.numel() - 1, -1, -1)  # [B, L, L]
            bucket = None
            if self.cfg.relative_bias == "position_time":
                if batch.times is None or batch.next_times is None:
                    raise ConfigError("[model] (hstu): relative_bias = 'position_time' needs batches with times "
                                      "and next_times; use relative_bias = 'position'")
                bucket = time_buckets(batch.times, batch.next_times, batch.offsets, longest, self.cfg.time_buckets)
            relative = (distance, bucket)
        for block in self.blocks:
            x = block(x, batch.offsets, longest, relative)
        return x


def build(cfg: HSTUConfig, data_info: dict) -> HSTUModel:
    return HSTUModel(cfg, data_info)


SPEC = ModelSpec(HSTUConfig, build, "HSTU: pointwise SiLU attention with U gating; sampled-softmax retrieval")
