"""``NcclxProcessGroup``: the c10d process group behind the backend name ``ncclx``.

A Python ``torch.distributed.ProcessGroup`` subclass (the way torch's own tests add Python backends), made by
``torch.distributed.Backend.register_backend("ncclx", ...)`` for every group c10d builds: the default group,
``new_group`` and DeviceMesh's. It runs all-gather, all-to-all and reduce-scatter itself (both the tensor and
the list forms, and the coalesced all-gather / reduce-scatter FSDP2 may use); every other collective goes to an
inner c10d backend: NCCL for CUDA tensors, gloo for CPU tensors. The inner backends are also registered on the
group for their devices, so code that reaches a group through the dispatcher (functional collectives, DTensor
redistribution) gets c10d's own collectives.

Each claimed collective: validate the local arguments, all-gather one metadata row per rank over the gloo
backend (so a mismatch raises the same error on every rank, never a hang), then move the bytes with the
schedule of ``gemzoo_ncclx.schedule`` through a transport:

- CPU tensors: ``GlooTransport``, gloo point-to-point send/recv of each piece.
- CUDA tensors: ``gemzoo_ncclx.cuda.CudaTransport``, copy-engine ``cudaMemcpyAsync`` pulls from the peers'
  IPC-mapped staging buffers on a dedicated stream; reduce-scatter's sum on a few SMs. Groups whose GPUs are
  not all peer-accessible (or when the C++ part did not build) send their CUDA collectives to NCCL.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from gemzoo_ncclx import schedule as S
from gemzoo_ncclx.notices import say_once


class DoneWork(dist._Work):
    """A collective that finished before it returned (the CPU transport is synchronous)."""

    def __init__(self, result=None):
        super().__init__()
        self._fut = torch.futures.Future()
        self._fut.set_result(result)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        return self._fut


class GlooTransport:
    """Point-to-point gloo as the wire: at each (piece, step) the rank sends the piece its served peer pulls
    and receives the piece it pulls, then waits for both (tags: the step)."""

    def __init__(self, gloo):
        self.gloo = gloo
        self._pending = []

    def prepare(self, sends, mode) -> int:  # nothing to stage: gloo reads the send slots themselves
        return 0

    def stage(self, sends, mode, rows, me) -> None:
        pass

    def reduce(self, out, parts, redop: int, world: int) -> None:
        S.reduce_parts(out, parts, redop, world)

    def local(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() and dst.data_ptr() != src.data_ptr():
            dst.copy_(src)

    def step(self, step: int, send, recv) -> None:
        if send is not None:
            peer, view = send
            self._pending.append(self.gloo.send([_bytes(view)], peer, step))
        if recv is not None:
            peer, view, _ = recv
            self._pending.append(self.gloo.recv([_bytes(view)], peer, step))

    def piece_done(self, j: int, reduce) -> None:
        for w in self._pending:
            w.wait()
        self._pending.clear()
        if reduce is not None:
            reduce()

    def finish(self, tensors) -> dist._Work:
        return DoneWork(tensors)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)


def _opt(opts, name, default):
    return getattr(opts, name, default) if opts is not None else default


class NcclxProcessGroup(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: timedelta, options):
        super().__init__(rank, size)
        from torch.distributed import ProcessGroupGloo

        self._rank, self._size, self._options = rank, size, options
        self._store = store
        self._name, self._desc = "", ""
        self._gloo = ProcessGroupGloo(dist.PrefixStore("ncclx/gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._nccl = None
        if torch.cuda.is_available() and dist.is_nccl_available():
            nopts = dist.ProcessGroupNCCL.Options()
            nopts._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("ncclx/nccl/", store), rank, size, nopts)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, self._nccl)
        self._cpu = GlooTransport(self._gloo)
        self._cuda = None  # CudaTransport, built on the first CUDA collective; False: this group uses NCCL
        self.stats = {"own": {}, "delegated": {}}

    # --------------------------------------------------------------------------------------- identity
    def getBackendName(self) -> str:
        return "ncclx"

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"NcclxProcessGroup(rank={self._rank}, size={self._size}, name={self._name!r})"

    # ------------------------------------------------------------------------------------ routing
    def _inner(self, tensors):
        t = next((x for x in tensors if isinstance(x, torch.Tensor)), None)
        if t is not None and t.is_cuda:
            if self._nccl is None:
                raise RuntimeError("ncclx: a CUDA tensor reached a group made without CUDA (no NCCL inside); "
                                   "initialise the process group after CUDA is visible")
            return self._nccl
        return self._gloo

    def _delegate(self, name: str, tensors, *args):
        self.stats["delegated"][name] = self.stats["delegated"].get(name, 0) + 1
        return getattr(self._inner(tensors), name)(*args)

    def _transport(self, device: torch.device):
        if device.type == "cpu":
            if not torch.cuda.is_available():
                say_once("cpu", "ncclx: no CUDA device here; its collectives run their schedule over gloo "
                                "point-to-point (the CPU transport), with the same chunking, pull order and reduction "
                                "order as on GPUs")
            return self._cpu
        if device.type != "cuda":
            return None
        if self._cuda is None:
            from gemzoo_ncclx.cuda import make_cuda_transport

            self._cuda = make_cuda_transport(self, device)  # collective: every rank agrees on P2P or NCCL
        return self._cuda or None

    # ------------------------------------------------------------------------------------ the engine
    def _exchange(self, row: torch.Tensor) -> list[S.Row]:
        rows = torch.empty(self._size * row.numel(), dtype=torch.int64)
        self._gloo._allgather_base(rows, row).wait()
        return S.parse(rows, self._size)

    def _run(self, name, op, dtype, device, redop, error, sends, recvs, out_tensors, fallback, *, mode, row=1,
             reduce_out=None):
        """Exchange and check the rows, then move ``sends[d]`` (to rank d) into rank d's ``recvs[me]`` with the
        device's transport; ``reduce_out`` (reduce-scatter): the output the ring-order reduction writes.
        ``fallback``: c10d's collective, for a CUDA group that uses NCCL (no P2P, or no C++ part)."""
        W, me = self._size, self._rank
        transport = self._transport(device)  # collective on the first CUDA call: every rank gets here
        if transport is None:
            return fallback()
        gen = transport.prepare(sends if not error else [], mode)  # on every rank: CUDA slots stay in step
        if gen < 0:
            error, gen = 8, 0
        counts = (lambda ts: [t.numel() for t in ts]) if not error else (lambda ts: None)
        rows = self._exchange(S.meta_row(W, op, dtype, S.NO_REDUCE if redop is None else redop, error,
                                         counts(sends), counts(recvs), gen, row))
        S.check_rows(rows, W, name, f"group {self._name!r}")
        self.stats["own"][name] = self.stats["own"].get(name, 0) + 1
        transport.stage(sends, mode, rows, me)
        if op != S.REDUCE_SCATTER:
            transport.local(recvs[me], sends[me])
        ce = S.chunk_elems(self._options.chunk_bytes, dtype)
        send_pieces = {s: S.pieces(sends[S.serve_to(me, s, W)].numel(), ce) for s in range(1, W)}
        recv_pieces = {s: S.pieces(recvs[S.pull_from(me, s, W)].numel(), ce) for s in range(1, W)}
        out_pieces = S.pieces(reduce_out.numel(), ce) if reduce_out is not None else []
        n_pieces = max([len(p) for p in (*send_pieces.values(), *recv_pieces.values(), out_pieces)], default=0)
        order = S.ring_order(me, W)
        for j in range(n_pieces):
            for s in range(1, W):
                dst, src = S.serve_to(me, s, W), S.pull_from(me, s, W)
                send = recv = None
                if j < len(send_pieces[s]):
                    a, n = send_pieces[s][j]
                    send = (dst, sends[dst][a:a + n])
                if j < len(recv_pieces[s]):
                    a, n = recv_pieces[s][j]
                    recv = (src, recvs[src][a:a + n], a)
                transport.step(s, send, recv)
            reduce = None
            if reduce_out is not None:
                a, n = out_pieces[j]
                parts = [recvs[p][a:a + n] for p in order]
                reduce = (lambda parts=parts, out=reduce_out[a:a + n]: transport.reduce(out, parts, redop, W))
            transport.piece_done(j, reduce)
        return transport.finish(out_tensors)

    # --------------------------------------------------------------------------------- all-gather
    def _all_gather(self, name, outs, inp, out_tensors, fallback, error=0):
        W = self._size
        error = error or _check_same(inp, outs)
        if not error and (len(outs) != W or any(o.numel() != inp.numel() for o in outs)):
            error = 4
        sends = [inp.view(-1)] * W if not error else []
        recvs = [o.view(-1) for o in outs] if not error else []
        return self._run(name, S.ALL_GATHER, inp.dtype, inp.device, None, error, sends, recvs, out_tensors, fallback,
                         mode="alias")

    def all_gather_single(self, output, input, opts=None):
        W = self._size
        error = _check_same(input, [output])
        if not error and output.numel() != W * input.numel():
            error = 4
        outs = (list(output.view(-1).split(input.numel())) if input.numel() else [output.view(-1)[:0]] * W) \
            if not error else []
        return self._all_gather("all_gather_into_tensor", outs, input, [output],
                                lambda: self._delegate("_allgather_base", [input], output, input, opts), error)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None):
        if len(input_tensors) != 1 or len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
            return self._delegate("allgather", input_tensors, output_tensors, input_tensors, opts)
        return self._all_gather("all_gather", output_tensors[0], input_tensors[0], output_tensors,
                                lambda: self._delegate("allgather", input_tensors, output_tensors, input_tensors, opts))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self.all_gather_single(o, i, opts).wait()
        return self._done(outputs, inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ------------------------------------------------------------------------------ reduce-scatter
    def _reduce_scatter(self, name, out, chunks, opts, out_tensors, fallback, error=0):
        W, me = self._size, self._rank
        redop = S.reduce_code(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        if redop == S.REDUCE_CODES["AVG"] and not out.is_floating_point():
            redop = None
        if redop is None:  # PREMUL_SUM, bitwise ops, AVG of integers: c10d's
            return fallback()
        error = error or _check_same(out, chunks)
        if not error and (len(chunks) != W or any(c.numel() != out.numel() for c in chunks)):
            error = 4
        sends = [c.view(-1) for c in chunks] if not error else []
        recvs = ([torch.empty(out.numel(), dtype=out.dtype, device=out.device) if p != me else sends[me]
                  for p in range(W)]) if not error else []
        return self._run(name, S.REDUCE_SCATTER, out.dtype, out.device, redop, error, sends, recvs, out_tensors,
                         fallback, mode="concat", reduce_out=out.view(-1) if not error else None)

    def reduce_scatter_single(self, output, input, opts=None):
        W = self._size
        error = _check_same(input, [output])
        if not error and input.numel() != W * output.numel():
            error = 4
        chunks = (list(input.view(-1).split(output.numel())) if output.numel() else [input.view(-1)[:0]] * W) \
            if not error else []
        return self._reduce_scatter("reduce_scatter_tensor", output, chunks, opts, [output],
                                    lambda: self._delegate("_reduce_scatter_base", [input], output, input, opts), error)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        if len(output_tensors) != 1 or len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            return self._delegate("reduce_scatter", output_tensors, output_tensors, input_tensors, opts)
        return self._reduce_scatter("reduce_scatter", output_tensors[0], input_tensors[0], opts, output_tensors,
                                    lambda: self._delegate("reduce_scatter", output_tensors, output_tensors,
                                                           input_tensors, opts))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(o, i, opts).wait()
        return self._done(outputs, inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # --------------------------------------------------------------------------------- all-to-all
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        W = self._size
        error = _check_same(input, [output])
        row = int(input[0].numel()) if input.dim() and input.shape[0] else int(output[0].numel()) \
            if output.dim() and output.shape[0] else 1
        sends = recvs = []
        if not error:
            splits = []
            for t, given in ((input, input_split_sizes), (output, output_split_sizes)):
                rows = t.shape[0] if t.dim() else 1
                if given is not None and len(given) not in (0, W):
                    error = 7
                    break
                if not given:
                    if rows % W:
                        error = 6
                        break
                    given = [rows // W] * W
                if sum(given) != rows or min(given) < 0:
                    error = 5
                    break
                splits.append([int(g) * row for g in given])
            if not error:
                (ins, outs), flat_in, flat_out = splits, input.view(-1), output.view(-1)
                sends, recvs = list(flat_in.split(ins)), list(flat_out.split(outs))
        return self._run("all_to_all_single", S.ALL_TO_ALL, input.dtype, input.device, None, error, sends, recvs,
                         [output], lambda: self._delegate("alltoall_base", [input], output, input,
                                                          output_split_sizes or [], input_split_sizes or [], opts),
                         mode="concat", row=row if not error else 1)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            return self._delegate("alltoall", input_tensors, output_tensors, input_tensors, opts)
        first = input_tensors[0]
        error = _check_same(first, [*input_tensors[1:], *output_tensors])
        sends = [t.view(-1) for t in input_tensors] if not error else []
        recvs = [t.view(-1) for t in output_tensors] if not error else []
        return self._run("all_to_all", S.ALL_TO_ALL, first.dtype, first.device, None, error, sends, recvs,
                         output_tensors, lambda: self._delegate("alltoall", input_tensors, output_tensors,
                                                                input_tensors, opts), mode="concat")

    def _done(self, outputs, inputs):
        t = next(iter(outputs), None)
        if t is not None and t.is_cuda and self._cuda:
            return self._cuda.finish(outputs)
        return DoneWork(outputs)

    # ------------------------------------------------------------------------------ delegated to c10d
    def allreduce(self, tensors, opts=None):
        return self._delegate("allreduce", tensors, tensors, opts or dist.AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        return self._delegate("allreduce_coalesced", tensors, tensors, opts or dist.AllreduceCoalescedOptions())

    def broadcast(self, tensors, opts=None):
        return self._delegate("broadcast", tensors, tensors, opts or dist.BroadcastOptions())

    def reduce(self, tensors, opts=None):
        return self._delegate("reduce", tensors, tensors, opts or dist.ReduceOptions())

    def gather(self, output_tensors, input_tensors, opts=None):
        return self._delegate("gather", input_tensors, output_tensors, input_tensors, opts or dist.GatherOptions())

    def scatter(self, output_tensors, input_tensors, opts=None):
        return self._delegate("scatter", output_tensors, output_tensors, input_tensors, opts or dist.ScatterOptions())

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        return self._delegate("allgather_coalesced", input_tensors, output_lists, input_tensors, opts)

    def send(self, tensors, dst, tag):
        return self._delegate("send", tensors, tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._delegate("recv", tensors, tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._delegate("recv_anysource", tensors, tensors, tag)

    def barrier(self, opts=None):
        self.stats["delegated"]["barrier"] = self.stats["delegated"].get("barrier", 0) + 1
        return self._gloo.barrier(opts or dist.BarrierOptions())

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self._gloo.monitored_barrier(timeout, wait_all_ranks)


def _check_same(ref: torch.Tensor, others) -> int:
    """The local error code for ``ref`` and ``others`` (0: fine)."""
    for t in (ref, *others):
        if not t.is_contiguous():
            return 1
    for t in others:
        if t.dtype != ref.dtype:
            return 2
        if t.device != ref.device:
            return 3
    return 0


def make_creator(options):
    """The ``register_backend`` creator: one NcclxProcessGroup per c10d group."""

    def create(store, rank, size, timeout):
        return NcclxProcessGroup(store, rank, size, timeout, options)

    return create
