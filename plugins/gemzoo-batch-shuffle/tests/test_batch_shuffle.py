"""base-batch-shuffle: registration, the shared batching conformance suite under every option set, balance,
bad input, and on 2 gloo ranks the trainer's losses equal an unshuffled run's and resume is bit-exact."""

from __future__ import annotations

import importlib
import json
import math
import os
from collections import Counter

import batch_shuffle_cases as cases
import numpy as np
import pytest
import torch
from gemzoo_batch_shuffle import BatchShuffle, BatchShuffleOptions, imbalance, partition

from gemzoo.api import ConfigError, PluginError, registry
from gemzoo.testing.batching import batching_cases, check_assignment, check_global_loss

VARIANTS = {
    "default": BatchShuffleOptions(),
    "equal-count": BatchShuffleOptions(equal_count=True),
    "kk": BatchShuffleOptions(method="kk"),
    "bldm-free": BatchShuffleOptions(method="bldm"),
    "lpt-equal": BatchShuffleOptions(method="lpt", equal_count=True),
    "no-refine": BatchShuffleOptions(refine=False, keep_local=False),
}


def test_entry_point_registers_the_policy():
    assert "base-batch-shuffle" in registry.names("batching")
    entry = registry.entry("batching", "base-batch-shuffle")
    assert isinstance(entry.obj, BatchShuffle) and entry.distribution == "gemzoo-batch-shuffle"


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("case", batching_cases(), ids=str)
def test_conformance_every_option_set(variant, case):
    check_assignment(BatchShuffle(VARIANTS[variant]), case)


@pytest.mark.parametrize("variant", ["equal-count", "kk"])
def test_global_loss_does_not_depend_on_the_split(variant):
    from gemzoo.testing.memory import tiny_model

    model, batch = tiny_model(0, d_model=16, batch_size=11)
    check_global_loss(BatchShuffle(VARIANTS[variant]), model.double(), batch, 3, weight=lambda b: b.num_candidates)


@pytest.mark.parametrize("world", [2, 4, 8, 64, 256])  # 256: LPT in blocks
def test_balances_gem_lognormal(world):
    """64 samples per rank: max/mean <= 1.01 (the issue's bar is 1.05 at 64 ranks), far below the contiguous
    split's; equal_count keeps every rank within one sample."""
    lengths = cases.gem_lognormal(64 * world, seed=world).double()
    costs = lengths**2 + 512 * lengths
    plain = imbalance(costs, list(torch.arange(costs.numel()).tensor_split(world)))
    for opts in (BatchShuffleOptions(), BatchShuffleOptions(equal_count=True)):
        groups = BatchShuffle(opts).assign(costs, world)
        assert imbalance(costs, groups) <= 1.01 < plain
        if opts.equal_count:
            assert {len(g) for g in groups} == {64}


@pytest.mark.parametrize("per_rank,extra", [(64, 0), (63, 5)])
def test_lpt_in_blocks_with_equal_counts_matches_the_heap(per_rank, extra):
    """On many ranks LPT runs in blocks; with equal_count every rank still holds floor or ceil(N/W) samples,
    each sample once, and the result is within 1e-4 of the heap's (the per-sample loop it replaces)."""
    part = importlib.import_module("gemzoo_batch_shuffle.partition")  # the module (the package exports the function)
    world = part.BLOCK_LPT_MIN_W
    lengths = cases.gem_lognormal(per_rank * world + extra, seed=3).double()
    c = (lengths**2 + 512 * lengths).numpy()
    blocks = part._lpt(c, world, True)
    part.BLOCK_LPT_MIN_W, saved = world + 1, part.BLOCK_LPT_MIN_W
    try:
        heap = part._lpt(c, world, True)
    finally:
        part.BLOCK_LPT_MIN_W = saved
    assert sorted(np.concatenate(blocks).tolist()) == list(range(c.size))
    assert sorted(len(g) for g in blocks) == sorted(len(g) for g in heap)
    assert {len(g) for g in blocks} <= {per_rank, per_rank + 1}
    assert part._loads(c, blocks).max() <= part._loads(c, heap).max() * (1 + 1e-4)


