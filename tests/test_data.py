"""Datasets: synthetic-gem (seeded, planted labels) and movielens (ratings.dat, leave-one-out split)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import gemzoo
from gemzoo.data.batch import GemBatch, SeqBatch
from gemzoo.data.movielens import MovieLensConfig, MovieLensDataset
from gemzoo.data.synthetic import SyntheticGemConfig, SyntheticGemDataset, gem_lognormal_lengths, stream_generator
from gemzoo.errors import ConfigError
from gemzoo.jagged import validate_offsets
from gemzoo.models.common import binary_auc

SMALL = dict(batch_size=16, max_len=48, median_len=12, min_len=0, max_candidates=5, num_items=300,
             num_clusters=6, num_sparse_tables=3, sparse_table_size=50)


def _equal(a, b) -> bool:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


# -- synthetic-gem ---------------------------------------------------------------------------------
def test_registered():
    assert gemzoo.registry.get("dataset", "synthetic-gem").config_cls is SyntheticGemConfig
    assert gemzoo.registry.get("dataset", "movielens").config_cls is MovieLensConfig


def test_synthetic_is_a_pure_function_of_seed_and_step():
    a = SyntheticGemDataset(SyntheticGemConfig(**SMALL), seed=3)
    b = SyntheticGemDataset(SyntheticGemConfig(**SMALL), seed=3)
    assert _equal(a.train_batch(7), b.train_batch(7))
    assert _equal(b.train_batch(7), a.train_batch(7))  # no hidden state: order does not matter
    assert not _equal(a.train_batch(7), a.train_batch(8))
    assert not _equal(a.train_batch(7), SyntheticGemDataset(SyntheticGemConfig(**SMALL), seed=4).train_batch(7))
    ev1, ev2 = a.eval_batches(3), b.eval_batches(2)
    assert _equal(ev1[0], ev2[0]) and _equal(ev1[1], ev2[1])
    assert not any(_equal(e, a.train_batch(i)) for i, e in enumerate(ev1))


def test_synthetic_batch_layout():
    cfg = SyntheticGemConfig(**SMALL)
    ds = SyntheticGemDataset(cfg, seed=0)
    for step in range(5):
        b = ds.train_batch(step)
        assert isinstance(b, GemBatch) and b.num_samples == cfg.batch_size
        validate_offsets(b.history_offsets, b.history_items.numel())
        validate_offsets(b.cand_offsets, b.cand_items.numel())
        assert b.lengths.min() >= cfg.min_len and b.lengths.max() <= cfg.max_len
        assert b.num_tokens == int(b.lengths.sum())
        cl = b.cand_lengths
        assert cl.min() >= 1 and cl.max() <= cfg.max_candidates
        for items in (b.history_items, b.cand_items):
            assert items.dtype == torch.int64 and items.min() >= 0 and items.max() < cfg.num_items
        assert set(b.click.unique().tolist()) <= {0.0, 1.0}
        assert bool((b.conversion <= b.click).all())  # converting needs a click
        assert b.sparse_lengths.numel() == cfg.num_sparse_tables * cfg.batch_size
        assert b.sparse_values.numel() == int(b.sparse_lengths.sum())
        assert b.sparse_values.max() < cfg.sparse_table_size
        assert len(b.sparse_keys) == cfg.num_sparse_tables
    assert [t["feature_names"][0] for t in ds.info["sparse_tables"]] == list(ds.keys)


def test_lengths_follow_gem_lognormal():
    """Same formula as docs/benchmarks.md's gem_lognormal (median 1024, lo 32, hi 16384)."""
    got = gem_lognormal_lengths(64, 1024, 1.0, 32, 16384, torch.Generator().manual_seed(1))
    z = torch.randn(64, generator=torch.Generator().manual_seed(1))
    want = (1024 * torch.exp(1.0 * z)).round().clamp(32, 16384).long()
    assert torch.equal(got, want)
    big = gem_lognormal_lengths(4000, 100, 1.0, 1, 10_000, torch.Generator().manual_seed(0))
    assert 90 <= big.float().median() <= 110


def test_zero_length_histories_can_occur():
    cfg = SyntheticGemConfig(**{**SMALL, "median_len": 1, "len_sigma": 2.0, "batch_size": 64})
    b = SyntheticGemDataset(cfg, seed=0).train_batch(0)
    assert int((b.lengths == 0).sum()) > 0
    validate_offsets(b.history_offsets, b.history_items.numel())


