"""``sasrec``: SASRec (Kang & McAuley, 2018), a causal softmax transformer for next-item retrieval.

Pre-norm blocks with a ReLU feed-forward of width embedding_dim, a final LayerNorm, and the retrieval
head and evaluation shared with hstu (gemzoo.models.retrieval).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gemzoo.interfaces.attention import AttentionRequest
from gemzoo.interfaces.models import ModelSpec
from gemzoo.models.common import TransformerBlock, check_heads
from gemzoo.models.retrieval import RetrievalConfig, RetrievalModel


@dataclass
class SASRecConfig(RetrievalConfig):
    family: str = "sasrec"
    ffn_mult: int = 1  # SASRec's point-wise feed-forward keeps the model width


class SASRecModel(RetrievalModel):
    family = "sasrec"

    def __init__(self, cfg: SASRecConfig, data_info: dict):
        super().__init__(cfg, data_info)
        d = cfg.embedding_dim
        head_dim = check_heads(d, cfg.num_heads, None, "sasrec")
        request = AttentionRequest(activation="softmax", causal=True)
        self.blocks = nn.ModuleList(
            TransformerBlock(d, cfg.num_heads, head_dim, max(1, cfg.ffn_mult) * d, request=request,
                             dropout=cfg.dropout, activation="relu")
            for _ in range(cfg.num_layers)
        )
        self.output_norm = nn.LayerNorm(d)


def build(cfg: SASRecConfig, data_info: dict) -> SASRecModel:
    return SASRecModel(cfg, data_info)


SPEC = ModelSpec(SASRecConfig, build, "SASRec: causal softmax transformer; sampled-softmax retrieval")