def test_refine_and_kk_beat_sorting_on_few_samples():
    """4 samples per rank, heavy tail: the result is never worse than greedy longest-first (LPT)."""
    lengths = cases.gem_lognormal(32, seed=7).double()
    costs = lengths**2
    order = sorted(range(32), key=lambda i: (-float(costs[i]), i))
    loads = [0.0] * 8
    for i in order:
        loads[loads.index(min(loads))] += float(costs[i])
    lpt = max(loads) / (sum(loads) / 8)
    assert imbalance(costs, partition(costs, 8)) <= lpt + 1e-12


def test_keep_local_moves_nothing_when_the_loaded_split_is_balanced():
    costs = torch.ones(12, dtype=torch.float64)
    groups = partition(costs, 3, equal_count=True)
    assert [g.tolist() for g in groups] == [t.tolist() for t in torch.arange(12).tensor_split(3)]


def test_every_rank_gets_a_sample_when_the_batch_allows():
    costs = torch.tensor([1e6, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # zero-length samples too
    for opts in VARIANTS.values():
        groups = BatchShuffle(opts).assign(costs, 4)
        assert all(len(g) for g in groups) and sorted(torch.cat(groups).tolist()) == list(range(8))


def test_a_world_larger_than_the_batch_leaves_ranks_empty():
    """Defined behaviour: N < W gives N ranks one sample each (the trainer then stops with a clear error)."""
    groups = partition(torch.tensor([5.0, 1.0, 3.0], dtype=torch.float64), 5)
    assert sorted(len(g) for g in groups) == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([1.0, float("nan"), 2.0]), r"samples \[1\].*finite"),
    (torch.tensor([1.0, 2.0, -3.0]), r"samples \[2\].*>= 0"),
    (torch.tensor([1.0, float("inf")]), r"samples \[1\]"),
    (torch.ones(2, 2), "1-D"),
])
def test_bad_costs_are_named(bad, match):
    with pytest.raises(PluginError, match=match):
        BatchShuffle().assign(bad, 2)


def test_bad_world_and_options_are_named():
    with pytest.raises(PluginError, match="world_size must be an int >= 1"):
        BatchShuffle().assign(torch.ones(3), 0)
    with pytest.raises(ConfigError, match="method must be one of auto, kk, bldm, lpt"):
        BatchShuffleOptions(method="greedy")
    with pytest.raises(ConfigError, match="with equal_count = true use"):
        BatchShuffleOptions(method="kk", equal_count=True)
    with pytest.raises(ConfigError, match="equal_count must be true or false"):
        BatchShuffleOptions(equal_count=1)


def test_options_from_the_config(tmp_path):
    from gemzoo.api import configured, load_config

    cfg = load_config(cases.ROOT + "/configs/gem-tiny.toml", overrides=[
        "plugins.batching='base-batch-shuffle'", "plugins.options.base-batch-shuffle.equal_count=true"])
    policy = configured("batching", "base-batch-shuffle", cfg)
    assert policy.options.equal_count and policy.options.method == "auto"


def test_overlap_is_the_option_and_only_for_policies_that_say_so():
    """overlap = true (the default) lets the trainer partition a step ahead in a worker thread; false, a
    policy without the attribute (or with a non-True one), or one that moves samples itself stays synchronous;
    one rank never calls the policy (no worker is started)."""
    from gemzoo.api import DataParallelGroup, Lookahead, overlap_worker, overlaps

    assert BatchShuffleOptions().overlap is True and overlaps(BatchShuffle())
    assert not overlaps(BatchShuffle(BatchShuffleOptions(overlap=False)))
    assert not overlaps(registry.get("batching", "none"))  # moves samples itself (nothing)

    class Unsure:
        overlap = "yes"

        def assign(self, costs, world_size):
            return list(torch.arange(costs.numel()).tensor_split(world_size))

    assert not overlaps(Unsure()) and overlap_worker(Unsure()) == "thread"
    assert overlap_worker(BatchShuffle()) == "process"
    assert overlap_worker(BatchShuffle(BatchShuffleOptions(worker="thread"))) == "thread"
    with pytest.raises(ConfigError, match="overlap must be true or false"):
        BatchShuffleOptions(overlap="true")
    with pytest.raises(ConfigError, match="worker must be one of thread, process, got 'gpu'"):
        BatchShuffleOptions(worker="gpu")
    from gemzoo.api import overlap_depth

    assert overlap_depth(BatchShuffle()) == 1 and overlap_depth(Unsure()) == 1
    assert overlap_depth(BatchShuffle(BatchShuffleOptions(overlap_depth=2))) == 2
    for bad in (0, 9, 1.5, True):
        with pytest.raises(ConfigError, match="overlap_depth must be an int from 1 to 8"):
            BatchShuffleOptions(overlap_depth=bad)

    class Data:
        def train_batch(self, step):
            from gemzoo.testing.memory import tiny_model

            return tiny_model(step, d_model=16, batch_size=5)[1]

    look = Lookahead(BatchShuffle())
    with look:
        batch = look.batch(Data(), 3, DataParallelGroup(), torch.device("cpu"), lambda b: 1 / 0, next_step=4)
    load_wait = look.last.pop("load_wait_s")  # the whole load: nothing was prefetched for step 3
    assert batch.num_samples == 5 and look.last == {"step": 3, "ahead": False, "assign_s": 0.0, "wait_s": 0.0}
    assert load_wait > 0
    assert look._worker is None and not look._ahead


