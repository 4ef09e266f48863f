"""``sasrec``: SASRec (Kang & McAuley, 2018), a causal softmax transformer for next-item retrieval.

Two block layouts (``block``):

- ``"prenorm"``: x + attn(LN(x)), then x + FFN(LN(x)), and a final LayerNorm;
- ``"reference"``: the HSTU reference code's SASRec: Q = LN(x); A = attn(Q, x, x); z = LN(Q + A);
  out = z + dropout(FFN(z)); no final LayerNorm (the retrieval head L2-normalises anyway).
  ``attn_dropout`` drops the attention output (the reference drops attention probabilities, which the
  kernel interface does not expose).

The ReLU feed-forward has width ``ffn_mult * embedding_dim``. The retrieval head and evaluation are shared
with hstu (gemzoo.models.retrieval).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gemzoo.attention import JaggedAttention
from gemzoo.errors import ConfigError
from gemzoo.flops import attention_flops, linear_flops
from gemzoo.interfaces.attention import AttentionRequest
from gemzoo.interfaces.models import ModelSpec
from gemzoo.interfaces.options import bounded
from gemzoo.models.common import FeedForward, TransformerBlock, check_heads, check_kv_heads, self_attention_pairs
from gemzoo.models.retrieval import RetrievalConfig, RetrievalModel, trunc_normal


@dataclass
class SASRecConfig(RetrievalConfig):
    family: str = "sasrec"
    ffn_mult: int = 1  # SASRec's point-wise feed-forward keeps the model width
    block: str = "prenorm"  # "prenorm" or "reference" (the HSTU reference code's SASRec layer)
    attn_dropout: float = bounded(0.0, min=0, below=1)  # "reference" block: dropout on the attention output


class SASRecReferenceBlock(nn.Module):
    """Q = LN(x); A = out(attn(q(Q), k(x), v(x))); z = LN(Q + dropout(A)); z + dropout(FFN(z))."""

    is_transformer_block = True

    def __init__(self, d_model: int, num_heads: int, head_dim: int, ffn_hidden: int, *, request: AttentionRequest,
                 dropout: float, attn_dropout: float, affine: bool, num_kv_heads: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads  # of k and v (GQA when fewer)
        inner = num_heads * head_dim
        self.norm1 = nn.LayerNorm(d_model, eps=1e-8, elementwise_affine=affine)
        self.q = nn.Linear(d_model, inner)
        self.kv = nn.Linear(d_model, 2 * self.num_kv_heads * head_dim)
        self.attn = JaggedAttention(request.replace(head_dim=head_dim, grouped_kv=self.num_kv_heads != num_heads))
        self.out = nn.Linear(inner, d_model)
        self.attn_dropout = nn.Dropout(attn_dropout)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-8, elementwise_affine=affine)
        self.mlp = FeedForward(d_model, ffn_hidden, "relu", dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qn = self.norm1(x)
        q = self.q(qn)
        h = q.shape[1] // d  # from the projection's output: this rank's heads under run.mesh tp
        q = q.view(t, h, d)
        kv = self.kv(x)
        k, v = kv.view(t, 2, kv.shape[1] // (2 * d), d).unbind(1)
        a = self.attn(q, k, v, offsets, max_q_len=max_len, max_k_len=max_len)
        a = self.out(a.reshape(t, h * d).to(x.dtype)).to(x.dtype)
        z = self.norm2(qn + self.attn_dropout(a))
        return z + self.dropout(self.mlp(z))

    def tp_plan(self) -> dict[str, str]:
        """Tensor parallelism (``run.mesh`` tp): heads and MLP hidden units split across ranks; ``colwise:2``:
        the fused kv projection, k and v each split by heads."""
        return {"q": "colwise", "kv": "colwise:2", "out": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}

    def flops(self, lengths: torch.Tensor) -> int:
        tokens = int(lengths.sum())
        inner = self.num_heads * self.head_dim
        pairs = self_attention_pairs(lengths, causal=True)
        return (linear_flops(tokens, self.q.in_features, inner)
                + linear_flops(tokens, self.kv.in_features, self.kv.out_features)
                + linear_flops(tokens, inner, self.out.out_features)
                + attention_flops(pairs, self.num_heads, self.head_dim) + self.mlp.flops(tokens))


class SASRecModel(RetrievalModel):
    family = "sasrec"

    def __init__(self, cfg: SASRecConfig, data_info: dict):
        super().__init__(cfg, data_info)
        if cfg.block not in ("prenorm", "reference"):
            raise ConfigError(f"[model] (sasrec): block must be 'prenorm' or 'reference', got {cfg.block!r}")
        if not 0.0 <= cfg.attn_dropout < 1.0:
            raise ConfigError(f"[model] (sasrec): attn_dropout must be in [0, 1), got {cfg.attn_dropout}")
        d = cfg.embedding_dim
        head_dim = check_heads(d, cfg.num_heads, None, "sasrec")
        kv_heads = check_kv_heads(cfg.num_heads, cfg.num_kv_heads, "sasrec")
        request = AttentionRequest(activation="softmax", causal=True)
        hidden = max(1, cfg.ffn_mult) * d
        if cfg.block == "reference":
            self.blocks = nn.ModuleList(
                SASRecReferenceBlock(d, cfg.num_heads, head_dim, hidden, request=request, dropout=cfg.dropout,
                                     attn_dropout=cfg.attn_dropout, affine=cfg.norm_affine, num_kv_heads=kv_heads)
                for _ in range(cfg.num_layers)
            )
        else:
            self.blocks = nn.ModuleList(
                TransformerBlock(d, cfg.num_heads, head_dim, hidden, request=request,
                                 dropout=cfg.dropout, activation="relu", num_kv_heads=kv_heads)
                for _ in range(cfg.num_layers)
            )
            self.output_norm = nn.LayerNorm(d)

    def reference_init(self) -> None:
        """As the reference: items truncated normal 0.02, positions truncated normal sqrt(1/d); attention
        weights Xavier-normal over the fused [3 inner, d] in-projection, zero attention biases; FFN weights
        Xavier-normal with torch's default biases; norms 1 / 0."""
        d = self.cfg.embedding_dim
        with torch.no_grad():
            trunc_normal(self.item_emb.weight, 0.02)
            trunc_normal(self.pos_emb.weight, d ** -0.5)
            for m in self.modules():
                if isinstance(m, nn.LayerNorm) and m.weight is not None:
                    m.weight.fill_(1.0)
                    m.bias.zero_()
            for block in self.blocks:
                attn = block if isinstance(block, SASRecReferenceBlock) else block.attn
                lins = (attn.q, attn.kv) if hasattr(attn, "q") else (attn.qkv,)
                fused = sum(lin.out_features for lin in lins)  # 3 inner, less with grouped k/v
                std_in = (2.0 / (d + fused)) ** 0.5  # xavier_normal_ of the fused in-projection
                for lin in lins:
                    lin.weight.normal_(0.0, std_in)
                    lin.bias.zero_()
                nn.init.xavier_normal_(attn.out.weight)
                attn.out.bias.zero_()
                for lin in (block.mlp.fc1, block.mlp.fc2):
                    nn.init.xavier_normal_(lin.weight)
                    bound = lin.in_features ** -0.5
                    lin.bias.uniform_(-bound, bound)


def build(cfg: SASRecConfig, data_info: dict) -> SASRecModel:
    return SASRecModel(cfg, data_info)


SPEC = ModelSpec(SASRecConfig, build, "SASRec: causal softmax transformer; sampled-softmax retrieval")
