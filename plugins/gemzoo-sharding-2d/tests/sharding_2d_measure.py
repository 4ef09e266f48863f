"""Train a config and record what sharding-2d stored and sent: the tests' and the bench's measurement (a
package-unique module name, imported as ``sharding_2d_measure``; the bench scripts put this folder on sys.path)."""

from __future__ import annotations


def train_and_record(cfg, *, resume=False) -> dict:
    """Train ``cfg``; returns ``losses`` and ``steps`` (every logged step), and with planner sharding-2d this
    rank's table ``memory`` (bytes, ``ShardedTables.memory``) and ``bytes``: its cumulative ``CommCounter``
    snapshot after each step."""
    from gemzoo_sharding_2d.plugin import Sharding2D

    from gemzoo.api import hookimpl, registry, train

    seen = {"memory": None, "bytes": []}
    ours = cfg.plugins.planner == "sharding-2d"

    class Record:
        @hookimpl
        def gemzoo_step_end(self, trainer, step, metrics):
            if ours:
                seen["memory"] = Sharding2D.memory(trainer.model)
                seen["bytes"].append(Sharding2D.comm_bytes(trainer.model))

    host = registry.host()
    rec = Record()
    host.register(rec, name=f"sharding-2d-record-{id(rec)}")
    try:
        result = train(cfg, resume=resume, progress=False)
    finally:
        host.pm.unregister(rec)
    return {"losses": [h["loss"] for h in result.history], "steps": [h["step"] for h in result.history],
            "memory": seen["memory"], "bytes": seen["bytes"]}


def per_step(snapshots: list[dict]) -> list[dict[str, int]]:
    """Cumulative CommCounter snapshots -> the bytes of each step."""
    out, prev = [], {}
    for snap in snapshots:
        out.append({k: v - prev.get(k, 0) for k, v in snap["bytes"].items() if v - prev.get(k, 0)})
        prev = snap["bytes"]
    return out


def sample_ids(ds, step: int, rank: int, world: int) -> tuple[dict[str, float], int]:
    """(mean ids a sample of each sparse feature, samples) of the part of ``step``'s batch ``rank`` loads."""
    from gemzoo.api import load_shard

    b = load_shard(ds, step, rank, world)
    n = b.num_samples
    return {k: float(b.sparse_lengths[i * n:(i + 1) * n].sum()) / n for i, k in enumerate(b.sparse_keys)}, n