@pytest.mark.multiprocess
def test_partition_workers_give_the_synchronous_answer_and_its_errors():
    """A process worker (the policy pickled to a spawned interpreter, numpy both ways) and a thread give
    route_checked's route exactly; bad costs raise the same PluginError from result(); a bad kind is named."""
    from gemzoo.api import PartitionWorker, route_checked

    costs = cases.gem_lognormal(8 * 64, seed=3).double() ** 2
    counts = [60, 70, 64, 64, 64, 64, 64, 62]
    want, _ = route_checked(BatchShuffle(), costs, counts, 2, "base-batch-shuffle")
    for kind in ("process", "thread"):
        worker = PartitionWorker(kind)
        try:
            got, seconds = worker.submit(BatchShuffle(), costs, counts, 2, "base-batch-shuffle").result()
            assert seconds > 0
            for f in ("send_index", "send_counts", "recv_counts", "order"):
                g, w = getattr(got, f), getattr(want, f)
                assert g.dtype == torch.int64 and torch.equal(g, w), f
            bad = worker.submit(BatchShuffle(), torch.tensor([1.0, float("nan")], dtype=torch.float64), [1, 1], 0, "x")
            with pytest.raises(PluginError, match=r"samples \[1\]"):
                bad.result()
        finally:
            worker.shutdown()
    with pytest.raises(PluginError, match="partition worker must be one of thread, process, got 'gpu'"):
        PartitionWorker("gpu")


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and two CPUs")
def test_a_process_worker_leaves_the_trainers_bound_core():
    """A spawned worker inherits the mask of the thread that starts it; when OpenMP has bound the trainer's main
    thread to one core, the worker moves to the others rather than take that core from the kernel launches.
    On a GPU run the trainer's intra-op team leaves it a core while it lives, and is whole again after shutdown."""
    from gemzoo.api import PartitionWorker, available_cpus

    before = os.sched_getaffinity(0)
    first = min(before)
    try:
        os.sched_setaffinity(0, {first})
        worker = PartitionWorker("process")
        try:
            where = worker.where()
        finally:
            worker.shutdown()
    finally:
        os.sched_setaffinity(0, before)
    assert where["threads"] == 1 and first not in where["cpus"]
    assert set(where["cpus"]) == available_cpus() - {first}
    threads = torch.get_num_threads()
    worker = PartitionWorker("process")  # unbound: the worker keeps the whole mask
    try:
        assert set(worker.where()["cpus"]) == before
        worker.leave_a_core()  # what a GPU run's Lookahead does: the OpenMP team leaves the worker a core
        worker.leave_a_core()  # once
        assert torch.get_num_threads() == (len(available_cpus()) - 1 if threads >= len(available_cpus()) else threads)
    finally:
        worker.shutdown()
    assert torch.get_num_threads() == threads


