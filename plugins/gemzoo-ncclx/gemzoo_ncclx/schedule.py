"""The transport-independent half of ncclx: what every collective moves, in which order, and how it reduces.

Every claimed collective becomes, on each rank, a list of *send slots* (one flat tensor per destination rank,
what this rank gives it) and *recv slots* (one per source rank, where that rank's data lands). Before any data
moves the ranks all-gather a fixed-length metadata row (:func:`meta_row`: collective, dtype, reduce op, the
element counts per peer), so every rank can check the call against every other rank's (:func:`check_rows`)
and all of them raise the same error instead of one hanging.

The schedule is a *pull* schedule. At step ``s`` (1..W-1) rank ``d`` pulls from ``(d + s) % W`` and serves
``(d - s) % W``: every step is a permutation, so no rank is read by two peers at once. Each transfer is cut
into pieces of at most ``chunk_bytes``; the loop runs pieces outermost (piece 0 from every peer, then piece
1, ...), which on CUDA lets the reduction of piece j overlap the copies of piece j+1. Reduce-scatter reduces
rank d's chunk in the ring order ``[(d - 1 - k) % W for k in range(W)]`` with the dtype's own arithmetic
(one rounding per addition), the order gloo's ring uses, so the CPU path matches c10d's gloo bit for bit
whenever gloo's segments line up with the ranks' chunks (always for 2 ranks; for more, an even number of
elements per rank) and the CUDA kernel reduces in that same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

MAGIC = 0x6E63636C78  # "ncclx": a row that is not ours (another collective on the same transport) is obvious

# collective codes (the all-gather forms share one code: a list call on one rank and a tensor call on another
# still move the same bytes, as with NCCL)
ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = 1, 2, 3
OP_NAMES = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_TO_ALL: "all_to_all"}

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}

# reduce ops run here (others are delegated to c10d): SUM, PRODUCT, MIN, MAX, and AVG for floating dtypes
REDUCE_CODES = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "AVG": 4}
REDUCE_NAMES = {v: k for k, v in REDUCE_CODES.items()}
NO_REDUCE = 15

# local argument errors, carried in the row so every rank raises (code -> what is wrong)
LOCAL_ERRORS = {
    1: "a non-contiguous tensor (call .contiguous() first)",
    2: "input and output of different dtypes",
    3: "input and output on different devices",
    4: "output sizes that do not fit the input (all_gather: output = world x input; reduce_scatter: input = "
       "world x output)",
    5: "split sizes that do not add up to its tensor's first dimension",
    6: "a tensor whose first dimension does not divide evenly by the world size with no split sizes given",
    7: "output_split_sizes / input_split_sizes whose length is not the world size",
    8: "a collective too large for its staging buffer (cudaMalloc failed: free GPU memory or move less "
       "per call)",
}

HEADER = 7  # MAGIC, op, dtype, reduce op, local error, rows' trailing numel, staging generation


class NcclxError(RuntimeError):
    """A collective whose arguments disagree across ranks (or are wrong on one): raised on every rank."""


def ring_order(rank: int, world: int) -> list[int]:
    """The ranks whose chunks rank ``rank`` adds, in order: (rank-1), (rank-2), ..., rank (gloo's ring)."""
    return [(rank - 1 - k) % world for k in range(world)]


def pull_from(rank: int, step: int, world: int) -> int:
    return (rank + step) % world


def serve_to(rank: int, step: int, world: int) -> int:
    return (rank - step) % world


def pieces(numel: int, chunk_elems: int) -> list[tuple[int, int]]:
    """(start, length) pieces of at most ``chunk_elems`` elements; none for zero elements."""
    return [(s, min(chunk_elems, numel - s)) for s in range(0, numel, chunk_elems)]


def chunk_elems(chunk_bytes: int, dtype: torch.dtype) -> int:
    return max(1, chunk_bytes // max(1, torch.empty((), dtype=dtype).element_size()))


def reduce_code(op) -> int | None:
    """The code of a ``ReduceOp`` this backend reduces itself, or None (delegate to c10d)."""
    for name, code in REDUCE_CODES.items():
        if op == getattr(dist.ReduceOp, name):
            return code
    return None


def meta_row(world: int, op: int, dtype: torch.dtype, redop: int, error: int, sends: list[int], recvs: list[int],
             gen: int = 0, row: int = 1) -> torch.Tensor:
    """This rank's metadata: [MAGIC, op, dtype, reduce op, local error, trailing numel, gen, sends.., recvs..]
    (element counts per peer; -1 where a local error leaves them unknown)."""
    sends = list(sends) if sends is not None else [-1] * world
    recvs = list(recvs) if recvs is not None else [-1] * world
    return torch.tensor([MAGIC, op, DTYPE_CODE.get(dtype, -1), redop, error, row, gen, *sends, *recvs],
                        dtype=torch.int64)


@dataclass
class Row:
    op: int
    dtype: int
    redop: int
    error: int
    row: int
    gen: int
    sends: list[int]
    recvs: list[int]


def parse(rows: torch.Tensor, world: int) -> list[Row]:
    rows = rows.view(world, HEADER + 2 * world).tolist()
    return [Row(r[1], r[2], r[3], r[4], r[5], r[6], r[HEADER:HEADER + world], r[HEADER + world:]) for r in rows]


def _what(r: Row) -> str:
    dtype = DTYPES[r.dtype] if 0 <= r.dtype < len(DTYPES) else "an unsupported dtype"
    red = f", {REDUCE_NAMES[r.redop]}" if r.redop in REDUCE_NAMES else ""
    return f"{OP_NAMES.get(r.op, f'collective {r.op}')} ({dtype}{red})"


def check_rows(rows: list[Row], world: int, name: str, group: str = "") -> None:
    """Raise the same :class:`NcclxError` on every rank when the ranks' calls do not fit together."""
    where = f"ncclx {name} on {group or 'a group'} of {world} ranks"
    bad = [(r, row) for r, row in enumerate(rows) if row.error]
    if bad:
        raise NcclxError(f"{where}: " + "; ".join(f"rank {r} passed {LOCAL_ERRORS.get(row.error, row.error)}"
                                                  for r, row in bad) + " (every rank stops here)")
    calls = {(row.op, row.dtype, row.redop) for row in rows}
    if len(calls) > 1:
        raise NcclxError(f"{where}: the ranks called different collectives: "
                         + ", ".join(f"rank {r} {_what(row)}" for r, row in enumerate(rows))
                         + "; every rank of a group must make the same calls in the same order")
    if len({row.row for row in rows}) > 1:
        raise NcclxError(f"{where}: rows of different widths (elements after the first dimension: "
                         + ", ".join(f"rank {r} {row.row}" for r, row in enumerate(rows)) + ")")
    op = rows[0].op
    if op in (ALL_GATHER, REDUCE_SCATTER):
        sizes = [row.recvs[0] if op == ALL_GATHER else row.sends[0] for row in rows]
        if len(set(sizes)) > 1:
            what = "input" if op == ALL_GATHER else "output"
            raise NcclxError(f"{where}: {what} sizes differ across ranks ("
                             + ", ".join(f"rank {r}: {n} elements" for r, n in enumerate(sizes))
                             + f"); every rank must pass the same {what} size")
    for s, srow in enumerate(rows):
        for d, drow in enumerate(rows):
            if srow.sends[d] != drow.recvs[s]:
                raise NcclxError(f"{where}: rank {s} sends {srow.sends[d]} elements to rank {d} but rank {d} expects "
                                 f"{drow.recvs[s]} from rank {s}; make input_split_sizes on each rank agree with "
                                 "output_split_sizes on its peers")


def reduce_parts(out: torch.Tensor, parts: list[torch.Tensor], redop: int, world: int) -> None:
    """``out`` = parts[0] (op) parts[1] (op) ... in list order, rounding to the dtype after every step (what
    gloo does, and what the CUDA kernel does); AVG divides the sum by ``world`` at the end."""
    acc = parts[0].clone()
    for p in parts[1:]:
        if redop in (REDUCE_CODES["SUM"], REDUCE_CODES["AVG"]):
            acc.add_(p)
        elif redop == REDUCE_CODES["PRODUCT"]:
            acc.mul_(p)
        elif redop == REDUCE_CODES["MIN"]:
            torch.minimum(acc, p, out=acc)
        else:
            torch.maximum(acc, p, out=acc)
    if redop == REDUCE_CODES["AVG"]:
        acc.div_(world)
    out.copy_(acc)
