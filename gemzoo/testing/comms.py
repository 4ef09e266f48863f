"""Comms conformance: a backend installs, the default process group starts with the c10d backend it names for
CPU (gloo is the transport there), and every collective it claims to run itself (``capabilities.implements``),
plus the ones the trainer, FSDP2 and torchrec use (``BASE_COLLECTIVES``), gives c10d's answer: the same call
on a plain gloo group, and the closed form. Each runs in float32, bfloat16 and int64, at zero size and not,
with a non-zero root, uneven all-to-all splits and a MAX reduction. The DeviceMesh built through
``gemzoo.distributed.comms_groups.init_mesh`` (1-D ``dp`` and 2-D ``replica x shard`` in both shapes) has on
every dimension the backend the comms backend declares for it (``backend_for_dim``, else its default), and
the collectives on those groups give the closed form.

    from gemzoo.testing.comms import check_comms_on_gloo
    def test_conformance(tmp_path):
        check_comms_on_gloo("my-backend", tmp_path)            # a registered name; spawns 2 ranks
        check_comms_on_gloo({"mine": MyBackend()}, tmp_path)   # or objects (they must pickle)
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch

from gemzoo import registry
from gemzoo.distributed.comms_groups import init_mesh, mesh_group_backends
from gemzoo.interfaces.comms import dim_backends
from gemzoo.testing.timeouts import hang_guard

# What the trainer (all_reduce, broadcast, barrier), FSDP2 (all_gather_into_tensor, reduce_scatter_tensor) and
# torchrec (all_to_all_single, all_gather) call: checked for every backend, claimed or delegated.
BASE_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                    "all_gather", "barrier")
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
SIZES = (0, 3)  # elements per rank's chunk: zero-size inputs, and not
MESHES = (((None,), ("dp",)), ((None, 1), ("replica", "shard")), ((1, None), ("replica", "shard")))  # None: world


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target, world: int, *args, timeout: float | None = None, hide_cuda: bool = False) -> None:
    """Run ``target(rank, world, port, *args)`` in ``world`` spawned processes; fail naming the ranks that did.
    ``timeout``: a hang guard for the ranks in seconds (default ``hang_guard(900)``, see gemzoo.testing.timeouts).
    ``hide_cuda``: the ranks start with ``CUDA_VISIBLE_DEVICES=""``, so on a GPU machine they are the CPU ranks
    they are on CI (not ``world`` ranks sharing one GPU)."""
    import torch.multiprocessing as mp

    timeout = hang_guard(900) if timeout is None else timeout
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_run_rank, args=(target, r, world, port, *args)) for r in range(world)]
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide_cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a spawned child copies the environment at start()
    try:
        for p in procs:
            p.start()
    finally:
        if hide_cuda and saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        elif hide_cuda:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    for p in procs:
        p.join(timeout=timeout)
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not bad, (f"ranks {sorted(bad)} exited with {sorted(set(bad.values()))} (None: still running after "
                     f"{timeout:.0f} s, the hang guard; GEMZOO_TEST_TIMEOUT_SCALE raises it)")


def _run_rank(target, rank: int, *args) -> None:
    """A spawned rank: ``target``, then an exit that skips the interpreter's teardown once it returned. Rank 0
    hosts the TCPStore of ``tcp://`` initialisation; torch's threads behind it and gloo's could still be
    running while the interpreter tears down, and then the process aborts ("terminate called without an
    active exception", SIGABRT) after its work passed. A failure still raises here, with its traceback and
    exit code 1."""
    import logging
    import sys

    target(rank, *args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def share_cores(world: int) -> None:
    """Give this rank its share of the machine's cores for torch's intra-op team. ``world`` ranks with a team
    on every core each oversubscribe the CPU, and every parallel op then waits at its barrier for threads that
    are off a core: on the H200's 16-core host a 4-rank gloo test took over 90 s. (Numbers change only in
    reduction order, the same for every run of a test.)"""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))


def rank_env(rank: int, world: int, port: int, quiet: bool = True) -> None:
    """A spawned rank's torch.distributed environment (``quiet``: GEMZOO_QUIET=1) and its share of the cores."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **({"GEMZOO_QUIET": "1"} if quiet else {}))
    share_cores(world)