@pytest.mark.multiprocess
def test_overhead_bench_runs_on_cpu(tmp_path):
    """bench/overhead.py end to end on a very small gem (the H200 call's code path, CPU): every phase and world
    reported, the partition timed alone and overlapped (process and thread workers), waited for at every step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("batch_shuffle_overhead", cases.ROOT +
                                                  "/plugins/gemzoo-batch-shuffle/bench/overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "overhead.json"
    assert bench.main(["--config", cases.ROOT + "/configs/gem-tiny.toml", "--plugins", "", "--steps", "4",
                       "--warmup", "1", "--worlds", "2,8", "--per-rank", "16", "--out", str(out),
                       "--set", "run.device='cpu'", "--set", "model.d_model=16", "--set", "data.batch_size=8"]) == 0
    got = json.loads(out.read_text())
    assert set(got["phases"]) == {"none", "base-batch-shuffle"} and not got["notes"][1:]
    assert [r["world"] for r in got["worlds"]] == [2, 8] and [r["samples"] for r in got["worlds"]] == [32, 128]
    for r in got["worlds"]:
        assert len(r["alone"]["assign_ms"]) == 3 and r["alone"]["median_ms"] > 0
        for kind in ("process", "thread"):
            assert len(r[kind]["wait_ms"]) == len(r[kind]["step_ms"]) == 3 and r[kind]["assign_in_worker_median_ms"] > 0
            assert all(w >= 0 for w in r[kind]["wait_ms"]) and isinstance(r[kind]["hidden"], bool)
    with pytest.raises(SystemExit):
        bench.parse(["--worlds", "1,8"])  # one rank never partitions


@pytest.mark.multiprocess
def test_rebalance_on_gloo_every_option_set(tmp_path):
    """The shared suite's 2-rank check (each rank loads its part; the samples received equal the global
    batch's select of the partition, bit for bit; uneven parts, an empty rank; the global loss unchanged)."""
    from gemzoo.testing.batching import check_rebalance_on_gloo

    check_rebalance_on_gloo({n: BatchShuffle(o) for n, o in VARIANTS.items() if n in ("equal-count", "kk")}, tmp_path)


@pytest.mark.multiprocess
def test_trainer_losses_equal_unshuffled_and_resume_is_bit_exact(tmp_path):
    """gem on 2 gloo ranks, 9 samples a step (uneven): base-batch-shuffle's 10 losses (overlap on, the default:
    steps 1-9 partitioned ahead in a worker process) equal the unshuffled run's within 1e-6 relative and the
    synchronous run's (overlap = false) bit for bit, with the same samples on each rank at every step (and
    5 steps with a worker thread too, and 10 partitioned two steps ahead in two processes); every
    step trains each of the global batch's 9 samples exactly once (keys counted); 5 steps + resume to 10
    reproduce the straight run bit for bit (the resumed run's first step partitions synchronously, the rest
    ahead); with 1 sample for 2 ranks every rank stops with the same clear error."""
    from gemzoo.testing.comms import spawn

    runs = [("none", "none", 10, False, []),
            ("shuffle", "base-batch-shuffle", 10, False, []),
            ("sync", "base-batch-shuffle", 10, False, ["plugins.options.base-batch-shuffle.overlap=false"]),
            ("thread", "base-batch-shuffle", 5, False, ["plugins.options.base-batch-shuffle.worker='thread'"]),
            ("depth2", "base-batch-shuffle", 10, False, ["plugins.options.base-batch-shuffle.overlap_depth=2"]),
            ("half", "base-batch-shuffle", 5, False, []),
            ("half@resumed", "base-batch-shuffle", 10, True, []),
            ("tiny", "base-batch-shuffle", 1, False, ["data.batch_size=1"])]  # 1 sample, 2 ranks
    spawn(cases.train_rank, 2, str(tmp_path), runs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(ranks[0][k].get("losses") == ranks[1][k].get("losses") for k in ranks[0])
    got, want = ranks[0]["shuffle"]["losses"], ranks[0]["none"]["losses"]
    assert len(got) == 10 and all(math.isfinite(x) for x in got)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-6, atol=0)
    assert ranks[0]["shuffle"]["samples"] == [9] * 10
    # overlapped == synchronous, bit for bit, and the overlap did run (and the sync run did not)
    assert ranks[0]["sync"]["losses"] == got
    assert all(r["sync"]["keys"] == r["shuffle"]["keys"] for r in ranks)
    assert ranks[0]["shuffle"]["ahead"] == [False] + [True] * 9 and ranks[0]["sync"]["ahead"] == [False] * 10
    assert ranks[0]["none"]["ahead"] == [False] * 10
    depth2 = ranks[0]["depth2"]  # two steps ahead in two worker processes: the same, bit for bit
    assert depth2["losses"] == got and depth2["ahead"] == [False] + [True] * 9
    assert all(r["depth2"]["keys"] == r["shuffle"]["keys"] for r in ranks)
    thread = ranks[0]["thread"]  # worker = "thread" (the default is a process): the same, bit for bit
    assert thread["losses"] == got[:5] and thread["ahead"] == [False] + [True] * 4
    assert all(r["thread"]["keys"] == r["shuffle"]["keys"][:5] for r in ranks)
    for run in ("shuffle", "half@resumed"):  # every sample of the global batch exactly once per step
        for step in range(len(ranks[0][run]["keys"])):
            trained = sorted(k for r in ranks for k in r[run]["keys"][step])
            assert trained == sorted(k for r in ranks for k in r[run]["loaded"][step]) and len(trained) == 9
    assert any(ranks[0]["shuffle"]["keys"][s] != ranks[0]["shuffle"]["loaded"][s] for s in range(10)), \
        "the policy moved no sample in 10 steps: the overlap would be untested"
    resumed = ranks[0]["half@resumed"]
    assert resumed["steps"][0] == 6 and resumed["losses"] == got[5:]
    assert resumed["ahead"] == [False] + [True] * 4 and resumed["keys"] == ranks[0]["shuffle"]["keys"][5:]
    for r in ranks:  # a world larger than the batch: a clear error on every rank, no hang
        assert "1 of 2 ranks have no loss terms" in r["tiny"]["error"] and "data.batch_size" in r["tiny"]["error"]


