"""``movielens``: a user-supplied MovieLens ``ratings.dat`` with the HSTU paper's leave-one-out split.

Each line is ``UserID::MovieID::Rating::Timestamp``. Every rating counts as an interaction. Each user's
events are sorted by time (ties keep file order); the last item is the test target, the one before it the
validation target. Users with fewer than three events are dropped.

Items (``items``): ``"rated"``, the movies that have a rating; ``"movies"``, every movie of ``movies.dat``
(``MovieID::Title::Genres``; ML-1M lists 3,883, 177 of them never rated), the candidate set of the HSTU
reference, which samples negatives from and ranks over all of them; ``"auto"``: ``"movies"`` when
``movies_path`` (default: ``movies.dat`` beside ``ratings.dat``) exists, else ``"rated"``. Movie ids map to
0..num_items-1 in increasing raw-id order.

Training sequence (``train_items``): ``"before_val"``, every item before the validation item;
``"before_test"``, every item before the test item (the validation item is then a training target, as in the
HSTU reference when it reports test); ``"auto"``: the one that matches ``eval_split`` (val -> before_val,
test -> before_test), so validation is never trained on.

- ``train_batch(step)``: ``batch_size`` users, shuffled per epoch from (seed, epoch); inputs are the
  ``max_len`` most recent training items but the last, targets the items that follow them.
- ``eval_batches(n)``: a fixed seeded order of users; input is the history before the held-out target
  (``eval_split = "val"``: every item before the validation item; ``"test"``: every item before the test
  item), truncated to the ``max_len`` most recent; only the last position has a target.

Batches carry ``times`` (each input's timestamp) and ``next_times`` (the timestamp of the event that follows
each position: the target's), which HSTU's time-bucketed attention bias reads.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from gemzoo.data.batch import SeqBatch
from gemzoo.data.exchange import shard_range
from gemzoo.data.synthetic import stream_generator
from gemzoo.errors import ConfigError, DataNotFound
from gemzoo.interfaces.models import DatasetSpec
from gemzoo.interfaces.options import bounded
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
    # what the training sequences end before: "auto" (the eval_split's held-out item), "before_val", "before_test"
    train_items: str = bounded("auto", choices=("auto", "before_val", "before_test"))
    # the item set (negatives and ranking): "auto", "movies" (every movie of movies.dat), "rated"
    items: str = bounded("auto", choices=("auto", "movies", "rated"))
    movies_path: str = ""  # "": movies.dat beside ratings.dat


def _dat_lines(path: str):
    """(line number, stripped line) of each non-empty line of a MovieLens .dat file (latin-1)."""
    with open(path, encoding="latin-1") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if line:
                yield lineno, line


def read_ratings(path: str) -> list[tuple[int, int, int, int]]:
    """Parse ``path``; ConfigError naming the file, line and expected format on any problem."""
    if not path:
        raise ConfigError(f"[data] path is empty; point it at a MovieLens ratings.dat ({FORMAT})")
    if not os.path.isfile(path):
        raise DataNotFound(
            f"[data] path {path!r}: no such file. Download MovieLens (e.g. ml-1m) yourself and set [data] path "
            f"to its ratings.dat, whose lines read {FORMAT}"
        )
    rows = []
    for lineno, line in _dat_lines(path):
        parts = line.split("::")
        try:
            if len(parts) != 4:
                raise ValueError
            user, movie, rating, ts = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(f"{path}, line {lineno}: expected {FORMAT}, got {line[:80]!r}") from None
        rows.append((user, movie, rating, ts))
    if not rows:
        raise ConfigError(f"{path}: the file has no ratings; expected lines of {FORMAT}")
    return rows


MOVIES_FORMAT = "MovieID::Title::Genres"


def read_movie_ids(path: str) -> list[int]:
    """The movie ids of a MovieLens ``movies.dat``; ConfigError naming the file and line on a bad one."""
    ids = []
    for lineno, line in _dat_lines(path):
        try:
            ids.append(int(line.split("::", 1)[0]))
        except ValueError:
            raise ConfigError(f"{path}, line {lineno}: expected {MOVIES_FORMAT}, got {line[:80]!r}") from None
    if not ids:
        raise ConfigError(f"{path}: no movies; expected lines of {MOVIES_FORMAT}")
    return ids


def movie_catalogue(cfg: MovieLensConfig, rated: set[int]) -> tuple[list[int], str]:
    """Sorted raw movie ids of the item table and where they came from ("rated" or the movies.dat path)."""
    path = cfg.movies_path or os.path.join(os.path.dirname(cfg.path) or ".", "movies.dat")
    if cfg.items == "rated" or (cfg.items == "auto" and not os.path.isfile(path)):
        return sorted(rated), "rated"
    if not os.path.isfile(path):
        raise ConfigError(f'[data] items = "movies" needs {path!r} ({MOVIES_FORMAT}, from the same MovieLens '
                          'download as ratings.dat); set [data] movies_path, or items = "rated"')
    movies = set(read_movie_ids(path))
    unknown = sorted(rated - movies)
    if unknown:
        raise ConfigError(f"{path} does not list {len(unknown)} rated movies (e.g. {unknown[:3]}); is it from the "
                          f"same MovieLens release as {cfg.path}? Or set [data] items = \"rated\"")
    if cfg.items == "auto":
        print(f"movielens: items from {path} ({len(movies)} movies, {len(movies - rated)} never rated); "
              'set [data] items = "rated" for the rated ones only', file=sys.stderr)
    return sorted(movies), path


class MovieLensDataset:
    def __init__(self, cfg: MovieLensConfig, seed: int = 0):
        if cfg.batch_size < 1 or cfg.max_len < 1:
            raise ConfigError(f"[data] batch_size and max_len must be >= 1, got {cfg.batch_size} and {cfg.max_len}")
        if cfg.eval_split not in ("val", "test"):
            raise ConfigError(f"[data] eval_split must be 'val' or 'test', got {cfg.eval_split!r}")
        self.cfg, self.seed = cfg, seed
        rows = read_ratings(cfg.path)
        movies, items_source = movie_catalogue(cfg, {m for _, m, _, _ in rows})
        index = {m: i for i, m in enumerate(movies)}
        by_user: dict[int, list[tuple[int, int, int]]] = {}
        for order, (user, movie, _, ts) in enumerate(rows):
            by_user.setdefault(user, []).append((ts, order, index[movie]))
        self.users, self.train_seqs, self.val_items, self.test_items = [], [], [], []
        self.seqs, self.times = [], []  # every event of each kept user, in time order, and its timestamps
        dropped = 0
        train_items = cfg.train_items if cfg.train_items != "auto" else (
            "before_val" if cfg.eval_split == "val" else "before_test")
        cut = 2 if train_items == "before_val" else 1
        for user in sorted(by_user):
            events = sorted(by_user[user])
            if len(events) < 3:
                dropped += 1
                continue
            seq = torch.tensor([item for _, _, item in events], dtype=torch.long)
            self.users.append(user)
            self.seqs.append(seq)
            self.times.append(torch.tensor([ts for ts, _, _ in events], dtype=torch.long))
            self.train_seqs.append(seq[:-cut])
            self.val_items.append(int(seq[-2]))
            self.test_items.append(int(seq[-1]))
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
            "items": items_source,
            "train_items": train_items,
            "timestamps": True,
        }

    # -- sampling ------------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """The trainable users in ``epoch``'s shuffled order; the last few epochs' orders are kept on the
        instance (a cache owned by the dataset, freed with it)."""
        orders = self.__dict__.setdefault("_epoch_orders", {})
        if epoch not in orders:
            if len(orders) >= 4:
                orders.pop(next(iter(orders)))
            g = stream_generator(self.seed, _TRAIN, epoch)
            orders[epoch] = torch.tensor(self.trainable)[torch.randperm(len(self.trainable), generator=g)]
        return orders[epoch]

    def train_batch(self, step: int) -> SeqBatch:
        bs = self.cfg.batch_size
        return self._train_rows(step * bs, (step + 1) * bs)

    def train_shard(self, step: int, rank: int, world_size: int) -> SeqBatch:
        """Rank ``rank``'s contiguous part of ``train_batch(step)`` (gemzoo.data.exchange.shard_range), reading
        only its own users."""
        bs = self.cfg.batch_size
        lo, hi = shard_range(bs, rank, world_size)
        return self._train_rows(step * bs + lo, step * bs + hi)

    def _train_rows(self, first: int, stop: int) -> SeqBatch:
        """Rows ``first..stop-1`` of the endless stream of training sequences (epoch after epoch)."""
        n, L = len(self.trainable), self.cfg.max_len
        items, targets, lengths, times, next_times = [], [], [], [], []
        for j in range(first, stop):
            user = int(self._epoch_order(j // n)[j % n])
            end = self.train_seqs[user].numel()
            start = max(0, end - (L + 1))
            seq, ts = self.train_seqs[user][start:], self.times[user][start:end]
            items.append(seq[:-1])
            targets.append(seq[1:])
            times.append(ts[:-1])
            next_times.append(ts[1:])
            lengths.append(seq.numel() - 1)

        def cat(parts):  # a shard may hold no rows (more ranks than samples)
            return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

        return SeqBatch(cat(items), lengths_to_offsets(torch.tensor(lengths, dtype=torch.long)), cat(targets),
                        cat(times), cat(next_times))

    def _eval_batch(self, users: list[int]) -> SeqBatch:
        L = self.cfg.max_len
        items, targets, lengths, times, next_times = [], [], [], [], []
        for u in users:
            end = self.seqs[u].numel() - (2 if self.cfg.eval_split == "val" else 1)  # index of the held-out item
            start = max(0, end - L)
            history, ts = self.seqs[u][start:end], self.times[u][start:end + 1]
            t = torch.full((history.numel(),), -1, dtype=torch.long)
            t[-1] = self.seqs[u][end]
            items.append(history)
            targets.append(t)
            times.append(ts[:-1])
            next_times.append(ts[1:])
            lengths.append(history.numel())
        return SeqBatch(torch.cat(items), lengths_to_offsets(torch.tensor(lengths)), torch.cat(targets),
                        torch.cat(times), torch.cat(next_times))

    def eval_batches(self, n: int) -> list[SeqBatch]:
        """Up to ``n`` batches over a fixed seeded order of users (every user once when n is large)."""
        order = torch.randperm(len(self.users), generator=stream_generator(self.seed, _EVAL, 0)).tolist()
        bs = self.cfg.batch_size
        return [self._eval_batch(order[i:i + bs]) for i in range(0, min(n * bs, len(order)), bs)]


def build(cfg: MovieLensConfig, seed: int = 0) -> MovieLensDataset:
    return MovieLensDataset(cfg, seed)


NOMINAL_ITEMS = 3883  # MovieLens-1M's movies.dat: the item count a model is built with before the data is there


def info_without_data(cfg: MovieLensConfig) -> dict:
    """The dataset's ``info`` from the config alone, with ML-1M's item count (``config show|validate``)."""
    return {"task": "retrieval", "num_items": NOMINAL_ITEMS, "max_len": cfg.max_len, "timestamps": True,
            "nominal": True}


SPEC = DatasetSpec(MovieLensConfig, build,
                   "MovieLens ratings.dat (user-supplied), leave-one-out split as in the HSTU paper",
                   info_without_data=info_without_data)
