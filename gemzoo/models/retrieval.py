"""Next-item retrieval shared by ``hstu`` and ``sasrec``: the input embedding, the sampled-softmax head and
full-ranking evaluation. A family only supplies its blocks (and optionally an output norm).

Training: at every position with a target, the L2-normalised user state is scored against the target's
and ``num_negatives`` uniformly sampled items' normalised embeddings (cosine / temperature), with
accidental hits of the target masked out; the loss is the softmax cross-entropy of the target.
``negatives = "shared"`` draws one set of negatives for the whole batch (cheap); ``"per_position"`` draws
``num_negatives`` for every position, as the HSTU reference code does (memory O(positions x min(negatives x d,
items)): ``negative_logits`` scores every item when that moves less memory than gathering the negatives).
``accidental_hits = "mask"`` drops a negative that equals the target from the softmax (the reference's way);
``"redraw"`` (per_position only) draws each position's negatives from the other num_items - 1 items, so a
negative never equals the target.

Input: item embedding x sqrt(d) + a learned position, dropout. ``positions = "recency"`` counts back from the
most recent item (0 = newest); ``"from_start"`` counts from the start of the window (0 = oldest), as the HSTU
reference does. ``init = "reference"`` initialises each family as the HSTU reference code does
(docs/quality-ml1m.md lists the schemes); ``"normal"``: truncated normal ``init_std`` everywhere.

Evaluation: the user state at each evaluated position is scored against every item; HR@K and NDCG@K
(K in ``eval_ks``) use the target's rank, ties counted at their average rank; ``eval_ranking = "unseen"``
leaves the user's own history items out of the ranking (the HSTU paper's way; metric names end in ``_unseen``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.attention import validated_longest
from gemzoo.errors import ConfigError
from gemzoo.flops import linear_flops
from gemzoo.interfaces.models import ModelOutput, host_view
from gemzoo.interfaces.options import bounded
from gemzoo.jagged import positions as window_positions
from gemzoo.models.common import init_weights, log2_discount, require_data_info, reverse_positions


@dataclass
class RetrievalConfig:
    """Fields shared by every retrieval family (each family's dataclass adds ``family`` and its own)."""

    embedding_dim: int = 50
    num_layers: int = 2
    num_heads: int = 1
    num_kv_heads: int = 0  # k/v heads: 0 num_heads; a divisor of it: grouped-query attention (1: multi-query)
    dropout: float = bounded(0.2, min=0, below=1)
    num_negatives: int = 128
    negatives: str = "shared"  # "shared" (one draw per batch) or "per_position"
    temperature: float = 0.05
    eval_ks: list[int] = field(default_factory=lambda: [10, 50, 200])
    # "all": rank the target among every item. "unseen": leave out the items of the user's own input history
    # (the target excepted), as the HSTU paper's evaluation does (filter_invalid_ids); metric names then end
    # in "_unseen", so the two are never compared by mistake.
    eval_ranking: str = "all"
    init_std: float = bounded(0.02, min=0)
    positions: str = "recency"  # "recency" (0 = most recent item) or "from_start" (0 = oldest in the window)
    accidental_hits: str = "mask"  # "mask" (a drawn target is left out of the softmax) or "redraw"
    init: str = "normal"  # "normal" (truncated normal init_std) or "reference" (the HSTU reference code's)
    norm_affine: bool = True  # learnable LayerNorm scale and shift in the blocks


def trunc_normal(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at +-2 std, in place."""
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def check_retrieval_config(cfg: RetrievalConfig, family: str) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"[model] ({family}): {what}")

    need(cfg.embedding_dim >= 1, f"embedding_dim must be >= 1, got {cfg.embedding_dim}")
    need(cfg.num_layers >= 0, f"num_layers must be >= 0, got {cfg.num_layers}")
    need(cfg.num_heads >= 1, f"num_heads must be >= 1, got {cfg.num_heads}")
    need(0.0 <= cfg.dropout < 1.0, f"dropout must be in [0, 1), got {cfg.dropout}")
    need(cfg.num_negatives >= 1, f"num_negatives must be >= 1, got {cfg.num_negatives}")
    need(cfg.negatives in ("shared", "per_position"),
         f"negatives must be 'shared' or 'per_position', got {cfg.negatives!r}")
    need(cfg.temperature > 0, f"temperature must be > 0, got {cfg.temperature}")
    need(bool(cfg.eval_ks) and min(cfg.eval_ks) >= 1, f"eval_ks must list positive cut-offs, got {cfg.eval_ks}")
    need(cfg.eval_ranking in ("all", "unseen"),
         f"eval_ranking must be 'all' or 'unseen' (history items left out), got {cfg.eval_ranking!r}")
    need(cfg.positions in ("recency", "from_start"),
         f"positions must be 'recency' or 'from_start', got {cfg.positions!r}")
    need(cfg.accidental_hits in ("mask", "redraw"),
         f"accidental_hits must be 'mask' or 'redraw', got {cfg.accidental_hits!r}")
    need(cfg.accidental_hits != "redraw" or cfg.negatives == "per_position",
         "accidental_hits = 'redraw' needs negatives = 'per_position' (one shared draw cannot avoid every "
         "position's target); use accidental_hits = 'mask' with shared negatives")
    need(cfg.init in ("normal", "reference"), f"init must be 'normal' or 'reference', got {cfg.init!r}")


class RetrievalModel(nn.Module):
    """Item + recency-position embeddings -> ``self.blocks`` -> ``self.output_norm`` -> retrieval head."""

    family = "retrieval"

    def __init__(self, cfg: RetrievalConfig, data_info: dict):
        super().__init__()
        check_retrieval_config(cfg, self.family)
        require_data_info(self.family, data_info, "retrieval",
                          'use [data] source = "movielens" (or model family gem)')
        self.cfg = cfg
        self.num_items, self.max_len = int(data_info["num_items"]), int(data_info["max_len"])
        if cfg.accidental_hits == "redraw" and self.num_items < 2:
            raise ConfigError(f"[model] ({self.family}): accidental_hits = 'redraw' needs at least 2 items, "
                              f"the data has {self.num_items}")
        d = cfg.embedding_dim
        self.item_emb = nn.Embedding(self.num_items, d)
        self.pos_emb = nn.Embedding(self.max_len, d)
        self.input_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList()  # filled by the family
        self.output_norm: nn.Module = nn.Identity()
        self.sparse_arch = None

    # -- trainer API -------------------------------------------------------------------------------
    def init_weights(self) -> None:
        if self.cfg.init == "reference":
            self.reference_init()
        else:
            init_weights(self, std=self.cfg.init_std)

    def reference_init(self) -> None:
        """The HSTU reference code's initialisation; each family defines its own."""
        raise ConfigError(f"[model] ({self.family}): init = 'reference' is not defined for this family; "
                          "use init = 'normal'")

    def positions(self, offsets: torch.Tensor, total: int) -> torch.Tensor:
        """Row of ``pos_emb`` for each input position (``positions`` config)."""
        if self.cfg.positions == "from_start":
            return window_positions(offsets, total).clamp(max=self.max_len - 1)
        return reverse_positions(offsets, total, self.max_len)

    def run_blocks(self, x: torch.Tensor, batch, longest: int) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, batch.offsets, longest)
        return x

    def embedding_tables(self) -> list:
        return []

    def encode(self, batch) -> torch.Tensor:
        """User state at every input position, [T, embedding_dim]."""
        items, offsets = batch.items, batch.offsets
        t = items.numel()
        # validated from the host copy (no device sync) and trusted by the attention sites after
        longest = validated_longest(offsets, t, device=items.device, name="offsets", host=host_view(batch).offsets)
        if longest > self.max_len:
            raise ConfigError(
                f"a sequence has {longest} items but the model was built for max_len={self.max_len}; "
                "raise [data] max_len"
            )
        dtype = self.item_emb.weight.dtype
        x = self.item_emb(items) * self.cfg.embedding_dim ** 0.5
        x = self.input_dropout(x + self.pos_emb(self.positions(offsets, t))).to(dtype)
        return self.output_norm(self.run_blocks(x, batch, longest))

    def forward(self, batch) -> ModelOutput:
        h = self.encode(batch)
        # the positions with a target, in order: counted on the host copy and picked by a stable sort on the
        # device (a boolean mask's size would be read back from the device, a host sync on a GPU)
        with_target = int((host_view(batch).targets >= 0).sum())
        keep = torch.argsort((batch.targets < 0).to(torch.uint8), stable=True)[:with_target]
        user = F.normalize(h.index_select(0, keep).float(), dim=-1)
        target = batch.targets.index_select(0, keep)
        pos = F.normalize(self.item_emb(target).float(), dim=-1)
        pos_logit = (user * pos).sum(-1, keepdim=True)
        k = self.cfg.num_negatives
        if self.cfg.negatives == "shared":
            negatives = torch.randint(self.num_items, (1, k), device=user.device)
            neg = F.normalize(self.item_emb(negatives[0]).float(), dim=-1)
            neg_logit = user @ neg.T
        elif self.cfg.accidental_hits == "redraw":
            # uniform over the other num_items - 1 items: draw from [0, n - 1), then skip over the target
            negatives = torch.randint(max(self.num_items - 1, 1), (target.numel(), k), device=user.device)
            negatives = negatives + (negatives >= target.unsqueeze(1)).long()
            neg_logit = self.negative_logits(user, negatives)
        else:
            negatives = torch.randint(self.num_items, (target.numel(), k), device=user.device)
            neg_logit = self.negative_logits(user, negatives)
        neg_logit = neg_logit.masked_fill(negatives == target.unsqueeze(1), float("-inf"))  # accidental hits
        logits = torch.cat([pos_logit, neg_logit], dim=1) / self.cfg.temperature
        loss = F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
        return ModelOutput(loss, {"positions": float(target.numel())})

    def negative_logits(self, user: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        """Cosines of each position's own negatives: ``user`` [P, d] (normalised) against the normalised embeddings
        of ``negatives`` [P, k] -> [P, k].

        Two ways to the same values (up to the order of fp32 sums): gather the P x k embeddings, normalise them
        and take the dot products (P·k·d floats gathered, written and scattered back in the backward), or score
        every item, ``user @ normalize(table).T`` [P, num_items], and pick each position's k (two GEMMs and
        P·num_items floats). The second moves less memory when num_items <= k·d: MovieLens-1M's 3,883 items
        against 128 negatives of width 50 (6,400), where the gather took 90% of a CPU step."""
        k, d = negatives.shape[1], user.shape[1]
        if self.num_items <= k * d:
            table = F.normalize(self.item_emb.weight.float(), dim=-1)
            return (user @ table.T).gather(1, negatives)
        neg = F.normalize(self.item_emb(negatives).float(), dim=-1)  # [P, k, d]
        return torch.einsum("pd,pkd->pk", user, neg)

    def block_flops(self, lengths: torch.Tensor) -> int:
        return sum(block.flops(lengths) for block in self.blocks)

    def flops(self, batch) -> int:
        lengths = batch.lengths.cpu()
        positions = int((batch.targets >= 0).sum())
        head = linear_flops(positions, self.cfg.embedding_dim, 1 + self.cfg.num_negatives)
        return int(self.block_flops(lengths) + head)

    def cost_model(self, batch) -> torch.Tensor:
        """float64 [B]: each sequence's share of ``flops(batch)`` (its blocks' FLOPs, and the head's for each
        of its positions that has a target)."""
        lengths = batch.lengths.long().cpu()
        has_target = torch.cat([torch.zeros(1, dtype=torch.long), (batch.targets >= 0).long().cpu().cumsum(0)])
        offsets = batch.offsets.cpu()
        positions = has_target[offsets[1:]] - has_target[offsets[:-1]]
        f = linear_flops(positions, self.cfg.embedding_dim, 1 + self.cfg.num_negatives)
        return (f + sum(block.sample_flops(lengths) for block in self.blocks)).double()

    def transformer_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def evaluator(self) -> RankingEvaluator:
        return RankingEvaluator(self)


class RankingEvaluator:
    """Full ranking: ``hr@K``, ``ndcg@K`` for K in ``eval_ks``, and ``mrr``, over every item
    (``eval_ranking = "all"``) or over the items not in the user's input history (``"unseen"``; the names
    then end in ``_unseen``)."""

    def __init__(self, model: RetrievalModel, chunk: int = 1024):
        self.model, self.chunk = model, chunk
        self.unseen = model.cfg.eval_ranking == "unseen"
        self.ks = sorted(set(model.cfg.eval_ks))
        self.hits = {k: 0.0 for k in self.ks}
        self.ndcg = {k: 0.0 for k in self.ks}
        self.rr = 0.0
        self.count = 0

    def update(self, batch) -> None:
        h = self.model.encode(batch)
        keep = batch.targets >= 0
        user = F.normalize(h[keep].float(), dim=-1)
        target = batch.targets[keep]
        items = F.normalize(self.model.item_emb.weight.float(), dim=-1)
        where = keep.nonzero().squeeze(1)  # token index of each ranked position
        for start in range(0, user.shape[0], self.chunk):
            u, tgt = user[start:start + self.chunk], target[start:start + self.chunk]
            scores = u @ items.T  # [n, num_items]
            if self.unseen:
                scores = scores.masked_fill(self._seen(batch, where[start:start + self.chunk], tgt, scores.shape),
                                            float("-inf"))
            own = scores.gather(1, tgt.unsqueeze(1))
            greater = (scores > own).sum(1).double()
            ties = (scores == own).sum(1).double() - 1  # other items with exactly the target's score
            rank = (greater + ties / 2).cpu()  # 0-based, ties at their average rank
            for k in self.ks:
                hit = rank < k
                self.hits[k] += float(hit.sum())
                self.ndcg[k] += float((log2_discount(rank) * hit).sum())
            self.rr += float((1.0 / (rank + 1)).sum())
            self.count += int(tgt.numel())

    @staticmethod
    def _seen(batch, where: torch.Tensor, target: torch.Tensor, shape) -> torch.Tensor:
        """[n, num_items] mask of the items each ranked position's own sequence showed up to that position,
        the target left rankable."""
        offsets = batch.offsets.to(where.device)
        seq = torch.searchsorted(offsets, where, right=True) - 1  # sequence of each ranked position
        tok = torch.arange(batch.items.numel(), device=where.device)
        tok_seq = torch.searchsorted(offsets, tok, right=True) - 1
        row, col = ((tok_seq[None, :] == seq[:, None]) & (tok[None, :] <= where[:, None])).nonzero(as_tuple=True)
        seen = torch.zeros(shape, dtype=torch.bool, device=where.device)
        seen[row, batch.items.to(where.device)[col]] = True
        seen[torch.arange(shape[0], device=where.device), target] = False
        return seen

    def compute(self) -> dict[str, float]:
        n = max(self.count, 1)
        out = {}
        tag = "_unseen" if self.unseen else ""
        for k in self.ks:
            out[f"hr@{k}{tag}"] = self.hits[k] / n
            out[f"ndcg@{k}{tag}"] = self.ndcg[k] / n
        out[f"mrr{tag}"] = self.rr / n
        out["eval_users"] = float(self.count)
        return out