def test_planted_labels_are_learnable_and_noisy():
    ds = SyntheticGemDataset(SyntheticGemConfig(**SMALL), seed=0)
    probs, labels = [], []
    for i in range(10):
        truth = {}
        b = ds._batch(stream_generator(0, 99, i), truth)
        probs.append(truth["click"])
        labels.append(b.click)
    p, y = torch.cat(probs), torch.cat(labels)
    assert 0.2 < float(y.mean()) < 0.8
    assert binary_auc(p, y) > 0.75  # the planted model ranks well above chance
    assert binary_auc(p, y) < 0.99  # but labels are noisy draws, not a deterministic function


@pytest.mark.parametrize("bad,word", [
    ({"min_len": 100}, "min_len"),
    ({"num_items": 3}, "num_clusters"),
    ({"max_candidates": 0}, "max_candidates"),
    ({"favourite_clusters": 99}, "favourite_clusters"),
])
def test_synthetic_bad_config(bad, word):
    with pytest.raises(ConfigError, match=word):
        SyntheticGemDataset(SyntheticGemConfig(**{**SMALL, **bad}))


def test_batch_to_moves_every_tensor():
    b = SyntheticGemDataset(SyntheticGemConfig(**SMALL)).train_batch(0)
    moved = b.to("meta")
    assert all(getattr(moved, f.name).device.type == "meta" for f in dataclasses.fields(b)
               if isinstance(getattr(b, f.name), torch.Tensor))
    assert moved.sparse_keys == b.sparse_keys


# -- movielens -------------------------------------------------------------------------------------
def write_ratings(path, users=12, items=30, seed=0, shuffle=True):
    """A small ratings.dat; each user's lines are written out of time order to test the sort."""
    rng = random.Random(seed)
    truth, lines = {}, []
    for u in range(1, users + 1):
        n = 4 + u % 5
        seq = [rng.randrange(1, items + 1) * 7 for _ in range(n)]  # raw ids are sparse (multiples of 7)
        truth[u] = seq
        for i, m in enumerate(seq):
            lines.append(f"{u}::{m}::{rng.randrange(1, 6)}::{1_000_000 + 100 * i}")
    if shuffle:
        rng.shuffle(lines)
    path.write_text("\n".join(lines) + "\n")
    return truth


def test_movielens_leave_one_out(tmp_path):
    path = tmp_path / "ratings.dat"
    truth = write_ratings(path)
    ds = MovieLensDataset(MovieLensConfig(path=str(path), batch_size=4, max_len=3), seed=0)
    movies = sorted({m for seq in truth.values() for m in seq})
    index = {m: i for i, m in enumerate(movies)}
    assert ds.info["num_items"] == len(movies) and ds.info["num_users"] == len(truth)
    for k, user in enumerate(ds.users):
        seq = [index[m] for m in truth[user]]
        assert ds.test_items[k] == seq[-1] and ds.val_items[k] == seq[-2]
        assert ds.train_seqs[k].tolist() == seq[:-2]
    # training: max_len most recent inputs, targets shifted by one
    b = ds.train_batch(0)
    assert isinstance(b, SeqBatch) and b.num_samples == 4 and int(b.lengths.max()) <= 3
    validate_offsets(b.offsets, b.items.numel())
    for s in range(b.num_samples):
        lo, hi = int(b.offsets[s]), int(b.offsets[s + 1])
        items, targets = b.items[lo:hi].tolist(), b.targets[lo:hi].tolist()
        assert items[1:] == targets[:-1]
        assert any(items + [targets[-1]] == t.tolist()[-len(items) - 1:] for t in ds.train_seqs)
    # evaluation: only the last position has a target
    for split in ("val", "test"):
        ds2 = MovieLensDataset(MovieLensConfig(path=str(path), batch_size=5, max_len=3, eval_split=split))
        batches = ds2.eval_batches(100)
        assert sum(x.num_samples for x in batches) == len(truth)  # every user exactly once
        for eb in batches:
            last = eb.offsets[1:] - 1
            assert bool((eb.targets[last] >= 0).all()) and int((eb.targets >= 0).sum()) == eb.num_samples
        expected = set()
        for i in range(len(ds2.users)):
            # train_items = "auto": training ends right before the held-out item of the split
            history = ds2.train_seqs[i].tolist()
            target = ds2.val_items[i] if split == "val" else ds2.test_items[i]
            assert history == ds2.seqs[i].tolist()[:-2 if split == "val" else -1]
            expected.add((tuple(history[-3:]), target))
        got = {(tuple(eb.items[int(eb.offsets[j]):int(eb.offsets[j + 1])].tolist()), int(eb.targets[int(eb.offsets[j + 1]) - 1]))
               for eb in batches for j in range(eb.num_samples)}
        assert got == expected


