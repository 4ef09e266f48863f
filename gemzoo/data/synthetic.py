"""``synthetic-gem``: a seeded GEM-like ranking stream whose labels come from a planted model.

Each user has a few favourite item clusters. Their history (gem-lognormal lengths, scaled by the
config) is drawn mostly from those clusters; their candidates half from them, half uniformly. The
planted click logit of a candidate is

    signal * <u, e_c> / rank + b_c,   u = mean(e_h over history h) + sparse_weight * s,
    s = sum over tables t of mean(s_t[id] over the user's ids) / sqrt(tables)

with item latents e, item biases b and sparse-row latents s fixed by the seed. Conversion needs a click
and a second logit that favours the sparse features. Learning is therefore measurable: a model that
reads the history, the candidate and the sparse features can approach the planted AUC.

Every batch is a pure function of (seed, step): ``train_batch(step)`` draws from its own generator, so a
resumed run sees exactly the batches an uninterrupted one would. ``eval_batches(n)`` uses a separate
stream and is the same fixed held-out set for any n-prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemzoo.data.batch import GemBatch
from gemzoo.errors import ConfigError
from gemzoo.interfaces.models import DatasetSpec
from gemzoo.jagged import lengths_to_offsets, seq_ids

_TRAIN, _EVAL, _PLANT = 1, 2, 3
_PLANTED_ROWS = 1 << 16  # sparse-row latents repeat modulo this (a fixed hash; keeps 1M-row tables cheap)


def stream_generator(seed: int, stream: int, index: int) -> torch.Generator:
    """An independent generator for (seed, stream, index) (splitmix64-style mixing)."""
    x = (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) % (1 << 64)
    x ^= x >> 32
    return torch.Generator().manual_seed(x % (1 << 63))


def gem_lognormal_lengths(batch: int, median: float, sigma: float, lo: int, hi: int, gen: torch.Generator):
    """The gem-lognormal benchmark distribution (docs/benchmarks.md): round(median * exp(sigma * z)) clamped to [lo, hi]."""
    z = torch.randn(batch, generator=gen)
    return (median * torch.exp(sigma * z)).round().clamp(lo, hi).long()


@dataclass
class SyntheticGemConfig:
    source: str = "synthetic-gem"
    batch_size: int = 32
    max_len: int = 256  # history cap (gem_lognormal's hi)
    median_len: int = 64  # gem_lognormal's median
    min_len: int = 2  # gem_lognormal's lo; 0 allows empty histories
    len_sigma: float = 1.0
    min_candidates: int = 1
    max_candidates: int = 8  # each user gets min_candidates..max_candidates candidates
    num_items: int = 2000
    num_sparse_tables: int = 4
    sparse_table_size: int = 1000
    sparse_ids_per_feature: int = 3  # each user has 1..this many ids per sparse feature
    num_clusters: int = 32
    favourite_clusters: int = 2
    history_focus: float = 0.8  # share of history items drawn from the favourite clusters
    planted_rank: int = 16
    signal: float = 6.0  # scale of the planted user-item affinity
    sparse_weight: float = 1.0
    click_bias: float = -1.0
    eval_seed_offset: int = 1_000_003

    def __post_init__(self):
        _check(self)  # [data] is refused when the config is built, so config validate refuses it too


def _check(cfg: SyntheticGemConfig) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"[data] (synthetic-gem): {what}")

    need(cfg.batch_size >= 1, f"batch_size must be >= 1, got {cfg.batch_size}")
    need(cfg.max_len >= 1, f"max_len must be >= 1, got {cfg.max_len}")
    need(0 <= cfg.min_len <= cfg.max_len, f"need 0 <= min_len <= max_len, got min_len={cfg.min_len}, max_len={cfg.max_len}")
    need(1 <= cfg.median_len <= cfg.max_len,
         f"need 1 <= median_len <= max_len, got median_len={cfg.median_len}, max_len={cfg.max_len}")
    need(1 <= cfg.min_candidates <= cfg.max_candidates,
         f"need 1 <= min_candidates <= max_candidates, got {cfg.min_candidates} and {cfg.max_candidates}")
    need(cfg.num_clusters >= 1, f"num_clusters must be >= 1, got {cfg.num_clusters}")
    need(cfg.num_items >= cfg.num_clusters, f"num_items ({cfg.num_items}) must be >= num_clusters ({cfg.num_clusters})")
    need(1 <= cfg.favourite_clusters <= cfg.num_clusters,
         f"favourite_clusters must be in [1, num_clusters={cfg.num_clusters}], got {cfg.favourite_clusters}")
    need(0.0 <= cfg.history_focus <= 1.0, f"history_focus must be in [0, 1], got {cfg.history_focus}")
    need(cfg.num_sparse_tables >= 0, f"num_sparse_tables must be >= 0, got {cfg.num_sparse_tables}")
    need(cfg.num_sparse_tables == 0 or cfg.sparse_table_size >= 1,
         f"sparse_table_size must be >= 1, got {cfg.sparse_table_size}")
    need(cfg.sparse_ids_per_feature >= 1, f"sparse_ids_per_feature must be >= 1, got {cfg.sparse_ids_per_feature}")
    need(cfg.planted_rank >= 1, f"planted_rank must be >= 1, got {cfg.planted_rank}")


class SyntheticGemDataset:
    def __init__(self, cfg: SyntheticGemConfig, seed: int = 0):
        _check(cfg)
        self.cfg, self.seed = cfg, seed
        g = stream_generator(seed, _PLANT, 0)
        r, n_items, n_clusters = cfg.planted_rank, cfg.num_items, cfg.num_clusters
        centers = torch.randn(n_clusters, r, generator=g)
        # every cluster non-empty: a shuffled round-robin assignment
        self.item_cluster = (torch.arange(n_items) % n_clusters)[torch.randperm(n_items, generator=g)]
        self.item_latent = centers[self.item_cluster] + 0.5 * torch.randn(n_items, r, generator=g)
        self.item_bias = 0.5 * torch.randn(n_items, generator=g) + cfg.click_bias
        self.conv_bias = 0.5 * torch.randn(n_items, generator=g) - 1.0
        rows = min(cfg.sparse_table_size, _PLANTED_ROWS)
        self.sparse_latent = torch.randn(cfg.num_sparse_tables, rows, r, generator=g)
        self.cluster_items = torch.argsort(self.item_cluster, stable=True)  # items grouped by cluster
        counts = torch.bincount(self.item_cluster, minlength=n_clusters)
        self.cluster_start = torch.cumsum(counts, 0) - counts
        self.cluster_count = counts
        self.keys = tuple(f"sparse_{t}" for t in range(cfg.num_sparse_tables))
        self.info = {
            "task": "ranking",
            "num_items": n_items,
            "max_len": cfg.max_len,
            "max_candidates": cfg.max_candidates,
            "sparse_tables": [
                {"name": f"table_{t}", "num_embeddings": cfg.sparse_table_size, "feature_names": [k]}
                for t, k in enumerate(self.keys)
            ],
        }

    # -- sampling ------------------------------------------------------------------------------
    def _from_clusters(self, clusters: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        u = torch.rand(clusters.shape, generator=g)
        idx = self.cluster_start[clusters] + (u * self.cluster_count[clusters]).long()
        return self.cluster_items[idx]

    def _mixed_items(self, favourites: torch.Tensor, owner: torch.Tensor, focus: float, g: torch.Generator):
        """Items for rows owned by users ``owner``: from a favourite cluster with prob ``focus``, else uniform."""
        n = owner.numel()
        pick = torch.randint(self.cfg.favourite_clusters, (n,), generator=g)
        fav = self._from_clusters(favourites[owner, pick], g)
        uniform = torch.randint(self.cfg.num_items, (n,), generator=g)
        return torch.where(torch.rand(n, generator=g) < focus, fav, uniform)

    def _batch(self, g: torch.Generator, truth: dict | None = None) -> GemBatch:
        cfg, b = self.cfg, self.cfg.batch_size
        favourites = torch.stack(
            [torch.randperm(cfg.num_clusters, generator=g)[: cfg.favourite_clusters] for _ in range(b)]
        )
        hist_len = gem_lognormal_lengths(b, cfg.median_len, cfg.len_sigma, cfg.min_len, cfg.max_len, g)
        hist_off = lengths_to_offsets(hist_len)
        hist_owner = seq_ids(hist_off)
        hist_items = self._mixed_items(favourites, hist_owner, cfg.history_focus, g)

        cand_len = torch.randint(cfg.min_candidates, cfg.max_candidates + 1, (b,), generator=g)
        cand_off = lengths_to_offsets(cand_len)
        cand_owner = seq_ids(cand_off)
        cand_items = self._mixed_items(favourites, cand_owner, 0.5, g)

        # sparse features: 1..k ids per (feature, user), key-major
        sp_len = torch.randint(1, cfg.sparse_ids_per_feature + 1, (cfg.num_sparse_tables * b,), generator=g)
        sp_vals = torch.randint(cfg.sparse_table_size, (int(sp_len.sum()),), generator=g) if cfg.num_sparse_tables \
            else torch.zeros(0, dtype=torch.long)

        # planted user vector
        r = cfg.planted_rank
        u = torch.zeros(b, r).index_add_(0, hist_owner, self.item_latent[hist_items])
        u = u / hist_len.clamp(min=1).unsqueeze(1).float()
        s = torch.zeros(b, r)
        if cfg.num_sparse_tables:
            table_of_row = torch.repeat_interleave(torch.arange(cfg.num_sparse_tables), b)
            rows_latent = self.sparse_latent[
                torch.repeat_interleave(table_of_row, sp_len), sp_vals % self.sparse_latent.shape[1]]
            owner = torch.repeat_interleave(torch.arange(cfg.num_sparse_tables * b) % b, sp_len)
            per_bag = torch.zeros(b, r).index_add_(0, owner, rows_latent / sp_len.repeat_interleave(sp_len).unsqueeze(1))
            s = per_bag / cfg.num_sparse_tables ** 0.5
        user = u + cfg.sparse_weight * s
        e = self.item_latent[cand_items]
        click_logit = cfg.signal * (user[cand_owner] * e).sum(1) / r + self.item_bias[cand_items]
        conv_logit = cfg.signal * (s[cand_owner] * e).sum(1) / r + self.conv_bias[cand_items]
        if truth is not None:  # the planted probabilities, for measuring the best achievable AUC
            truth["click"], truth["conversion"] = torch.sigmoid(click_logit), torch.sigmoid(conv_logit)
        click = torch.bernoulli(torch.sigmoid(click_logit), generator=g)
        conversion = click * torch.bernoulli(torch.sigmoid(conv_logit), generator=g)
        return GemBatch(
            history_items=hist_items, history_offsets=hist_off, cand_items=cand_items, cand_offsets=cand_off,
            click=click, conversion=conversion, sparse_keys=self.keys, sparse_values=sp_vals,
            sparse_lengths=sp_len,
        )

    # -- dataset API -----------------------------------------------------------------------------
    def train_batch(self, step: int) -> GemBatch:
        return self._batch(stream_generator(self.seed, _TRAIN, step))

    def eval_batches(self, n: int) -> list[GemBatch]:
        return [self._batch(stream_generator(self.seed + self.cfg.eval_seed_offset, _EVAL, i)) for i in range(n)]


def build(cfg: SyntheticGemConfig, seed: int = 0) -> SyntheticGemDataset:
    return SyntheticGemDataset(cfg, seed)


SPEC = DatasetSpec(
    SyntheticGemConfig, build,
    "seeded GEM-like stream: gem-lognormal histories, sparse features, candidates with planted labels",
)
