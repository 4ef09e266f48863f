"""Rank functions of gemzoo-ncclx's tests (a package-unique module name, imported as ``ncclx_cases``)."""

from __future__ import annotations

import json
import os
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# every dtype the trainer and its plugins move: fp32 weights/grads, bf16/fp16 mixed precision, int64 ids and
# lengths, int32 offsets, uint8/fp8 payloads
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.float8_e4m3fn)
FAKE_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn)
CHUNK_BYTES = 64  # a few elements per piece: every transfer below is cut into several pieces


def values(rank: int, n: int, dtype: torch.dtype, seed: int, exact: bool = False) -> torch.Tensor:
    """Different on every rank; random floats spanning 6 decades unless ``exact`` (small integers, whose sums
    are exact in every dtype and order)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point and not exact:
        x = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, max(n, 1), dtype=torch.float64)[:n]
        return x.to(torch.float32).to(dtype) if dtype.itemsize == 1 else x.to(dtype)
    hi = 4 if dtype.itemsize == 1 else 50
    return torch.randint(0, hi, (n,), generator=g).to(dtype)


def _splits(rank: int, world: int, seed: int) -> list[int]:
    """Uneven all-to-all splits with zeros: what ``rank`` sends to each rank."""
    return [((rank * 7 + d * 3 + seed) % 5) * ((rank + d + seed) % 3 != 0) for d in range(world)]


class FakeExt:
    """The C++ part's calls on CPU, to run CudaTransport's bookkeeping (staging slots and generations, IPC
    handles through the store, peer offsets, pieces) between processes without a GPU: "device memory" is a
    /dev/shm file each process maps (its IPC handle is the file name), a copy is a memmove (synchronous, so
    the events have nothing to order), and the reduction falls back to the torch ops."""

    def __init__(self, p2p=lambda a, b: True):
        import atexit

        self.maps, self.made, self.n, self.p2p, self.copies = {}, [], 0, p2p, 0
        self.fail_above = 1 << 62
        atexit.register(self.cleanup)

    def _map(self, name: str) -> int:
        import ctypes
        import mmap

        fd = os.open(name, os.O_RDWR)
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
        os.close(fd)
        buf = (ctypes.c_char * size).from_buffer(mm)
        self.maps[ctypes.addressof(buf)] = (mm, buf, name)
        return ctypes.addressof(buf)

    def ce_malloc(self, nbytes: int) -> int:
        if nbytes > self.fail_above:
            raise RuntimeError("ncclx: cudaMalloc of the staging buffer failed: out of memory (fake)")
        name = f"/dev/shm/ncclx-fake-{os.getpid()}-{self.n}"
        self.n += 1
        with open(name, "wb") as f:
            f.truncate(nbytes)
        self.made.append(name)
        return self._map(name)

    def ipc_mem_handle(self, ptr: int) -> bytes:
        return self.maps[ptr][2].encode().ljust(64, b"\0")

    def ipc_open_mem(self, handle: bytes) -> int:
        return self._map(handle.rstrip(b"\0").decode())

    def ipc_close_mem(self, ptr: int) -> None:
        mm, buf, _ = self.maps.pop(ptr)
        del buf
        mm.close()

    ce_free = ipc_close_mem

    def event_create(self, interprocess: bool) -> int:
        self.n += 1
        return self.n

    def ipc_event_handle(self, ev: int) -> bytes:
        return str(ev).encode().ljust(64, b"\0")

    def ipc_open_event(self, handle: bytes) -> int:
        return int(handle.rstrip(b"\0"))

    def event_record(self, ev, stream):
        pass

    def stream_wait_event(self, stream, ev):
        pass

    def copy_async(self, dst: int, src: int, nbytes: int, stream) -> None:
        import ctypes

        if nbytes > 0:
            ctypes.memmove(dst, src, nbytes)
            self.copies += 1

    def can_access_peer(self, a: int, b: int) -> bool:
        return self.p2p(a, b)

    def reduce(self, *args) -> bool:
        return False  # CudaTransport.reduce then runs schedule.reduce_parts

    def cleanup(self):
        for name in self.made:
            if os.path.exists(name):
                os.unlink(name)


def fake_cuda(pg) -> dict:
    """Point ``pg``'s collectives at a CudaTransport over FakeExt (torch.cuda's streams and events replaced by
    no-ops), after make_cuda_transport's peer check has refused a group whose ranks 0 and 1 lack P2P and
    accepted one that has it; returns what it said."""
    import contextlib
    import types

    import gemzoo_ncclx._ext as ext_mod
    import gemzoo_ncclx.cuda as cu

    class Stream:
        cuda_stream = 0

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def synchronize(self):
            pass

    class Event:
        def __init__(self, *a, **k):
            pass

        def record(self, stream=None):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

    torch.cuda.Stream = lambda *a, **k: Stream()
    torch.cuda.current_stream = lambda *a, **k: Stream()
    torch.cuda.Event = Event
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.device_count = lambda: pg.size()
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(uuid=f"GPU-fake-{i}")
    torch.cuda.current_device = lambda: pg.rank()
    torch.Tensor.record_stream = lambda self, stream: None
    said = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ext_mod.load = lambda: (FakeExt(p2p=lambda a, b: {a, b} != {0, 1}), None)
        said["refused"] = cu.make_cuda_transport(pg, torch.device("cuda", pg.rank()))
        ext_mod.load = lambda: (FakeExt(), None)
        transport = cu.make_cuda_transport(pg, torch.device("cuda", pg.rank()))
    said["messages"] = [str(w.message) for w in caught]
    said["transport"] = type(transport).__name__
    said["ext"] = transport.ext
    pg._transport = lambda device: transport
    return said


def semantics_rank(rank: int, world: int, port: int, out_dir: str, conformance: bool = False,
                   fake: bool = False) -> None:
    """Every claimed collective on the ncclx default group against the same call on a plain gloo group, bit
    for bit, then the bad calls (each must raise the same NcclxError on every rank), then a good call again;
    with ``conformance``, then gemzoo.testing's comms suite and the benchmark's 2-rank check in the same
    processes (one start-up)."""
    from gemzoo.testing.comms import rank_env

    rank_env(rank, world, port)
    import torch.distributed as dist
    from gemzoo_ncclx import NcclxComms, NcclxError, NcclxOptions
    from gemzoo_ncclx.process_group import NcclxProcessGroup

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        NcclxComms(NcclxOptions(chunk_bytes=CHUNK_BYTES)).install()
        dist.init_process_group("ncclx", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        pg = dist.distributed_c10d._get_default_group()
        assert isinstance(pg, NcclxProcessGroup), type(pg)
        gloo = dist.new_group(backend="gloo")
        checked, errors = [], {}
        cuda_said = fake_cuda(pg) if fake else None

        def same(label, got, want):
            assert got.dtype == want.dtype and got.shape == want.shape, (label, got.dtype, want.dtype)
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):  # bits, NaN-safe
                raise AssertionError(f"ncclx {label} on rank {rank}: {got.tolist()[:8]} != gloo {want.tolist()[:8]}")
            checked.append(label)

        for seed, dtype in enumerate(DTYPES if not fake else FAKE_DTYPES):
            # gloo has no fp8 ("Invalid scalar type"): its reference moves the same bytes as uint8
            wire = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)
            for n in (0, 1, 5, 202) if world == 2 else (0, 1, 202):  # per rank's chunk: zero, one, odd, even, pieces
                x = values(rank, n, dtype, seed)
                # all_gather_into_tensor, fresh output and in place (FSDP2's input is a slice of the output)
                outs = {}
                for name, group in (("ncclx", None), ("gloo", gloo)):
                    o = torch.empty(world * n, dtype=dtype)
                    dist.all_gather_into_tensor(*((o, x) if group is None else (wire(o), wire(x))), group=group)
                    outs[name] = o
                inplace = torch.zeros(world * n, dtype=dtype)
                inplace[rank * n:(rank + 1) * n] = x
                dist.all_gather_into_tensor(inplace, inplace[rank * n:(rank + 1) * n])
                same(f"all_gather_into_tensor {dtype} n={n}", outs["ncclx"], outs["gloo"])
                same(f"all_gather_into_tensor in place {dtype} n={n}", inplace, outs["gloo"])
                lists = [torch.empty(n, dtype=dtype) for _ in range(world)]
                dist.all_gather(lists, x)
                same(f"all_gather {dtype} n={n}", torch.cat(lists), outs["gloo"])
                # all_to_all_single: uneven splits with zeros, rows of 2 elements
                send = _splits(rank, world, seed + n)
                recv = [_splits(s, world, seed + n)[rank] for s in range(world)]
                inp = values(rank, 2 * sum(send), dtype, seed + 1).view(-1, 2)
                a2a = {}
                for name, group in (("ncclx", None), ("gloo", gloo)):
                    o = torch.empty(sum(recv), 2, dtype=dtype)
                    dist.all_to_all_single(*((o, inp) if group is None else (wire(o), wire(inp))), recv, send,
                                           group=group)
                    a2a[name] = o
                same(f"all_to_all_single {dtype} splits={send}", a2a["ncclx"], a2a["gloo"])
                outs_l = [torch.empty(r, 2, dtype=dtype) for r in recv]
                dist.all_to_all(outs_l, list(inp.split(send)))
                same(f"all_to_all {dtype}", torch.cat(outs_l), a2a["gloo"])
                if dtype in (torch.float8_e4m3fn, torch.uint8):
                    continue  # gloo reduces neither fp8 nor (meaningfully) uint8
                # reduce_scatter_tensor: random floats where gloo's ring lines up with the ranks' chunks (2 ranks
                # always, else an even count per rank), small integers (exact in any order) otherwise
                exact = world > 2 and n % 2 == 1
                big = values(rank, world * n, dtype, seed + 2, exact=exact)
                for op in ("SUM", "MAX", "MIN"):
                    rs = {}
                    for name, group in (("ncclx", None), ("gloo", gloo)):
                        o = torch.empty(n, dtype=dtype)
                        dist.reduce_scatter_tensor(o, big.clone(), op=getattr(dist.ReduceOp, op), group=group)
                        rs[name] = o
                    same(f"reduce_scatter_tensor {op} {dtype} n={n}{' exact' if exact else ''}", rs["ncclx"], rs["gloo"])
                o = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(o, list(big.clone().split(n)) if n else [torch.empty(0, dtype=dtype)] * world)
                o2 = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(o2, big.clone(), group=gloo)
                same(f"reduce_scatter {dtype} n={n}", o, o2)
        own = dict(pg.stats["own"])

        # bad calls: each raises on every rank (sizes are exchanged before any byte moves), none hangs
        def expect(label, fn):
            try:
                fn()
            except NcclxError as e:
                errors[label] = str(e)
            else:
                errors[label] = None

        expect("all_gather sizes", lambda: dist.all_gather_into_tensor(torch.empty(world * (3 + rank)),
                                                                      torch.ones(3 + rank)))
        expect("all_gather output", lambda: dist.all_gather_into_tensor(torch.empty(world * 4 + (rank == 0)),
                                                                       torch.ones(4)))
        bad_recv = [_splits(s, world, 0)[rank] + (rank == 1 and s == 0) for s in range(world)]
        expect("all_to_all splits", lambda: dist.all_to_all_single(
            torch.empty(sum(bad_recv)), torch.ones(sum(_splits(rank, world, 0))), bad_recv, _splits(rank, world, 0)))
        expect("different collectives", lambda: (dist.all_gather_into_tensor(torch.empty(world * 2), torch.ones(2))
                                                 if rank == 0 else dist.reduce_scatter_tensor(torch.empty(2),
                                                                                             torch.ones(2 * world))))
        expect("reduce_scatter sizes", lambda: dist.reduce_scatter_tensor(torch.empty(2 + rank),
                                                                          torch.ones(world * (2 + rank))))
        expect("dtypes", lambda: dist.all_gather_into_tensor(torch.empty(world * 2, dtype=torch.float64 if rank
                                                                         else torch.float32),
                                                             torch.ones(2, dtype=torch.float64 if rank
                                                                        else torch.float32)))
        if fake:  # rank 1 cannot grow its staging buffer: every rank raises, then the group still works
            if rank == 1:
                cuda_said["ext"].fail_above = 0
            expect("staging", lambda: dist.all_gather_into_tensor(torch.empty(world << 20), torch.ones(1 << 20)))
            cuda_said["ext"].fail_above = 1 << 62
        after = torch.empty(world * 2)
        dist.all_gather_into_tensor(after, torch.full((2,), float(rank)))  # the group still works
        assert after.tolist() == [float(r) for r in range(world) for _ in range(2)]
    said = [str(w.message) for w in caught if "gloo point-to-point" in str(w.message)]
    with open(os.path.join(out_dir, f"sem{rank}.json"), "w") as f:
        json.dump({"checked": len(checked), "errors": errors, "own": own, "delegated": pg.stats["delegated"],
                   "said": said, "cuda": cuda_said and {**cuda_said, "ext": None, "copies": cuda_said["ext"].copies}}, f)
    dist.destroy_process_group()
    if conformance:
        import sys

        from gemzoo.testing.comms import comms_rank

        comms_rank(rank, world, port + 1, {"ncclx": None}, out_dir)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
        from bench_overlap import smoke_rank  # the benchmark's 2-rank check, here over the gloo transport

        smoke_rank(rank, world, port + 2, "cpu", out_dir, 1)


def train_rank(rank: int, world: int, port: int, tmp: str, runs: list) -> None:
    """gem-tiny (tiny widths) on each comms backend of ``runs`` in turn, a fresh process group each (the next
    on port + i); writes each run's losses, the start row's comms entry and what ncclx ran itself."""
    import torch.distributed as dist

    from gemzoo.api import load_config, train
    from gemzoo.testing.comms import rank_env

    out = {}
    for i, (label, plugins, steps) in enumerate(runs):
        rank_env(rank, world, port + i)
        cfg = load_config(os.path.join(ROOT, "configs", "gem-tiny.toml"), overrides=[
            f"run.steps={steps}", "run.device='cpu'", "eval.every=0", "checkpoint.every=0", "run.log_every=1",
            f"run.out_dir='{tmp}/{label}'", "data.batch_size=8", "model.d_model=16", "model.embedding_dim=8",
            f"plugins.comms='{plugins}'"])
        result = train(cfg, progress=False)
        pg = dist.distributed_c10d._get_default_group()
        with open(os.path.join(tmp, label, "metrics.jsonl")) as f:
            start = json.loads(f.readline()) if rank == 0 else {}
        out[label] = {"losses": [h["loss"] for h in result.history], "comms": start.get("comms"),
                      "own": dict(getattr(pg, "stats", {}).get("own", {}))}
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"train{rank}.json"), "w") as f:
        json.dump(out, f)