def test_movielens_is_deterministic_and_epochs_cover_users(tmp_path):
    path = tmp_path / "ratings.dat"
    write_ratings(path, users=10)
    a = MovieLensDataset(MovieLensConfig(path=str(path), batch_size=5, max_len=50), seed=1)
    b = MovieLensDataset(MovieLensConfig(path=str(path), batch_size=5, max_len=50), seed=1)
    assert _equal(a.train_batch(3), b.train_batch(3))
    # one epoch = 10 trainable users in 2 batches: every training sequence once
    seen = sorted(tuple(x.items[int(x.offsets[i]):int(x.offsets[i + 1])].tolist())
                  for x in (a.train_batch(0), a.train_batch(1)) for i in range(5))
    want = sorted(tuple(s[:-1].tolist()) for s in a.train_seqs)
    assert seen == want


def test_movielens_missing_file(tmp_path):
    missing = tmp_path / "nope" / "ratings.dat"
    with pytest.raises(ConfigError, match="nope/ratings.dat.*UserID::MovieID::Rating::Timestamp"):
        MovieLensDataset(MovieLensConfig(path=str(missing)))


@pytest.mark.parametrize("bad", ["1::2::3", "1::x::3::4", "1,2,3,4", "1::2::3::4::5"])
def test_movielens_malformed_line(tmp_path, bad):
    path = tmp_path / "ratings.dat"
    path.write_text(f"1::10::5::100\n1::11::4::101\n{bad}\n")
    with pytest.raises(ConfigError, match=r"ratings.dat, line 3: expected UserID::MovieID::Rating::Timestamp"):
        MovieLensDataset(MovieLensConfig(path=str(path)))


def test_movielens_too_few_events(tmp_path):
    path = tmp_path / "ratings.dat"
    path.write_text("1::10::5::100\n1::11::4::101\n2::10::5::100\n")
    with pytest.raises(ConfigError, match="3 or more ratings"):
        MovieLensDataset(MovieLensConfig(path=str(path)))


def test_gem_batch_select():
    b = SyntheticGemDataset(SyntheticGemConfig(**SMALL)).train_batch(0)
    order = [5, 0, 3]
    s = b.select(order)
    assert s.num_samples == 3 and s.sparse_keys == b.sparse_keys
    f = len(b.sparse_keys)
    sp_off = torch.cat([torch.zeros(1, dtype=torch.long), b.sparse_lengths.cumsum(0)])
    s_off = torch.cat([torch.zeros(1, dtype=torch.long), s.sparse_lengths.cumsum(0)])
    for new, old in enumerate(order):
        ho, so = b.history_offsets, s.history_offsets
        assert torch.equal(s.history_items[so[new]:so[new + 1]], b.history_items[ho[old]:ho[old + 1]])
        co, sco = b.cand_offsets, s.cand_offsets
        for name in ("cand_items", "click", "conversion"):
            assert torch.equal(getattr(s, name)[sco[new]:sco[new + 1]], getattr(b, name)[co[old]:co[old + 1]])
        for k in range(f):  # key-major bags: bag (k, sample) sits at k * B + sample
            ob, nb = k * b.num_samples + old, k * 3 + new
            assert torch.equal(s.sparse_values[s_off[nb]:s_off[nb + 1]], b.sparse_values[sp_off[ob]:sp_off[ob + 1]])
    empty = b.select([])
    assert empty.num_samples == 0 and empty.num_tokens == 0 and empty.sparse_lengths.numel() == 0


def test_seq_batch_select(tmp_path):
    path = tmp_path / "ratings.dat"
    write_ratings(path)
    b = MovieLensDataset(MovieLensConfig(path=str(path), batch_size=4, max_len=3)).train_batch(0)
    s = b.select(torch.tensor([2, 2, 0]))
    for new, old in enumerate([2, 2, 0]):
        lo, hi, nlo, nhi = b.offsets[old], b.offsets[old + 1], s.offsets[new], s.offsets[new + 1]
        assert torch.equal(s.items[nlo:nhi], b.items[lo:hi]) and torch.equal(s.targets[nlo:nhi], b.targets[lo:hi])
