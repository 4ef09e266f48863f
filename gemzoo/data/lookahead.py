"""Scheduling the batching slot's work around training (``gemzoo.data.exchange`` does the work itself).

``Lookahead`` is what the trainer calls each step: this rank's samples of step t, and, when the policy
overlaps (``gemzoo.interfaces.batching.overlaps``: it sets ``overlap = True``, so its ``assign`` may run in a
thread, and leaves the moving to gemzoo), step t+1's partition computed while step t trains. Only steps 2-3
move to a worker: right after step t's samples have arrived, the main thread loads step t+1's part, prices
it and all-gathers its costs (step 1), then hands ``assign`` to one worker (``PartitionWorker``: a
thread, or a spawned process with ``overlap_worker = "process"``); step t+1 waits for the result and does the
all-to-all itself. Every collective stays on the main thread, in the same order on every rank, so no two
threads ever use the process group. The partition is a pure function of step t+1's costs,
so the samples (and the losses) are bit-identical to the synchronous path; the first step of a run or of a
resume has nothing ahead and partitions synchronously, which gives the same answer. With the policy's
``overlap_depth = d`` the main thread keeps steps t+1..t+d planned (their parts loaded and costs all-gathered,
in step order) in d workers, so a partition may take up to d steps.

Where the data-parallel group has a ``host`` group (the same ranks over a CPU transport, gloo: the trainer's
``World.dp_host``), all of it runs on the host: each rank's part stays in host memory, its costs, the
partition and the all-to-alls go over that group, and only this rank's samples are then copied to the device
(pinned, without blocking). A step on a GPU then waits for no device value, where the device path's reads
(byte counts, the arrived rows, the all-gathered costs) each wait for the GPU's whole queue. Without one, the
collectives run on the group on the batch's device.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gemzoo.data.batch import to_device
from gemzoo.data.exchange import Route, comm_device, deliver, gather_costs, load_shard, rebalance, route_checked
from gemzoo.errors import PluginError
from gemzoo.interfaces.batching import DataParallelGroup, custom_rebalance, overlap_depth, overlap_worker, overlaps
from gemzoo.interfaces.models import host_view


def _load_pinned(dataset, step: int, rank: int, world_size: int):
    batch = load_shard(dataset, step, rank, world_size)
    return batch.pin_memory() if callable(getattr(batch, "pin_memory", None)) else batch


class ShardPrefetcher:
    """``load_shard`` of the next step on one host thread while this step trains: the host builds step t+1's
    part (synthetic generation, a file's rows) while the device runs step t. The Dataset protocol makes
    ``train_batch`` a pure function of (seed, step), so the thread changes when a part is built, never what
    it holds. ``get`` returns the part prefetched for exactly (dataset, step, rank, world), else loads it now;
    an error raised in the thread is raised by ``get``. ``last_wait_s``: how long the last ``get`` blocked (the
    rest of a prefetch still running, or the whole load when nothing was prefetched)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[tuple, Any] | None = None
        self.last_wait_s = 0.0

    def get(self, dataset, step: int, rank: int, world_size: int):
        key = (id(dataset), step, rank, world_size)
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        try:
            if pending is not None:
                if pending[0] == key:
                    return pending[1].result()
                pending[1].cancel()
            return load_shard(dataset, step, rank, world_size)
        finally:
            self.last_wait_s = time.perf_counter() - t0

    def prefetch(self, dataset, step: int, rank: int, world_size: int, *, pin: bool = False) -> None:
        """Start building that part on the thread; ``pin``: also copy it into pinned memory there (for a GPU:
        its copy to the device then needs no staging and does not block the host)."""
        if self._pending is not None:
            self._pending[1].cancel()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemzoo-prefetch")
        self._pending = ((id(dataset), step, rank, world_size),
                         self._pool.submit(_load_pinned if pin else load_shard, dataset, step, rank, world_size))

    def close(self) -> None:
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


WORKERS = ("thread", "process")


def _one_thread() -> None:
    torch.set_num_threads(1)


def available_cpus() -> set[int]:
    """The CPUs this process may use, whatever one thread's mask: the cgroup's cpuset where it says, else all.
    (``os.sched_getaffinity(0)`` is the calling thread's mask, which OpenMP may have bound to one core.)"""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        cpus = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def _process_worker_init(avoid: frozenset[int]) -> None:
    """A process worker's start: one intra-op thread, and off the trainer's CPUs when the trainer's main thread
    is bound to some (a spawned process inherits the mask of the thread that started it: with OpenMP's binding
    that is the trainer's one core, and the partition would take it from the kernel launches)."""
    _one_thread()
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = available_cpus()
    if avoid and avoid < cpus:
        try:
            os.sched_setaffinity(0, cpus - avoid)
        except OSError:  # a cpuset narrower than it says: keep the inherited mask
            pass


def _ready() -> dict:
    """Submitted when a process worker is created, so it starts (and imports torch) at once; says where it runs."""
    return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "threads": torch.get_num_threads()}


