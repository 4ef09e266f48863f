"""``movielens``: a user-supplied MovieLens ``ratings.dat`` with the HSTU paper's leave-one-out split.

Each line is ``UserID::MovieID::Rating::Timestamp``. Every rating counts as an interaction. Each user's
events are sorted by time (ties keep file order); the last item is the test target, the one before it the
validation target, and the rest is the training sequence. Users with fewer than three events are dropped.
Movie ids are mapped to 0..num_items-1 in increasing raw-id order.

- ``train_batch(step)``: ``batch_size`` users, shuffled per epoch from (seed, epoch); inputs are the
  ``max_len`` most recent training items but the last, targets the items that follow them.
- ``eval_batches(n)``: a fixed seeded order of users; input is the history before the held-out target
  (``eval_split = "val"``: the training sequence; ``"test"``: training + validation item), truncated to the
  ``max_len`` most recent; only the last position has a target.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from gemzoo.data.batch import SeqBatch
from gemzoo.data.synthetic import stream_generator
from gemzoo.errors import ConfigError
from gemzoo.interfaces.models import DatasetSpec
from gemzoo.jagged import lengths_to_offsets

FORMAT = "UserID::MovieID::Rating::Timestamp (four integers separated by '::')"
_TRAIN, _EVAL = 11, 12


@dataclass
class MovieLensConfig:
    source: str = "movielens"
    path: str = "data/ml-1m/ratings.dat"
    batch_size: int = 128
    max_len: int = 200
    eval_split: str = "val"  # "val" or "test": which held-out item eval_batches ask for


def read_ratings(path: str) -> list[tuple[int, int, int, int]]:
    """Parse ``path``; ConfigError naming the file, line and expected format on any problem."""
    if not path:
        raise ConfigError(f"[data] path is empty; point it at a MovieLens ratings.dat ({FORMAT})")
    if not os.path.isfile(path):
        raise ConfigError(
            f"[data] path {path!r}: no such file. Download MovieLens (e.g. ml-1m) yourself and set [data] path "
            f"to its ratings.dat, whose lines read {FORMAT}"
        )
    rows = []
    with open(path, encoding="latin-1") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split("::")
            try:
                if len(parts) != 4:
                    raise ValueError
                user, movie, rating, ts = (int(p) for p in parts)
            except ValueError:
                raise ConfigError(
                    f"{path}, line {lineno}: expected {FORMAT}, got {line[:80]!r}"
                ) from None
            rows.append((user, movie, rating, ts))
    if not rows:
        raise ConfigError(f"{path}: the file has no ratings; expected lines of {FORMAT}")
    return rows


class MovieLensDataset:
    def __init__(self, cfg: MovieLensConfig, seed: int = 0):
        if cfg.batch_size < 1 or cfg.max_len < 1:
            raise ConfigError(f"[data] batch_size and max_len must be >= 1, got {cfg.batch_size} and {cfg.max_len}")
        if cfg.eval_split not in ("val", "test"):
            raise ConfigError(f"[data] eval_split must be 'val' or 'test', got {cfg.eval_split!r}")
        self.cfg, self.seed = cfg, seed
        rows = read_ratings(cfg.path)
        movies = sorted({m for _, m, _, _ in rows})
        index = {m: i for i, m in enumerate(movies)}
        by_user: dict[int, list[tuple[int, int, int]]] = {}
        for order, (user, movie, _, ts) in enumerate(rows):
            by_user.setdefault(user, []).append((ts, order, index[movie]))
        self.users, self.train_seqs, self.val_items, self.test_items = [], [], [], []
        dropped = 0
        for user in sorted(by_user):
            events = [item for _, _, item in sorted(by_user[user])]
            if len(events) < 3:
                dropped += 1
                continue
            self.users.append(user)
            self.train_seqs.append(torch.tensor(events[:-2], dtype=torch.long))
            self.val_items.append(events[-2])
            self.test_items.append(events[-1])
        if not self.users:
            raise ConfigError(f"{cfg.path}: no user has the 3 or more ratings the leave-one-out split needs")
        # users who have at least one (input, target) pair to train on
        self.trainable = [i for i, s in enumerate(self.train_seqs) if s.numel() >= 2]
        if not self.trainable:
            raise ConfigError(f"{cfg.path}: no user has 4 or more ratings, so there is nothing to train on")
        self.info = {
            "task": "retrieval",
            "num_items": len(movies),
            "max_len": cfg.max_len,
            "num_users": len(self.users),
            "dropped_users": dropped,
            "num_ratings": len(rows),
        }

    # -- sampling ------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=4)
    def _epoch_order(self, epoch: int) -> torch.Tensor:
        g = stream_generator(self.seed, _TRAIN, epoch)
        return torch.tensor(self.trainable)[torch.randperm(len(self.trainable), generator=g)]

    def train_batch(self, step: int) -> SeqBatch:
        n, bs, L = len(self.trainable), self.cfg.batch_size, self.cfg.max_len
        items, targets, lengths = [], [], []
        for j in range(step * bs, (step + 1) * bs):
            user = int(self._epoch_order(j // n)[j % n])
            seq = self.train_seqs[user][-(L + 1):]
            items.append(seq[:-1])
            targets.append(seq[1:])
            lengths.append(seq.numel() - 1)
        return SeqBatch(torch.cat(items), lengths_to_offsets(torch.tensor(lengths)), torch.cat(targets))

    def _eval_batch(self, users: list[int]) -> SeqBatch:
        L = self.cfg.max_len
        items, targets, lengths = [], [], []
        for u in users:
            if self.cfg.eval_split == "val":
                history, target = self.train_seqs[u], self.val_items[u]
            else:
                history, target = torch.cat([self.train_seqs[u], torch.tensor([self.val_items[u]])]), self.test_items[u]
            history = history[-L:]
            t = torch.full((history.numel(),), -1, dtype=torch.long)
            t[-1] = target
            items.append(history)
            targets.append(t)
            lengths.append(history.numel())
        return SeqBatch(torch.cat(items), lengths_to_offsets(torch.tensor(lengths)), torch.cat(targets))

    def eval_batches(self, n: int) -> list[SeqBatch]:
        """Up to ``n`` batches over a fixed seeded order of users (every user once when n is large)."""
        order = torch.randperm(len(self.users), generator=stream_generator(self.seed, _EVAL, 0)).tolist()
        bs = self.cfg.batch_size
        return [self._eval_batch(order[i:i + bs]) for i in range(0, min(n * bs, len(order)), bs)]


def build(cfg: MovieLensConfig, seed: int = 0) -> MovieLensDataset:
    return MovieLensDataset(cfg, seed)


SPEC = DatasetSpec(MovieLensConfig, build,
                   "MovieLens ratings.dat (user-supplied), leave-one-out split as in the HSTU paper")
