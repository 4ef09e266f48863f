"""The CUDA transport: copy-engine pulls from the peers' IPC-mapped staging buffers.

Per group and device, on the first CUDA collective (every rank takes part, so they all decide alike):

- the C++ part is built (``_ext.load``); every rank says whether it has it;
- every rank publishes its host and GPU UUID in the group's store and checks peer access
  (``cudaDeviceCanAccessPeer``) to every other rank's GPU; the verdicts are exchanged, so all ranks know the
  whole matrix. A pair without P2P (another host, a GPU this process cannot see, or no NVLink/PCIe P2P), or a
  rank without the C++ part, makes the group say which and send its CUDA collectives to NCCL;
- otherwise two interprocess events per parity slot (``in``: my staging buffer is written; ``out``: my pulls
  from the peers are done) are created and their IPC handles exchanged through the store.

Per collective k (slot = k % 2, double-buffered so that a collective never waits for the previous one):

1. ``prepare`` (before the metadata exchange): the copy stream waits for the caller's stream and for every
   peer's ``out[slot]`` event (their pulls from collective k-2 finished reading my slot); the send slots are
   copied (``cudaMemcpyAsync``, copy engine) into my staging buffer, which grows on demand (a new
   ``cudaMalloc``, its IPC handle published under a new generation; the old buffer is kept until the group
   goes); ``in[slot]`` is recorded.
2. The metadata exchange over gloo is also the host barrier: after it every peer has recorded its ``in[slot]``.
3. ``stage``: open new peer generations, wait for every peer's ``in[slot]``.
4. ``step``: one copy per piece from the peer's staging buffer into my output (or the reduce-scatter scratch);
   with peer access the copy engines move it over NVLink. The copy is ``cudaMemcpyAsync`` (the path checked
   bit for bit on the H200); ``GEMZOO_NCCLX_PULL=batch`` asks for ``cudaMemcpyBatchAsync`` with
   ``cudaMemcpyFlagPreferOverlapWithCompute`` where the C++ part was built against CUDA >= 12.8
   (``ext.HAS_COPY_BATCH``; not yet run on a GPU, so not the default), and a batch call that fails at run time
   (an older driver) switches the transport to ``cudaMemcpyAsync`` for good. ``CudaTransport.pull_path`` says
   which.
5. reduce-scatter: after piece j's pulls, the reduction kernel (``reduce_blocks`` blocks) adds piece j on the
   reduce stream while the copy engines fetch piece j+1.
6. ``finish``: ``out[slot]`` is recorded; the work's event follows both streams; ``Work.wait()`` makes the
   caller's current stream wait for it (like NCCL's work objects).

Why this is safe: a peer records ``out[slot]`` of collective k before it enters exchange k+1, which I have
passed when I reach collective k+2 and wait for it; it cannot record ``out[slot]`` of collective k+2 before I
enter exchange k+2. The same argument holds for ``in[slot]``.
"""

from __future__ import annotations

import json
import os
import socket

import torch
import torch.distributed as dist

from gemzoo_ncclx import schedule as S

ALIGN = 2 << 20  # staging buffers grow in 2 MiB steps (and at least double)


class CudaWork(dist._Work):
    """Done when ``event`` is; ``wait()`` orders the caller's current stream after it (no host sync)."""

    def __init__(self, event: torch.cuda.Event, result):
        super().__init__()
        self._event = event
        self._fut = torch.futures.Future()
        self._fut.set_result(result)

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def get_future(self):
        return self._fut


def _publish_and_read(pg, key: str, value: dict) -> list[dict]:
    """Every rank's ``value`` (JSON) through the group's store, after a host barrier."""
    store = pg._store
    store.set(f"ncclx/{key}/{pg._rank}", json.dumps(value))
    pg._gloo.barrier(dist.BarrierOptions()).wait()
    return [json.loads(store.get(f"ncclx/{key}/{r}")) for r in range(pg._size)]