def _route_arrays(policy, costs: np.ndarray, counts: list[int], rank: int, name: str):
    """``route_checked`` in a process worker: numpy in and out (no tensor sharing between processes)."""
    rt, seconds = route_checked(policy, torch.from_numpy(costs), counts, rank, name)
    return rt.arrays(), seconds


class Pending:
    """A route being computed by a ``PartitionWorker``: ``result()`` -> (``Route``, seconds)."""

    def __init__(self, future, arrays: bool):
        self.future, self.arrays = future, arrays

    def result(self) -> tuple[Route, float]:
        rt, seconds = self.future.result()
        return (Route.from_arrays(rt) if self.arrays else rt), seconds

    def cancel(self) -> None:
        self.future.cancel()


class PartitionWorker:
    """The worker (or ``workers`` of them, for partitions several steps ahead) that computes partitions ahead
    of their step.

    - ``"process"``: a spawned interpreter (started, and torch imported, when this is created). ``assign``
      runs beside the trainer without sharing its GIL; the policy is pickled to it (it must be picklable and
      importable), costs travel as a numpy array (8 bytes a sample) and only this rank's route comes back.
    - ``"thread"``: a thread of this process. ``assign``'s Python and numpy code takes the GIL from the
      trainer's thread, whose every torch op (kernel launches included) releases and retakes it: on a 2-core
      CPU, 3000 small torch ops took 8x longer beside a 21 ms partition of 512 samples (bench/overhead.py
      measures it on the GPU).

    Either way the worker's torch ops run on one intra-op thread (torch's OpenMP thread count is per calling
    thread): a second OpenMP team beside the trainer's would compete with it for the cores. On GPU runs the
    trainer's team leaves the worker one core (``leave_a_core``, restored at ``shutdown``), and a process
    worker leaves the CPUs the trainer's main thread is bound to, if it is bound (``where()`` says where).
    """

    def __init__(self, kind: str = "thread", workers: int = 1):
        if kind not in WORKERS:
            raise PluginError(f"partition worker must be one of {', '.join(WORKERS)}, got {kind!r}")
        self.kind, self.workers = kind, workers
        self._threads = None  # the trainer's intra-op threads before leave_a_core
        if kind == "thread":
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gemzoo-partition",
                                            initializer=_one_thread)
        else:
            avoid = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
            self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_process_worker_init, initargs=(avoid,))
            self._started = self._pool.submit(_ready)

    def where(self) -> dict:
        """Where the worker runs: its pid, its CPUs and its intra-op threads (a process: once it has started)."""
        if self.kind == "thread":
            return {"pid": os.getpid(), "cpus": None, "threads": 1}
        return self._started.result()

    def submit(self, policy, costs: torch.Tensor, counts: list[int], rank: int, name: str) -> Pending:
        """``route_checked(policy, costs, counts, rank, name)`` in the worker."""
        if self.kind == "thread":
            return Pending(self._pool.submit(route_checked, policy, costs, counts, rank, name), arrays=False)
        return Pending(self._pool.submit(_route_arrays, policy, costs.numpy(), list(counts), rank, name), arrays=True)

    def leave_a_core(self) -> None:
        """Shrink the caller's intra-op team by one thread a worker while they live, if it fills every core: an
        OpenMP team on every core waits at each barrier for the thread a worker displaced. For GPU training
        (the host's ops are data preparation); on a CPU device it would change the reduction order of the math."""
        cores = len(available_cpus())
        if self._threads is None and torch.get_num_threads() >= cores > 1:
            self._threads = torch.get_num_threads()
            torch.set_num_threads(max(1, cores - self.workers))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None


