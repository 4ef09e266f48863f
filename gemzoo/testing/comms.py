"""Comms conformance: a backend installs, a process group starts with the c10d backend it names for CPU (gloo
for the tests), and every collective it claims to implement itself (``capabilities.implements``), plus the ones
every trainer uses (all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single),
gives c10d's answer: the result of the same call on a plain gloo group, and the closed form.

    from gemzoo.testing.comms import check_comms_on_gloo
    def test_conformance(tmp_path):
        check_comms_on_gloo("my-backend", tmp_path)   # spawns 2 ranks
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch

BASE_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target, world: int, *args, timeout: float = 240) -> None:
    """Run ``target(rank, world, port, *args)`` in ``world`` spawned processes; fail naming the ranks that did."""
    import torch.multiprocessing as mp

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not bad, f"ranks {sorted(bad)} exited with {sorted(set(bad.values()))} (None: still running after {timeout}s)"


def rank_env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GEMZOO_QUIET="1")


def _inputs(rank: int, world: int) -> dict:
    base = torch.arange(4 * world, dtype=torch.float32) + 100 * rank
    return {"x": base, "rank": rank, "world": world}


def _run(name: str, group, rank: int, world: int) -> torch.Tensor:
    import torch.distributed as dist

    x = _inputs(rank, world)["x"].clone()
    if name == "all_reduce":
        dist.all_reduce(x, group=group)
        return x
    if name == "broadcast":
        dist.broadcast(x, src=0, group=group)
        return x
    if name == "all_gather_into_tensor":
        out = torch.empty(world * x.numel())
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    if name == "reduce_scatter_tensor":
        out = torch.empty(x.numel() // world)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    if name == "all_to_all_single":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out
    raise NotImplementedError(name)


def _closed_form(name: str, rank: int, world: int) -> torch.Tensor:
    xs = [_inputs(r, world)["x"] for r in range(world)]
    if name == "all_reduce":
        return sum(xs)
    if name == "broadcast":
        return xs[0]
    if name == "all_gather_into_tensor":
        return torch.cat(xs)
    n = xs[0].numel() // world
    if name == "reduce_scatter_tensor":
        return sum(xs)[rank * n:(rank + 1) * n]
    if name == "all_to_all_single":
        return torch.cat([x[rank * n:(rank + 1) * n] for x in xs])
    raise NotImplementedError(name)


def comms_rank(rank: int, world: int, port: int, names: list[str], out_dir: str) -> None:
    """One rank: for each backend name, install, init, run every collective, compare, destroy."""
    rank_env(rank, world, port)
    import torch.distributed as dist

    from gemzoo import registry

    results = {}
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    for name in names:
        backend = registry.get("comms", name)
        backend.install()
        dist.init_process_group(backend.backend_for("cpu"), store=dist.PrefixStore(f"{name}/", store),
                                rank=rank, world_size=world)
        gloo = dist.new_group(backend="gloo")
        claimed = sorted(backend.capabilities.implements)
        checked = {}
        for coll in dict.fromkeys([*BASE_COLLECTIVES, *claimed]):
            got = _run(coll, None, rank, world)
            want = _run(coll, gloo, rank, world) if coll in BASE_COLLECTIVES else _closed_form(coll, rank, world)
            assert torch.equal(got, want), f"comms {name!r}: {coll} gives {got.tolist()}, c10d gives {want.tolist()}"
            assert torch.equal(got, _closed_form(coll, rank, world)), f"comms {name!r}: {coll} is wrong: {got.tolist()}"
            checked[coll] = True
        results[name] = {"checked": sorted(checked), "claimed": claimed, "sm_free": bool(backend.capabilities.sm_free)}
        dist.destroy_process_group()
    Path(out_dir, f"comms{rank}.json").write_text(json.dumps(results))


def check_comms_on_gloo(names, tmp_path, world: int = 2) -> dict:
    """Spawn ``world`` CPU ranks that check each comms backend in ``names``; returns rank 0's summary."""
    names = [names] if isinstance(names, str) else list(names)
    spawn(comms_rank, world, names, str(tmp_path))
    return json.loads(Path(tmp_path, "comms0.json").read_text())
