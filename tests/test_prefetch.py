"""The host prefetch of the next step's samples (gemzoo.data.lookahead.ShardPrefetcher, used by Lookahead)."""

import threading
import time

import pytest
import torch

from gemzoo.data.exchange import load_shard
from gemzoo.data.lookahead import Lookahead, ShardPrefetcher
from gemzoo.interfaces.batching import DataParallelGroup


class Recording:
    """A dataset whose batches are a pure function of the step, recording which thread built each."""

    def __init__(self, fail_at: int | None = None):
        self.built: list[tuple[int, str]] = []
        self.fail_at = fail_at

    def train_batch(self, step):
        self.built.append((step, threading.current_thread().name))
        if step == self.fail_at:
            raise ValueError(f"no batch {step}")
        return torch.arange(4) + 10 * step


def test_get_returns_the_prefetched_part_and_loads_anything_else_now():
    ds, p = Recording(), ShardPrefetcher()
    p.prefetch(ds, 3, 0, 1)
    assert torch.equal(p.get(ds, 3, 0, 1), load_shard(ds, 3, 0, 1))
    assert ds.built[0][0] == 3 and ds.built[0][1].startswith("gemzoo-prefetch")
    p.prefetch(ds, 4, 0, 1)
    assert torch.equal(p.get(ds, 7, 0, 1), torch.arange(4) + 70)  # not what was prefetched: built now
    assert ds.built[-1] == (7, threading.current_thread().name)
    p.close()


class Slow(Recording):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def train_batch(self, step):
        time.sleep(self.seconds)
        return super().train_batch(step)


def test_last_wait_is_what_get_blocked_for():
    ds, p = Slow(0.2), ShardPrefetcher()
    p.get(ds, 0, 0, 1)  # nothing prefetched: the whole load
    assert p.last_wait_s >= 0.2
    p.prefetch(ds, 1, 0, 1)
    time.sleep(0.4)  # the prefetch finished meanwhile
    p.get(ds, 1, 0, 1)
    assert p.last_wait_s < 0.1
    p.close()


def test_an_error_in_the_thread_is_raised_by_get():
    ds, p = Recording(fail_at=2), ShardPrefetcher()
    p.prefetch(ds, 2, 0, 1)
    with pytest.raises(ValueError, match="no batch 2"):
        p.get(ds, 2, 0, 1)
    p.close()


def test_one_rank_lookahead_builds_the_next_step_while_this_one_trains():
    ds = Recording()
    with Lookahead(object(), name="none") as la:
        got = [la.batch(ds, s, DataParallelGroup(), "cpu", None, next_step=s + 1 if s < 3 else None)
               for s in range(4)]
    assert [g.tolist() for g in got] == [(torch.arange(4) + 10 * s).tolist() for s in range(4)]
    threads = dict(ds.built)
    assert threads[0] == threading.current_thread().name  # nothing ahead of the first step
    assert all(threads[s].startswith("gemzoo-prefetch") for s in (1, 2, 3))
    assert [s for s, _ in ds.built] == [0, 1, 2, 3]  # each step built once, none past the last