@dataclasses.dataclass
class Planned:
    """One step's partition on its way: this rank's loaded part, every rank's sample count, and this rank's
    ``Route`` through the checked partition (``route``) or the worker computing it (``future``: ``(route,
    seconds)``)."""

    step: int
    batch: Any
    counts: list[int]
    dp: DataParallelGroup
    future: Pending | None = None
    route: Route | None = None
    assign_s: float = 0.0


def plan(policy, batch, costs: torch.Tensor, dp: DataParallelGroup, *, name: str, step: int = -1,
         worker: PartitionWorker | None = None) -> Planned:
    """Step 1 of ``rebalance`` (the cost all-gather, on this thread) and step 2 now or, with ``worker``, there."""
    everything, counts = gather_costs(costs, dp, comm_device(batch))
    planned = Planned(step, batch, counts, dp)
    if worker is None:
        planned.route, planned.assign_s = route_checked(policy, everything, counts, dp.rank, name)
    else:
        planned.future = worker.submit(policy, everything, counts, dp.rank, name)
    return planned


def move(planned: Planned):
    """Steps 3-4 of ``rebalance``: this rank's samples (waits for the worker's route first)."""
    if planned.route is None:
        planned.route, planned.assign_s = planned.future.result()
    return deliver(planned.batch, planned.route, planned.dp)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Lookahead:
    """The trainer's data step: this rank's samples of each step, with the partition of the next step (or the
    next ``overlap_depth``) computed by a ``PartitionWorker`` (the policy's ``overlap_worker``: threads or
    processes) while this one trains,
    when ``overlaps(policy)`` and there is more than one rank (else exactly ``load_shard`` + ``rebalance``,
    synchronously).

    ``last`` describes the latest step: ``{"step", "ahead"`` (its partition was computed ahead, in the
    worker), ``"assign_s"`` (the partition's own seconds), ``"wait_s"`` (what this step waited for it: all of
    ``assign_s`` when computed now)``}``; NaN where not measured (a policy that moves samples itself). On one
    rank also ``"load_wait_s"``: what the step waited for its prefetched part (``ShardPrefetcher.last_wait_s``).
    ``close()`` (or leaving ``with``) drops a partition computed for a step that will not run and stops the
    worker; a later ``batch`` call starts a new one.

    Whatever the policy, this rank's part of the next step is built on a host thread (``ShardPrefetcher``)
    while this step trains, where nothing else loads it ahead (an overlapping policy loads and prices it on
    the main thread, since its costs are all-gathered).
    """

    def __init__(self, policy, *, name: str | None = None):
        self.policy = policy
        self.name = name or type(policy).__name__
        self.overlap = overlaps(policy)
        self.depth = overlap_depth(policy) if self.overlap else 1
        self.last: dict = {}
        self._ahead: deque[Planned] = deque()  # steps planned ahead, in step order
        self._worker: PartitionWorker | None = None
        self._loader = ShardPrefetcher()
        if self.overlap and overlap_worker(policy) == "process" and _world_size() > 1:
            # spawned now: the processes start while the trainer builds the model
            self._worker = PartitionWorker("process", self.depth)

    def _load(self, dataset, step: int, dp: DataParallelGroup, device, cost_model: Callable, *, on_host=False):
        part = self._loader.get(dataset, step, dp.rank, dp.size)
        if not on_host:
            part = to_device(part, device)
        return part, cost_model(host_view(part))  # priced from the host copy: no wait for the device

    def _drop_ahead(self) -> None:
        while self._ahead:
            planned = self._ahead.popleft()
            if planned.future is not None:
                planned.future.cancel()

    def batch(self, dataset, step: int, dp: DataParallelGroup, device, cost_model: Callable, *,
              next_step: int | None = None, last_step: int | None = None):
        """This rank's samples of ``step``. With ``next_step`` (the step that will run after this one; None at
        the last step), an overlapping policy also gets the steps up to ``next_step + depth - 1`` (and at most
        ``last_step``, the run's last) loaded, their costs all-gathered (every rank calls this at the same point,
        so the collectives match) and their partitions started in the workers."""
        ahead = self._ahead.popleft() if self._ahead else None
        pin = torch.device(device).type == "cuda"  # parts built ahead land in pinned memory for a GPU
        if dp.size == 1:  # one rank never calls the policy
            part = to_device(self._loader.get(dataset, step, 0, 1), device)
            self.last = {"step": step, "ahead": False, "assign_s": 0.0, "wait_s": 0.0,
                         "load_wait_s": self._loader.last_wait_s}
            if next_step is not None:  # built on the host while this step trains
                self._loader.prefetch(dataset, next_step, 0, 1, pin=pin)
            return part
        if custom_rebalance(self.policy) is not None:  # it moves samples itself: as rebalance does
            self.last = {"step": step, "ahead": False, "assign_s": math.nan, "wait_s": math.nan}
            got = rebalance(self.policy, *self._load(dataset, step, dp, device, cost_model), dp, name=self.name)
            if next_step is not None:
                self._loader.prefetch(dataset, next_step, dp.rank, dp.size, pin=pin)
            return got
        if self.overlap and next_step is not None and self._worker is None:  # a process starts meanwhile
            self._worker = PartitionWorker(overlap_worker(self.policy), self.depth)
        if self._worker is not None and torch.device(device).type != "cpu":
            self._worker.leave_a_core()
        on_host = dp.host is not None  # samples move over a CPU transport, then go to the device
        comm = dp.host if on_host else dp
        if ahead is None or ahead.step != step or ahead.dp != comm:  # nothing ahead (or not this step's): now
            if ahead is not None and ahead.future is not None:
                ahead.future.cancel()
            self._drop_ahead()
            ahead = plan(self.policy, *self._load(dataset, step, dp, device, cost_model, on_host=on_host), comm,
                         name=self.name, step=step)
        t0 = time.perf_counter()
        if ahead.future is not None:
            ahead.route, ahead.assign_s = ahead.future.result()
        wait = time.perf_counter() - t0 if ahead.future is not None else ahead.assign_s
        mine = move(ahead)
        if on_host:
            mine = to_device(mine, device)  # pinned and queued behind the device's work: no wait for it
        self.last = {"step": step, "ahead": ahead.future is not None, "assign_s": ahead.assign_s, "wait_s": wait}
        if next_step is not None and self.overlap:
            first = self._ahead[-1].step + 1 if self._ahead else next_step
            end = next_step + self.depth if last_step is None else min(next_step + self.depth, last_step + 1)
            for s in range(first, end):
                part, costs = self._load(dataset, s, dp, device, cost_model, on_host=on_host)
                self._ahead.append(plan(self.policy, part, costs, comm, name=self.name, step=s, worker=self._worker))
        elif next_step is not None:  # a part moved on the host is repacked anyway: pinned only once it arrives
            self._loader.prefetch(dataset, next_step, dp.rank, dp.size, pin=pin and not on_host)
        return mine

    def close(self) -> None:
        self._drop_ahead()
        self._loader.close()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def __enter__(self) -> Lookahead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
