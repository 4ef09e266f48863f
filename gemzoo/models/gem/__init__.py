"""``gem``: a GEM-like ranking model.

    history items --item_emb--> tower.input + recency positions --> tower.blocks (pre-norm, causal)
    candidates    --item_emb--> cand_proj --> cross (candidates attend to their user's history)
    sparse features --SparseArch (torchrec EBC or plain EmbeddingBag)--> sparse_proj
    [cand, cross, cand*cross, sparse, cand*sparse] --> interaction MLP --> head.click, head.conversion

Both attention sites go through JaggedAttention: the tower asks for causal softmax self-attention, the
cross attention for non-causal asymmetric attention (q = a user's candidates, k/v = their history).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.attention import validated_longest
from gemzoo.embedding import SparseArch, TableConfig, torchrec_available
from gemzoo.errors import ConfigError
from gemzoo.flops import attention_flops, linear_flops
from gemzoo.interfaces.attention import ACTIVATIONS, AttentionRequest
from gemzoo.interfaces.models import ModelOutput, ModelSpec, host_view
from gemzoo.interfaces.options import bounded
from gemzoo.jagged import seq_ids
from gemzoo.models.common import (
    MLP,
    JaggedAttention,
    TransformerBlock,
    binary_auc,
    check_heads,
    check_kv_heads,
    init_weights,
    require_data_info,
    reverse_positions,
    self_attention_options,
)


@dataclass
class GemConfig:
    family: str = "gem"
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 0  # k/v heads of the tower and the cross attention: 0 num_heads; a divisor of it: GQA
    head_dim: int = 0  # 0: d_model // num_heads
    ffn_mult: int = 4
    embedding_dim: int = 32  # item and sparse table width
    mlp_dims: list[int] = bounded([128, 64], min=1, length=(1, 0))
    dropout: float = bounded(0.0, min=0, below=1)
    conversion_weight: float = 1.0
    init_std: float = bounded(0.0, min=0)  # linears; 0: 1/sqrt(fan_in)
    embedding_init_std: float = bounded(0.1, min=0)  # item and position embeddings
    # the target-aware cross attention: "softmax", or a pointwise GDPA activation (normalised by the longest
    # history in the batch) served by a kernel that declares it, e.g. [plugins.attention_sites] cross = "gdpa"
    cross_activation: str = "softmax"
    # the tower's self-attention: blocks of this many events from each history's start (GEM's BlockAttention,
    # e.g. 64), a sliding window, RoPE base (0: off each); the kernel must declare them, e.g. "block-attention"
    attention_block_size: int = 0
    attention_window: int = 0
    rope_theta: float = 0.0


class SequenceTower(nn.Module):
    def __init__(self, cfg: GemConfig, head_dim: int, num_kv_heads: int | None = None):
        super().__init__()
        d = cfg.d_model
        self.input = nn.Linear(cfg.embedding_dim, d)
        request = AttentionRequest(activation="softmax", causal=True)
        self.blocks = nn.ModuleList(
            TransformerBlock(d, cfg.num_heads, head_dim, cfg.ffn_mult * d, request=request, dropout=cfg.dropout,
                             num_kv_heads=num_kv_heads)
            for _ in range(cfg.num_layers)
        )
        options = self_attention_options(cfg, head_dim, "gem")
        for block in self.blocks:
            block.attn.attn.add_options(**options)
        self.norm = nn.LayerNorm(d)


class CrossAttention(nn.Module):
    """Each candidate attends to its own user's (encoded) history: non-causal, Lq != Lk; k and v have
    ``num_kv_heads`` heads (fewer than ``num_heads``: grouped-query attention)."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, activation: str = "softmax",
                 num_kv_heads: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        inner = num_heads * head_dim
        self.q = nn.Linear(d_model, inner)
        self.kv = nn.Linear(d_model, 2 * self.num_kv_heads * head_dim)
        self.attn = JaggedAttention(AttentionRequest(activation=activation, causal=False, asymmetric=True,
                                                     head_dim=head_dim, grouped_kv=self.num_kv_heads != num_heads))
        self.out = nn.Linear(inner, d_model)

    def forward(self, cand, hist, cand_offsets, hist_offsets, max_cand: int, max_hist: int):
        c, t = cand.shape[0], hist.shape[0]
        q = self.q(cand)
        h = q.shape[1] // self.head_dim  # from the projection's output: this rank's heads under run.mesh tp
        q = q.view(c, h, self.head_dim)
        kv = self.kv(hist)
        k, v = kv.view(t, 2, kv.shape[1] // (2 * self.head_dim), self.head_dim).unbind(1)
        extra = {} if self.attn.request.activation == "softmax" else {"norm": float(max(max_hist, 1))}
        o = self.attn(q, k, v, cand_offsets, hist_offsets, max_q_len=max_cand, max_k_len=max_hist, **extra)
        return self.out(o.reshape(c, h * self.head_dim)).to(cand.dtype)


class GemModel(nn.Module):
    def __init__(self, cfg: GemConfig, data_info: dict):
        super().__init__()
        require_data_info("gem", data_info, "ranking",
                          'use [data] source = "synthetic-gem" (or pick model family hstu / sasrec)')
        if cfg.d_model < 1 or cfg.num_layers < 0 or cfg.embedding_dim < 1 or cfg.ffn_mult < 1:
            raise ConfigError(
                f"[model] needs d_model, embedding_dim, ffn_mult >= 1 and num_layers >= 0; got d_model={cfg.d_model}, "
                f"embedding_dim={cfg.embedding_dim}, ffn_mult={cfg.ffn_mult}, num_layers={cfg.num_layers}"
            )
        if not cfg.mlp_dims or min(cfg.mlp_dims) < 1:
            raise ConfigError(f"[model] mlp_dims must list positive hidden sizes, e.g. [128, 64]; got {cfg.mlp_dims}")
        self.cfg = cfg
        d = cfg.d_model
        head_dim = check_heads(d, cfg.num_heads, cfg.head_dim or None, "gem")
        kv_heads = check_kv_heads(cfg.num_heads, cfg.num_kv_heads, "gem")
        self.max_len = int(data_info["max_len"])
        self.item_emb = nn.Embedding(int(data_info["num_items"]), cfg.embedding_dim)
        self.pos_emb = nn.Embedding(self.max_len, d)
        self.dropout = nn.Dropout(cfg.dropout)
        self.tower = SequenceTower(cfg, head_dim, kv_heads)
        self.cand_proj = nn.Linear(cfg.embedding_dim, d)
        if cfg.cross_activation not in ACTIVATIONS:
            raise ConfigError(f"[model] cross_activation must be one of {', '.join(ACTIVATIONS)}; "
                              f"got {cfg.cross_activation!r}")
        self.cross = CrossAttention(d, cfg.num_heads, head_dim, cfg.cross_activation, kv_heads)
        self.tables = [
            TableConfig(t["name"], int(t["num_embeddings"]), cfg.embedding_dim, list(t["feature_names"]))
            for t in data_info.get("sparse_tables", [])
        ]
        if self.tables:
            self.sparse_arch = SparseArch(self.tables)
            self.sparse_proj = nn.Linear(cfg.embedding_dim * len(self.tables), d)
        else:
            self.sparse_arch = None
            self.sparse_proj = None
        n_feat = 5 if self.tables else 3
        self.interaction = MLP([n_feat * d, *cfg.mlp_dims], dropout=cfg.dropout)
        last = cfg.mlp_dims[-1]
        self.head = nn.ModuleDict({"click": nn.Linear(last, 1), "conversion": nn.Linear(last, 1)})

    # -- trainer API -------------------------------------------------------------------------------
    def init_weights(self) -> None:
        skip = (self.sparse_arch,) if self.sparse_arch is not None else ()
        init_weights(self, std=self.cfg.init_std, embedding_std=self.cfg.embedding_init_std, skip=skip)
        if self.sparse_arch is not None:
            self.sparse_arch.init_weights()

    def transformer_blocks(self) -> list[nn.Module]:
        return list(self.tower.blocks)

    def tp_plan(self) -> dict[str, str]:
        """Tensor parallelism (``run.mesh`` tp) beyond the tower's blocks: the cross attention's heads (q, the
        fused kv, out) and the interaction MLP's hidden units, in column-wise / row-wise pairs."""
        plan = {"cross.q": "colwise", "cross.kv": "colwise:2", "cross.out": "rowwise"}
        layers = len(self.interaction.layers)
        for i in range(0, layers - layers % 2, 2):
            plan[f"interaction.layers.{i}"] = "colwise"
            plan[f"interaction.layers.{i + 1}"] = "rowwise"
        return plan

    def embedding_tables(self) -> list:
        if self.sparse_arch is not None and self.sparse_arch.engine == "torchrec" and torchrec_available():
            return [t.to_torchrec() for t in self.tables]
        return list(self.tables)

    def logits(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.pos_emb.weight.dtype
        hist, hist_off = batch.history_items, batch.history_offsets
        cand, cand_off = batch.cand_items, batch.cand_offsets
        t, c = hist.numel(), cand.numel()
        # validated here, where the reads of the offsets wait only for the batch's copy; the attention sites
        # then trust them (validated_longest), so no later layer waits for the device
        host = host_view(batch)  # the batch before its copy to the device: read without waiting for it
        max_hist = validated_longest(hist_off, t, device=hist.device, name="history_offsets",
                                     host=host.history_offsets)
        max_cand = validated_longest(cand_off, c, device=cand.device, name="cand_offsets", host=host.cand_offsets)
        if max_hist > self.max_len:
            raise ConfigError(
                f"a history has {max_hist} events but the model was built for max_len={self.max_len}; "
                "raise [data] max_len or truncate the histories"
            )
        # The sparse lookups first: splitting their ids per feature is a host sync, which here waits only for the
        # batch's copy; after the tower it would wait for the whole tower and leave the device idle meanwhile.
        pooled = None
        if self.sparse_arch is not None:
            pooled = self.sparse_arch(batch.sparse_keys, batch.sparse_values, batch.sparse_lengths,
                                      host.sparse_lengths).to(dtype)
        x = self.tower.input(self.item_emb(hist)).to(dtype)
        x = self.dropout(x + self.pos_emb(reverse_positions(hist_off, t, self.max_len)))
        for block in self.tower.blocks:
            x = block(x, hist_off, max_hist)
        h = self.tower.norm(x)

        ce = self.cand_proj(self.item_emb(cand)).to(dtype)
        cross = self.cross(ce, h, cand_off, hist_off, max_cand, max_hist)
        feats = [ce, cross, ce * cross]
        if pooled is not None:
            # index_select, not s[ids]: its CPU backward (index_add) is deterministic, so resume is bit-exact
            s = self.sparse_proj(pooled).to(dtype).index_select(0, seq_ids(cand_off, c))
            feats += [s, ce * s]
        z = self.interaction(torch.cat(feats, dim=1))
        return self.head["click"](z).to(dtype).squeeze(1), self.head["conversion"](z).to(dtype).squeeze(1)

    def forward(self, batch) -> ModelOutput:
        click_logit, conv_logit = self.logits(batch)
        loss_click = F.binary_cross_entropy_with_logits(click_logit, batch.click.to(click_logit.dtype))
        loss_conv = F.binary_cross_entropy_with_logits(conv_logit, batch.conversion.to(conv_logit.dtype))
        loss = loss_click + self.cfg.conversion_weight * loss_conv
        # 0-dim tensors, read once the step is done: a float() here would wait for the forward before the backward
        return ModelOutput(loss, {"loss_click": loss_click.detach(), "loss_conversion": loss_conv.detach()})

    def flops(self, batch) -> int:
        cfg, d = self.cfg, self.cfg.d_model
        lengths = batch.lengths.cpu()
        cand_lengths = (batch.cand_offsets[1:] - batch.cand_offsets[:-1]).cpu()
        t, c, b = int(lengths.sum()), int(cand_lengths.sum()), lengths.numel()
        f = linear_flops(t, cfg.embedding_dim, d) + sum(blk.flops(lengths) for blk in self.tower.blocks)
        x = self.cross
        inner = x.num_heads * x.head_dim
        f += linear_flops(c, cfg.embedding_dim, d) + linear_flops(c, d, inner) + linear_flops(t, d, x.kv.out_features)
        f += linear_flops(c, inner, d) + attention_flops(int((cand_lengths * lengths).sum()), x.num_heads, x.head_dim)
        if self.sparse_proj is not None:
            f += linear_flops(b, self.sparse_proj.in_features, d)
        f += self.interaction.flops(c) + sum(linear_flops(c, h.in_features, 1) for h in self.head.values())
        return int(f)

    def cost_model(self, batch) -> torch.Tensor:
        """float64 [B]: each user's share of ``flops(batch)``: history tokens through the tower (attention
        over its causal pairs), candidates through cross attention (candidates x history pairs) and the head."""
        cfg, d, x = self.cfg, self.cfg.d_model, self.cross
        lengths, cands = batch.lengths.long().cpu(), batch.cand_lengths.long().cpu()
        inner = x.num_heads * x.head_dim
        f = linear_flops(lengths, cfg.embedding_dim, d) + sum(blk.sample_flops(lengths) for blk in self.tower.blocks)
        f = f + linear_flops(cands, cfg.embedding_dim, d) + linear_flops(cands, d, inner)
        f = f + linear_flops(lengths, d, x.kv.out_features) + linear_flops(cands, inner, d)
        f = f + attention_flops(cands * lengths, x.num_heads, x.head_dim)
        if self.sparse_proj is not None:
            f = f + linear_flops(1, self.sparse_proj.in_features, d)
        f = f + self.interaction.flops(cands) + sum(linear_flops(cands, h.in_features, 1) for h in self.head.values())
        return f.double()

    def evaluator(self) -> GemEvaluator:
        return GemEvaluator(self)


class GemEvaluator:
    """Held-out AUC (rank-based, ties count one half) and log loss for each task."""

    def __init__(self, model: GemModel):
        self.model = model
        self.scores: dict[str, list[torch.Tensor]] = {"click": [], "conversion": []}
        self.labels: dict[str, list[torch.Tensor]] = {"click": [], "conversion": []}

    def update(self, batch) -> None:
        click_logit, conv_logit = self.model.logits(batch)
        for task, logit in (("click", click_logit), ("conversion", conv_logit)):
            self.scores[task].append(logit.detach().float().cpu())
            self.labels[task].append(getattr(batch, task).detach().float().cpu())

    def compute(self) -> dict[str, float]:
        out = {}
        for task in ("click", "conversion"):
            if not self.scores[task]:
                continue
            s, y = torch.cat(self.scores[task]), torch.cat(self.labels[task])
            out[f"auc_{task}"] = binary_auc(s, y)
            out[f"logloss_{task}"] = float(F.binary_cross_entropy_with_logits(s, y))
        return out


def build(cfg: GemConfig, data_info: dict) -> GemModel:
    return GemModel(cfg, data_info)


SPEC = ModelSpec(GemConfig, build, "GEM-like ranking: jagged history tower, target-aware cross attention, "
                                   "pooled sparse features, click + conversion heads")