def _x(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in bfloat16, and their sums over a few ranks too), different on every rank."""
    return ((torch.arange(n) * 3 + 5 * rank + 1) % 11).to(dtype)


def _splits(rank: int, world: int, n: int) -> list[int]:
    """Uneven all-to-all splits: what ``rank`` sends to each rank (zeros included when n > 0)."""
    return [(rank + 2 * d) % 3 * (n > 0) + (n > 0 and d == 0) for d in range(world)]


# Each case: (collective, variant). ``_run`` calls it on ``group``; ``_closed_form`` says what it must give.
CASES = {
    "all_reduce": ("sum", "max"), "broadcast": ("root-last",), "reduce": ("sum-to-0",),
    "all_gather_into_tensor": ("",), "all_gather": ("",), "reduce_scatter_tensor": ("",), "reduce_scatter": ("",),
    "all_to_all_single": ("even", "uneven"), "all_to_all": ("",), "gather": ("to-0",), "scatter": ("from-last",),
    "barrier": ("",), "send": ("ring",), "recv": ("ring",),
}


def _run(name: str, variant: str, group, rank: int, world: int, n: int, dtype) -> torch.Tensor | None:
    """This rank's result of the collective on ``group`` (``rank``/``world``: in the group)."""
    import torch.distributed as dist

    glob = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    if name == "all_reduce":
        x = _x(rank, n * world, dtype)
        dist.all_reduce(x, op=dist.ReduceOp.MAX if variant == "max" else dist.ReduceOp.SUM, group=group)
        return x
    if name == "broadcast":
        x = _x(rank, n * world, dtype)
        dist.broadcast(x, src=glob(world - 1), group=group)
        return x
    if name == "reduce":
        x = _x(rank, n * world, dtype)
        dist.reduce(x, dst=glob(0), group=group)
        return x if rank == 0 else None
    if name == "all_gather_into_tensor":
        out = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(out, _x(rank, n, dtype), group=group)
        return out
    if name == "all_gather":
        out = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.all_gather(out, _x(rank, n, dtype), group=group)
        return torch.cat(out)
    if name == "reduce_scatter_tensor":
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, _x(rank, n * world, dtype), group=group)
        return out
    if name == "reduce_scatter":
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, list(_x(rank, n * world, dtype).split(n) if n else [out.clone()] * world), group=group)
        return out
    if name == "all_to_all_single":
        if variant == "even":
            out = torch.empty(n * world, dtype=dtype)
            dist.all_to_all_single(out, _x(rank, n * world, dtype), group=group)
            return out
        send = _splits(rank, world, n)
        recv = [_splits(s, world, n)[rank] for s in range(world)]
        out = torch.empty(sum(recv), dtype=dtype)
        dist.all_to_all_single(out, _x(rank, sum(send), dtype), output_split_sizes=recv, input_split_sizes=send,
                               group=group)
        return out
    if name == "all_to_all":
        out = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.all_to_all(out, list(_x(rank, n * world, dtype).split(n)) if n else [torch.empty(0, dtype=dtype)] * world,
                        group=group)
        return torch.cat(out)
    if name == "gather":
        out = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == 0 else None
        dist.gather(_x(rank, n, dtype), out, dst=glob(0), group=group)
        return torch.cat(out) if rank == 0 else None
    if name == "scatter":
        out = torch.empty(n, dtype=dtype)
        chunks = [_x(world - 1, n * world, dtype)[r * n:(r + 1) * n].clone() for r in range(world)]
        dist.scatter(out, chunks if rank == world - 1 else None, src=glob(world - 1), group=group)
        return out
    if name == "barrier":
        dist.barrier(group=group)
        return None
    if name in ("send", "recv"):  # a ring: each rank sends to the next and receives from the previous
        out = torch.empty(n, dtype=dtype)
        if world == 1:
            return _x(rank, n, dtype)
        if rank % 2 == 0:
            dist.send(_x(rank, n, dtype), dst=glob((rank + 1) % world), group=group)
            dist.recv(out, src=glob((rank - 1) % world), group=group)
        else:
            dist.recv(out, src=glob((rank - 1) % world), group=group)
            dist.send(_x(rank, n, dtype), dst=glob((rank + 1) % world), group=group)
        return out
    raise NotImplementedError(name)


def _closed_form(name: str, variant: str, rank: int, world: int, n: int, dtype) -> torch.Tensor | None:
    full = [_x(r, n * world, dtype) for r in range(world)]
    own = [_x(r, n, dtype) for r in range(world)]
    if name == "all_reduce":
        return torch.stack(full).amax(0) if variant == "max" else sum(full[1:], full[0].clone())
    if name == "broadcast":
        return full[world - 1]
    if name == "reduce":
        return sum(full[1:], full[0].clone()) if rank == 0 else None
    if name in ("all_gather_into_tensor", "all_gather"):
        return torch.cat(own)
    if name in ("reduce_scatter_tensor", "reduce_scatter"):
        return sum(full[1:], full[0].clone())[rank * n:(rank + 1) * n]
    if name == "all_to_all_single" and variant == "uneven":
        parts = []
        for s in range(world):
            send = _splits(s, world, n)
            start = sum(send[:rank])
            parts.append(_x(s, sum(send), dtype)[start:start + send[rank]])
        return torch.cat(parts)
    if name in ("all_to_all_single", "all_to_all"):
        return torch.cat([f[rank * n:(rank + 1) * n] for f in full])
    if name == "gather":
        return torch.cat(own) if rank == 0 else None
    if name == "scatter":
        return full[world - 1][rank * n:(rank + 1) * n]
    if name == "barrier":
        return None
    if name in ("send", "recv"):
        return own[(rank - 1) % world]
    raise NotImplementedError(name)