@pytest.mark.multiprocess
def test_four_ranks_rebalance_and_train_like_the_unshuffled_run(tmp_path):
    """The issue's 4-process case: the shared rebalance check on 4 gloo ranks, then gem on 4 ranks with 9
    samples a step (3 ranks of 2, one of 3 when loaded): the shuffled run's 10 losses equal the unshuffled run's
    within 1e-6 relative and every step trains all 9 samples."""
    from gemzoo.testing.batching import check_rebalance_on_gloo
    from gemzoo.testing.comms import spawn

    check_rebalance_on_gloo({"kk": BatchShuffle(VARIANTS["kk"])}, tmp_path, world=4)
    runs = [("none", "none", 10, False, []), ("shuffle", "base-batch-shuffle", 10, False, [])]
    spawn(cases.train_rank, 4, str(tmp_path), runs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["shuffle"]["losses"] == ranks[0]["shuffle"]["losses"] for r in ranks)  # one global loss
    got, want = ranks[0]["shuffle"]["losses"], ranks[0]["none"]["losses"]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-6, atol=0)
    assert ranks[0]["shuffle"]["samples"] == [9] * 10


def test_refine_stops_within_its_tolerance_of_the_mean():
    part = importlib.import_module("gemzoo_batch_shuffle.partition")
    c = np.array([4.0, 1.0, 5.0, 3.0, 3.0])
    groups = [np.array([0, 1]), np.array([2, 3, 4])]  # loads 5 and 11, the mean 8: 37.5% above it
    moved = part._refine(c, groups, False, max_steps=8, tol=0.0)
    assert part._loads(c, moved).tolist() == [8.0, 8.0]
    kept = part._refine(c, groups, False, max_steps=8, tol=0.4)  # within 40% already: nothing moves
    assert [g.tolist() for g in kept] == [[0, 1], [2, 3, 4]]


def test_refine_is_skipped_when_its_steps_cannot_pay():
    """Each step lowers one rank, so with more ranks than steps the heaviest cannot end below the (steps + 1)-th
    heaviest load: where that is within the tolerance, the search does not run (8192 ranks)."""
    part = importlib.import_module("gemzoo_batch_shuffle.partition")
    c = np.array([6.0, 5.0] * 3 + [5.0, 4.8] * 7)  # ranks 0-2 hold 11, ranks 3-9 hold 9.8
    groups = [np.array([2 * r, 2 * r + 1]) for r in range(10)]
    skipped = part._refine(c, groups, False, max_steps=2, tol=1e-4)  # 3 ranks at 11: 2 steps leave one there
    assert [g.tolist() for g in skipped] == [g.tolist() for g in groups]
    searched = part._refine(c, groups, False, max_steps=3, tol=1e-4)  # 3 steps can lower all three
    assert part._loads(c, searched).max() < 11.0