def make_cuda_transport(pg, device: torch.device):
    """A CudaTransport for ``pg`` on ``device``, or False when the group must use NCCL (said once)."""
    from gemzoo_ncclx._ext import load
    from gemzoo_ncclx.notices import say_once

    index = device.index if device.index is not None else torch.cuda.current_device()
    ext, why = load()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    infos = _publish_and_read(pg, "who", {"host": socket.gethostname(), "uuid": uuid, "device": index,
                                          "ext": ext is not None, "why": why})
    name = f"group {pg._name!r} of {pg._size} ranks"
    no_ext = [r for r, i in enumerate(infos) if not i["ext"]]
    if no_ext:
        say_once(f"ext/{pg._name}", f"ncclx: the C++ part (plugins/gemzoo-ncclx/csrc/comms) is unavailable on "
                                    f"rank(s) {no_ext} ({infos[no_ext[0]]['why']}); {name} uses NCCL for its "
                                    "CUDA collectives")
        return False
    local = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    mine = []
    for info in infos:
        peer = local.get(info["uuid"]) if info["host"] == infos[pg._rank]["host"] else None
        try:
            mine.append(bool(peer is not None and ext.can_access_peer(index, peer)))
        except RuntimeError:  # a driver that cannot say: no P2P
            mine.append(False)
    matrix = [v["p2p"] for v in _publish_and_read(pg, "p2p", {"p2p": mine})]
    message = no_p2p_message(infos, matrix, name)
    if message:
        say_once(f"p2p/{pg._name}", message)
        return False
    # events and their IPC handles: a failure on any rank is agreed on (two exchanges), never a hang
    transport, err, handles = None, None, {}
    try:
        transport = CudaTransport(pg, device, index, ext)
        handles = transport.handles()
    except Exception as exc:
        err = f"{type(exc).__name__}: {exc}"
    peers = _publish_and_read(pg, "events", {"handles": handles, "error": err})
    failed = [(r, v["error"]) for r, v in enumerate(peers) if v["error"]]
    if not failed:
        try:
            transport.open_peers([v["handles"] for v in peers])
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        failed = [(r, v["error"]) for r, v in enumerate(_publish_and_read(pg, "opened", {"error": err})) if v["error"]]
    if failed:
        r, why = failed[0]
        say_once(f"setup/{pg._name}", f"ncclx: setting up the copy-engine transport failed on rank {r} ({why}); "
                                      f"{name} uses NCCL for its CUDA collectives")
        return False
    return transport


def no_p2p_message(infos: list[dict], matrix: list[list[bool]], name: str) -> str | None:
    """What a group says when some pair of its ranks lacks peer access either way (None: every pair has it).
    ``infos[r]``: rank r's host and device; ``matrix[a][b]``: rank a can map rank b's GPU memory."""
    world = len(matrix)
    bad = [(a, b) for a in range(world) for b in range(a + 1, world) if not (matrix[a][b] and matrix[b][a])]
    if not bad:
        return None
    pairs = ", ".join(f"ranks {a} (cuda:{infos[a]['device']} on {infos[a]['host']}) and {b} "
                      f"(cuda:{infos[b]['device']} on {infos[b]['host']})" for a, b in bad[:4])
    more = f" and {len(bad) - 4} more pairs" if len(bad) > 4 else ""
    return (f"ncclx: no peer-to-peer access between {pairs}{more}; {name} uses NCCL for its CUDA collectives "
            "instead of copy engines")


BATCH = "cudaMemcpyBatchAsync(PreferOverlapWithCompute)"
MEMCPY = "cudaMemcpyAsync"


def pull_path(ext) -> str:
    """The call the peer pulls use: MEMCPY, or BATCH with ``GEMZOO_NCCLX_PULL=batch`` where the C++ part has it
    (opt-in until a GPU run has checked it bit for bit and measured it)."""
    want = os.environ.get("GEMZOO_NCCLX_PULL", "memcpy")
    if want not in ("batch", "memcpy"):
        raise ValueError(f"GEMZOO_NCCLX_PULL={want!r}: use memcpy (the default) or batch "
                         "(cudaMemcpyBatchAsync, where the C++ part was built against CUDA >= 12.8)")
    return BATCH if want == "batch" and getattr(ext, "HAS_COPY_BATCH", False) else MEMCPY