_UNSET = object()


def compare(backend: str, coll: str, variant: str, dtype, n: int, got, want, c10d=_UNSET) -> None:
    """Fail naming the backend, collective and case when ``got`` is not c10d's answer (``c10d``, when given)
    and the closed form (``want``), bit for bit and in dtype (None: the collective leaves no result here)."""
    case = f"comms {backend!r}: {coll}{'/' + variant if variant else ''} ({dtype}, {n} per rank)"
    refs = [("c10d (gloo)", c10d)] if c10d is not _UNSET else []
    for label, ref in (*refs, ("the closed form", want)):
        if ref is None and got is None:
            continue
        if ref is None or got is None or got.dtype != ref.dtype or not torch.equal(got, ref):
            show = (lambda t: None if t is None else t.tolist())
            raise AssertionError(f"{case} gives {show(got)}, {label} gives {show(ref)}")


def _gloo_reference(coll: str, variant: str, gloo, rank: int, world: int, n: int, dtype):
    """c10d's answer on the plain gloo group, or no reference (the closed form alone decides) where this torch's
    gloo lacks the collective: torch 2.11's gloo has no list ``all_to_all`` ("Backend gloo does not support
    alltoall", raised on every rank before anything moves); 2.13's has."""
    if gloo is None:
        return _UNSET
    try:
        return _run(coll, variant, gloo, rank, world, n, dtype)
    except RuntimeError as e:
        if "does not support" not in str(e):
            raise
        return _UNSET


def check_collectives(backend: str, collectives, group, gloo, rank: int, world: int) -> list[str]:
    """Every case of ``collectives`` on ``group`` against gloo (when given) and the closed form."""
    checked = []
    for coll in collectives:
        for variant in CASES[coll]:
            for dtype in DTYPES:
                for n in SIZES:
                    got = _run(coll, variant, group, rank, world, n, dtype)
                    want = _closed_form(coll, variant, rank, world, n, dtype)
                    ref = _gloo_reference(coll, variant, gloo, rank, world, n, dtype)
                    compare(backend, coll, variant, dtype, n, got, want, ref)
        checked.append(coll)
    return checked


def comms_rank(rank: int, world: int, port: int, backends: dict, out_dir: str) -> None:
    """One rank: for each backend (a registered name -> None, or an object), install, init, run every base and
    claimed collective, compare, build the meshes and check their groups, destroy."""
    rank_env(rank, world, port)
    import torch.distributed as dist

    results = {}
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    for name, backend in backends.items():
        backend = registry.get("comms", name) if backend is None else backend
        backend.install()
        default = backend.backend_for("cpu")
        dist.init_process_group(default, store=dist.PrefixStore(f"{name}/", store), rank=rank, world_size=world)
        assert str(dist.get_backend()) == default, f"comms {name!r}: the default group runs {dist.get_backend()}"
        gloo = dist.new_group(backend="gloo")
        claimed = sorted(backend.capabilities.implements)
        colls = list(dict.fromkeys([*BASE_COLLECTIVES, *claimed]))
        checked = check_collectives(name, colls, None, gloo, rank, world)
        meshes = {}
        for shape, dims in MESHES:
            shape = tuple(world if s is None else s for s in shape)
            mesh = init_mesh(backend, "cpu", shape, dims)
            declared = dim_backends(backend, dims, "cpu")
            have = mesh_group_backends(mesh)
            for i, dim in enumerate(dims):
                want = declared.get(dim, default)
                assert have[dim] == want, f"comms {name!r}: mesh dim {dim!r} of {shape} has a {have[dim]} group, " \
                                          f"the backend declares {want}"
                group = mesh.get_group(i)
                check_collectives(name, colls, group, None, dist.get_rank(group), dist.get_world_size(group))
            meshes["x".join(map(str, shape))] = have
        results[name] = {"checked": checked, "claimed": claimed, "sm_free": bool(backend.capabilities.sm_free),
                         "meshes": meshes}
        dist.destroy_process_group()
    Path(out_dir, f"comms{rank}.json").write_text(json.dumps(results))


def check_comms_on_gloo(backends, tmp_path, world: int = 2) -> dict:
    """Spawn ``world`` CPU ranks (CUDA hidden from them on a GPU machine) that check each comms backend
    (registered names, or a dict name -> backend object, which must pickle); returns rank 0's summary."""
    if isinstance(backends, str):
        backends = [backends]
    backends = dict(backends) if isinstance(backends, dict) else {n: None for n in backends}
    spawn(comms_rank, world, backends, str(tmp_path), hide_cuda=True)
    return json.loads(Path(tmp_path, "comms0.json").read_text())