def _greedy_keep_local(groups, n, w):
    """keep_local's rule in plain Python: (subset, rank) pairs sharing >= 2 samples, most first (ties by subset,
    then rank), each taken while both are free; then each open subset, in order, its first free rank among
    those it shares one sample with; the rest in order."""
    loader = [r for r in range(w) for _ in range(n // w + (r < n % w))]
    shared = Counter((s, loader[i]) for s, g in enumerate(groups) for i in g.tolist())
    rank_of, taken = {}, set()
    for (s, r), k in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0])):
        if k >= 2 and s not in rank_of and r not in taken:
            rank_of[s] = r
            taken.add(r)
    for (s, r), k in sorted(shared.items()):
        if k == 1 and s not in rank_of and r not in taken:
            rank_of[s] = r
            taken.add(r)
    rest = iter(r for r in range(w) if r not in taken)
    out = [None] * w
    for s in range(w):
        out[rank_of[s] if s in rank_of else next(rest)] = groups[s]
    return out


def _heap_lpt(c, w, equal_count):
    part = importlib.import_module("gemzoo_batch_shuffle.partition")
    part.BLOCK_LPT_MIN_W, saved = w + 1, part.BLOCK_LPT_MIN_W
    try:
        return part._lpt(c, w, equal_count)
    finally:
        part.BLOCK_LPT_MIN_W = saved