class CudaTransport:
    def __init__(self, pg, device: torch.device, index: int, ext):
        self.pg, self.ext, self.index = pg, ext, index
        self.device = torch.device("cuda", index)
        self.W, self.me = pg._size, pg._rank
        with torch.cuda.device(self.device):
            self.copy_stream = torch.cuda.Stream(self.device)
            self.reduce_stream = torch.cuda.Stream(self.device)
            self.ev = {(kind, slot): ext.event_create(True) for kind in ("in", "out") for slot in (0, 1)}
        self.peer_ev = {}
        self.k = 0
        self.used = [False, False]  # slot has been written once (so peers' out[slot] events mean something)
        self.staging = [(0, 0, 0), (0, 0, 0)]  # (ptr, bytes, generation) per slot
        self.retired = []
        self.peer_staging = {}  # (peer, slot) -> (generation, ptr)
        self.blocks = pg._options.reduce_blocks
        self._slot = 0
        self._src = {}
        self._keep = []
        self.pull_path, self.pull_fallback = pull_path(ext), None

    def _pull(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if self.pull_path == BATCH:
            try:
                return self.ext.copy_batch_async(dst, src, nbytes, stream)
            except RuntimeError as exc:  # e.g. a driver older than the runtime: the plain path from now on
                self.pull_path, self.pull_fallback = MEMCPY, str(exc)[:300]
        self.ext.copy_async(dst, src, nbytes, stream)

    def handles(self) -> dict:
        """My events' IPC handles, to publish."""
        return {f"{k}{s}": self.ext.ipc_event_handle(e).hex() for (k, s), e in self.ev.items()}

    def open_peers(self, handles: list[dict]) -> None:
        """Open every peer's events from the handles they published."""
        self.peer_ev = {(p, k, s): (self.ev[(k, s)] if p == self.me else
                                    self.ext.ipc_open_event(bytes.fromhex(h[f"{k}{s}"])))
                        for p, h in enumerate(handles) for k in ("in", "out") for s in (0, 1)}

    def _malloc(self, nbytes: int) -> int:
        with torch.cuda.device(self.device):
            try:
                return self.ext.ce_malloc(nbytes)
            except RuntimeError:
                torch.cuda.empty_cache()  # the caching allocator's free blocks, then once more
                return self.ext.ce_malloc(nbytes)

    # ------------------------------------------------------------------ before the metadata exchange
    def prepare(self, sends, mode) -> int:
        """Stage ``sends``; returns the row's generation field (gen * 2 + slot), or -1 when the staging
        buffer could not grow (the row then carries the error, so every rank raises)."""
        slot = self._slot = self.k % 2
        self.k += 1
        ext, cs = self.ext, self.copy_stream
        parts = sends[:1] if mode == "alias" else sends
        need = sum(t.numel() * t.element_size() for t in parts)
        cs.wait_stream(torch.cuda.current_stream(self.device))
        if self.used[slot]:
            for p in range(self.W):
                if p != self.me:
                    ext.stream_wait_event(cs.cuda_stream, self.peer_ev[(p, "out", slot)])
        ptr, size, gen = self.staging[slot]
        if need > size:
            new = max(need, 2 * size)
            new = (new + ALIGN - 1) // ALIGN * ALIGN
            try:
                nptr = self._malloc(new)
            except RuntimeError:
                try:
                    nptr, new = self._malloc((need + ALIGN - 1) // ALIGN * ALIGN), (need + ALIGN - 1) // ALIGN * ALIGN
                except RuntimeError:
                    return -1
            if ptr:
                self.retired.append(ptr)
            gen += 1
            self.pg._store.set(f"ncclx/staging/{self.me}/{slot}/{gen}", ext.ipc_mem_handle(nptr).hex())
            ptr, size = nptr, new
            self.staging[slot] = (ptr, size, gen)
        off = 0
        for t in parts:
            n = t.numel() * t.element_size()
            ext.copy_async(ptr + off, t.data_ptr(), n, cs.cuda_stream)
            if n:
                t.record_stream(cs)
            off += n
        ext.event_record(self.ev[("in", slot)], cs.cuda_stream)
        self.used[slot] = True
        self._keep = list(parts)
        return gen * 2 + slot

    # ------------------------------------------------------------------- after the metadata exchange
    def stage(self, sends, mode, rows, me) -> None:
        ext, cs, slot = self.ext, self.copy_stream, self._slot
        esize = sends[0].element_size() if sends else 1
        self._src = {}
        for p, row in enumerate(rows):
            if p == me:
                continue
            gen, pslot = divmod(row.gen, 2)
            if pslot != slot:
                raise S.NcclxError(f"ncclx: rank {p} is at staging slot {pslot}, rank {me} at {slot}: the ranks of "
                                   f"group {self.pg._name!r} made different numbers of CUDA collectives")
            if gen == 0:  # the peer has never staged a byte in this slot: it sends nothing now either
                self._src[p] = 0
                continue
            cached = self.peer_staging.get((p, slot))
            if cached is None or cached[0] != gen:
                if cached is not None:
                    cs.synchronize()  # nothing of mine still reads the old mapping
                    ext.ipc_close_mem(cached[1])
                handle = self.pg._store.get(f"ncclx/staging/{p}/{slot}/{gen}")
                with torch.cuda.device(self.device):
                    cached = (gen, ext.ipc_open_mem(bytes.fromhex(handle.decode() if isinstance(handle, bytes)
                                                                  else handle)))
                self.peer_staging[(p, slot)] = cached
            ext.stream_wait_event(cs.cuda_stream, self.peer_ev[(p, "in", slot)])
            base = 0 if mode == "alias" else sum(row.sends[:me]) * esize
            self._src[p] = cached[1] + base
        self._esize = esize

    def local(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() and dst.data_ptr() != src.data_ptr():
            self.ext.copy_async(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(),
                                self.copy_stream.cuda_stream)
            dst.record_stream(self.copy_stream)
            src.record_stream(self.copy_stream)

    def step(self, step: int, send, recv) -> None:
        if recv is None:
            return  # the peer pulls what it needs from my staging buffer: nothing to do for a send
        peer, view, start = recv
        n = view.numel() * view.element_size()
        self._pull(view.data_ptr(), self._src[peer] + start * self._esize, n, self.copy_stream.cuda_stream)
        view.record_stream(self.copy_stream)

    def piece_done(self, j: int, reduce) -> None:
        if reduce is None:
            return
        ready = torch.cuda.Event()
        ready.record(self.copy_stream)
        self.reduce_stream.wait_event(ready)
        reduce()

    def reduce(self, out: torch.Tensor, parts, redop: int, world: int) -> None:
        rs = self.reduce_stream
        for t in (out, *parts):
            if t.numel():
                t.record_stream(rs)
        code = S.DTYPE_CODE.get(out.dtype, -1)
        if not self.ext.reduce(out.data_ptr(), [p.data_ptr() for p in parts], out.numel(), code, redop, world,
                               self.blocks, rs.cuda_stream):
            with torch.cuda.stream(rs):  # a dtype the kernel does not cover (bool, fp8, complex): torch ops
                S.reduce_parts(out, parts, redop, world)

    def finish(self, tensors) -> CudaWork:
        cs = self.copy_stream
        self.ext.event_record(self.ev[("out", self._slot)], cs.cuda_stream)
        self.reduce_stream.wait_stream(cs)
        done = torch.cuda.Event()
        done.record(self.reduce_stream)
        self._keep = []
        return CudaWork(done, tensors)

    def __del__(self):
        try:
            for ptr in self.retired:
                self.ext.ce_free(ptr)
        except Exception:
            pass
