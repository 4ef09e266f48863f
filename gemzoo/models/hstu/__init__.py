"""``hstu``: Hierarchical Sequential Transduction Units (Zhai et al., 2024) for next-item retrieval.

One HSTU block over a jagged batch:

    U, V, Q, K = split(SiLU(uvqk(LayerNorm(X))))
    A = SiLU(Q K^T) / n        causal, pointwise (no softmax); n = attention_norm (0: the data's max_len)
    X = X + out(dropout(LayerNorm(A V) * U))

The attention is ``JaggedAttention`` with ``activation="silu"``, ``norm=max_len``, ``scale=1`` (the paper
has no 1/sqrt(d)). ``relative_bias`` adds the paper's relative attention bias to QK^T before the SiLU, each
block with its own weights: ``"position"`` a learned w[i - j]; ``"position_time"`` also a learned weight per
time bucket floor(ln(max(|t_next(i) - t_j|, 1)) / 0.301), clamped to [0, time_buckets], where t_next(i) is
the timestamp of the item that follows query i (the batch's ``next_times``). Each block passes its tables and
the batch's timestamps as a :class:`RelativeAttentionBias`, which the kernel computes inside its tiles (no
[B, L, L] tensor); the site requests ``relative_bias``, served by a kernel that declares it (``cpu``, ``gdpa``,
``reference``) or, materialised, by one that declares ``bias`` (``sdpa-padded``). The retrieval head and
evaluation are shared with sasrec (gemzoo.models.retrieval).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.attention import JaggedAttention
from gemzoo.errors import ConfigError
from gemzoo.flops import attention_flops, linear_flops, sample_pairs
from gemzoo.interfaces.attention import AttentionRequest, RelativeAttentionBias
from gemzoo.interfaces.models import ModelSpec
from gemzoo.interfaces.options import bounded
from gemzoo.models.common import check_kv_heads, init_weights, self_attention_options, self_attention_pairs
from gemzoo.models.retrieval import RetrievalConfig, RetrievalModel, trunc_normal


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
    """One block's learned relative attention bias: ``pos[i - j]`` (+ ``time[bucket]``), as the
    :class:`RelativeAttentionBias` the attention kernel computes (gemzoo.attention.relative_bias_block is its
    definition: i - j clamped to [0, max_len - 1], the bucket's log in float32, clamped to [0, time_buckets])."""

    def __init__(self, max_len: int, time_buckets: int | None):
        super().__init__()
        self.pos = nn.Parameter(torch.empty(max_len))
        self.time = nn.Parameter(torch.empty(time_buckets + 1)) if time_buckets is not None else None

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.02)

    def forward(self, times: torch.Tensor | None = None, next_times: torch.Tensor | None = None
                ) -> RelativeAttentionBias:
        """The bias for a batch: query i is compared at ``next_times[i]`` (the item after it) with each key's
        own time ``times[j]`` (both int64 [T], jagged like the batch); positions only without time buckets."""
        if self.time is None:
            return RelativeAttentionBias(self.pos)
        if times is None or next_times is None:
            raise ValueError("this relative bias has time buckets: pass the batch's times and next_times")
        return RelativeAttentionBias(self.pos, self.time, q_times=next_times.long(), k_times=times.long())


class HSTUBlock(nn.Module):
    is_transformer_block = True

    def __init__(self, d_model: int, num_heads: int, qk_dim: int, v_dim: int, max_len: int, dropout: float, *,
                 affine: bool = True, uvqk_bias: bool = True, relative_bias: str = "none", time_buckets: int = 128,
                 attention_norm: float = 0.0, num_kv_heads: int | None = None):
        super().__init__()
        self.num_heads, self.qk_dim, self.v_dim = num_heads, qk_dim, v_dim
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads  # of k and v (GQA when fewer)
        eps = 1e-5 if affine else 1e-6  # the reference's F.layer_norm(eps=1e-6) has no affine parameters
        self.norm = nn.LayerNorm(d_model, eps=eps, elementwise_affine=affine)
        self.uvqk = nn.Linear(d_model, sum(self.parts(num_heads)), bias=uvqk_bias)
        self.attn = JaggedAttention(AttentionRequest(activation="silu", causal=True, head_dim=qk_dim,
                                                     relative_bias=relative_bias != "none",
                                                     grouped_kv=self.num_kv_heads != num_heads),
                                    norm=float(attention_norm or max_len), scale=1.0)
        self.attn_norm = nn.LayerNorm(num_heads * v_dim, eps=eps, elementwise_affine=affine)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(num_heads * v_dim, d_model)
        self.rel_bias = (RelativeBias(max_len, time_buckets if relative_bias == "position_time" else None)
                         if relative_bias != "none" else None)

    def parts(self, heads: int) -> list[int]:
        """Widths of uvqk's parts u | v | q | k for ``heads`` query heads: u and q per query head, v and k per
        k/v head (heads * num_kv_heads / num_heads of them)."""
        kv = heads * self.num_kv_heads // self.num_heads
        return [heads * self.v_dim, kv * self.v_dim, heads * self.qk_dim, kv * self.qk_dim]

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None,
                times: torch.Tensor | None = None, next_times: torch.Tensor | None = None) -> torch.Tensor:
        """``times``, ``next_times``: the batch's int64 [T] timestamps, for a relative bias with time buckets."""
        uvqk = F.silu(self.uvqk(self.norm(x)))
        # heads from the projection's output width: this rank's under run.mesh tp
        t, h = x.shape[0], uvqk.shape[1] * self.num_heads // sum(self.parts(self.num_heads))
        u, v, q, k = uvqk.split(self.parts(h), dim=1)
        extra = {}
        if self.rel_bias is not None:
            extra["relative_bias"] = self.rel_bias(times, next_times)
        a = self.attn(q.reshape(t, h, self.qk_dim), k.reshape(t, -1, self.qk_dim), v.reshape(t, -1, self.v_dim),
                      offsets, max_q_len=max_len, max_k_len=max_len, **extra)
        y = self.attn_norm(a.reshape(t, h * self.v_dim).to(x.dtype)) * u.to(x.dtype)
        return x + self.out(self.dropout(y)).to(x.dtype)

    def tp_plan(self) -> dict[str, str]:
        """Tensor parallelism (``run.mesh`` tp): uvqk column-wise with its four parts (u | v | q | k) each split by
        heads, out row-wise; attn_norm normalises over every head's output, so its statistics are summed over tp;
        the relative bias, added for every head, gets its gradient summed over tp."""
        plan = {"uvqk": "colwise:" + ",".join(str(n) for n in self.parts(self.num_heads)), "attn_norm": "layernorm",
                "out": "rowwise"}
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
        kv_heads = check_kv_heads(heads, cfg.num_kv_heads, "hstu")
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
                      attention_norm=cfg.attention_norm, num_kv_heads=kv_heads)
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
        times = next_times = None
        if self.cfg.relative_bias == "position_time":
            if batch.times is None or batch.next_times is None:
                raise ConfigError("[model] (hstu): relative_bias = 'position_time' needs batches with times "
                                  "and next_times; use relative_bias = 'position'")
            times, next_times = batch.times, batch.next_times
        for block in self.blocks:
            x = block(x, batch.offsets, longest, times, next_times)
        return x


def build(cfg: HSTUConfig, data_info: dict) -> HSTUModel:
    return HSTUModel(cfg, data_info)


SPEC = ModelSpec(HSTUConfig, build, "HSTU: pointwise SiLU attention with U gating; sampled-softmax retrieval")