@pytest.mark.parametrize("dist", ["gem", "zipf-like", "ties"])
@pytest.mark.parametrize("world,extra", [(256, 0), (512, 7), (1024, 3)])
def test_block_lpt_and_pair_refine_balance_like_the_heap(world, extra, dist):
    """The block LPT (ranks kept sorted by load, merged back after each block) and the refine on pairs of ranks
    (many ranks): every sample once, floor/ceil(N/W) each with equal counts, a rank for every sample's owner,
    and max/mean within 1e-4 of the heap LPT followed by the sequential refine."""
    part = importlib.import_module("gemzoo_batch_shuffle.partition")
    n = 64 * world + extra
    rng = np.random.default_rng(world + extra)
    if dist == "gem":
        lengths = cases.gem_lognormal(n, seed=world).double().numpy()
        c = lengths**2 + 512 * lengths
    elif dist == "zipf-like":
        c = (32.0 * np.minimum(rng.zipf(1.5, n), 512)) ** 2
    else:
        c = rng.integers(0, 4, n).astype(np.float64)  # zeros and ties everywhere
    for eq in (False, True):
        order, placed = part._block_owner(c, world, eq)
        assert sorted(order.tolist()) == list(range(n)) and placed.min() >= 0 and placed.max() < world
        owner = np.empty(n, dtype=np.int64)
        owner[order] = placed
        refined = part._refine_pairs(c, owner, world, eq, part.REFINE_STEPS)
        heap = part._refine(c, _heap_lpt(c, world, eq), eq, part.REFINE_STEPS)
        for got in (owner, refined):
            sizes = np.bincount(got, minlength=world)
            assert sizes.sum() == n and (not eq or set(sizes.tolist()) <= {n // world, -(-n // world)})
        loads = np.bincount(refined, weights=c, minlength=world)
        assert loads.max() <= np.bincount(owner, weights=c, minlength=world).max()  # the refine never worsens
        assert loads.max() / loads.mean() <= part._loads(c, heap).max() / loads.mean() * (1 + 1e-4)


def test_the_pair_refine_moves_and_swaps_toward_the_mean():
    """Free counts: the heavy rank's sample that halves the gap moves; equal counts: the best swap, the same
    exchange the sequential refine makes on two ranks."""
    part = importlib.import_module("gemzoo_batch_shuffle.partition")
    c = np.array([4.0, 1.0, 5.0, 3.0, 3.0])
    owner = np.array([0, 0, 1, 1, 1])  # loads 5 and 11
    moved = part._refine_pairs(c, owner, 2, False, 8, tol=0.0)
    assert np.bincount(moved, weights=c).tolist() == [8.0, 8.0]
    seq = part._refine(c, [np.array([0, 1]), np.array([2, 3, 4])], True, 8, tol=0.0)
    swapped = part._refine_pairs(c, owner, 2, True, 8, tol=0.0)
    assert np.bincount(swapped, minlength=2).tolist() == [2, 3]
    assert sorted(np.bincount(swapped, weights=c).tolist()) == sorted(part._loads(c, seq).tolist())
    assert part._refine_pairs(c, owner, 2, False, 8, tol=0.4).tolist() == owner.tolist()  # within 40%: nothing


def test_keep_local_with_empty_subsets_and_fewer_samples_than_ranks():
    """keep_local's run counting on subsets that are empty (first, last, inside) matches the plain rule."""
    part = importlib.import_module("gemzoo_batch_shuffle.partition")
    for n, w in ((3, 5), (7, 7), (40, 6)):
        rng = np.random.default_rng(n)
        for _ in range(20):
            owner = rng.integers(1, w - 1, n) if w > 2 else rng.integers(0, w, n)  # subsets 0 and w-1 empty
            groups = [np.flatnonzero(owner == s) for s in range(w)]
            got = part._keep_local(groups, n, w)
            assert [g.tolist() for g in got] == [g.tolist() for g in _greedy_keep_local(groups, n, w)]


@pytest.mark.parametrize("world", [5, 256, 1024])
def test_the_fast_paths_give_the_plain_answers(world):
    """The radix sort of cost ranks gives a stable argsort's order, and keep_local's run counting the rule's
    matching."""
    part = importlib.import_module("gemzoo_batch_shuffle.partition")
    rng = np.random.default_rng(world)
    for c in (rng.integers(0, 50, world * 7 + 3).astype(np.float64), rng.random(world * 5)):
        assert np.array_equal(part._decreasing(c), np.argsort(-c, kind="stable"))
        groups = part._block_lpt(c, world)
        got = part._keep_local(groups, c.size, world)
        assert [g.tolist() for g in got] == [g.tolist() for g in _greedy_keep_local(groups, c.size, world)]


def test_the_sort_keys_give_the_stable_orders():
    """_decreasing's one sort of distinct int64 keys is the stable argsort, also for -0.0, ties, and two costs
    that differ only in the bits the key drops (the stable sort then); _group_by_rank likewise."""
    part = importlib.import_module("gemzoo_batch_shuffle.partition")
    rng = np.random.default_rng(0)
    for c in (np.array([0.0, -0.0, 0.0, 1.0]), np.zeros(5), np.array([1.0, 1.0 + 2**-52, 1.0, 1.0 + 2**-51]),
              rng.integers(0, 3, 1000).astype(np.float64), rng.random(70000) * 1e12, np.array([3.0])):
        order, cs = part._decreasing_costs(c)
        assert np.array_equal(order, np.argsort(-c, kind="stable")) and np.array_equal(cs, c[order])
    for w in (1, 7, 8192):
        owner = rng.integers(0, w, 5000)
        assert np.array_equal(part._group_by_rank(owner, w), np.argsort(owner, kind="stable"))


@pytest.mark.slow
def test_8192_ranks_balance_and_counts():
    """The issue's size: 8192 ranks x 64 samples (+ 5) of gem-lognormal costs, free and equal counts: every
    sample once, max/mean <= 1.001, equal counts floor/ceil(N/W), no rank empty."""
    w = 8192
    lengths = cases.gem_lognormal(64 * w + 5, seed=8192).double()
    costs = lengths**2 + 512 * lengths
    for eq in (False, True):
        groups = partition(costs, w, equal_count=eq)
        assert len(groups) == w and torch.equal(torch.cat(groups).sort().values, torch.arange(costs.numel()))
        assert all(bool((g[1:] > g[:-1]).all()) for g in groups if len(g) > 1)
        assert imbalance(costs, groups) <= 1.001
        sizes = {len(g) for g in groups}
        assert min(sizes) >= 1 and (not eq or sizes <= {64, 65})
