"""``gemzoo plan``: per-rank memory and per-step communication of 1D and 2D embedding sharding at a target scale,
by calculation (no GPU): the evidence for worlds these machines cannot run.

For a config it builds the dataset (one batch, for the mean history length and ids per sparse feature) and the
model on ``meta`` (dense parameter counts, the tables), then for each layout (1D: one group of W ranks; 2D
``replicated`` and ``fully_sharded``: groups of G) it computes, per rank:

- memory: table weights and their Adagrad state on the busiest rank of a group (fp32, element-wise as the
  engine stores them; the whole group shard also lives during a fully-sharded step), dense parameters with grads and AdamW moments (16 bytes a
  parameter; FSDP shards the transformer blocks over the world), saved activations (estimate: bytes = tokens x
  d_model x layers x (10 + 6 ffn_mult), Korthikanti et al. 2022's 34 sbh per layer at ffn_mult 4 in 16-bit,
  without the attention-score term a flash kernel never stores);
- bytes handed to collectives per step, the same categories ``engine.CommCounter`` counts (the gloo tests
  check :func:`embedding_traffic` against them exactly), plus the dense gradient all-reduce and FSDP gathers;
- time at the stated link bandwidths: all-to-all bytes leave the rank in the fraction (n - 1) / n, split
  between peers on the node (NVLink) and off it (inter-node, per GPU); ring collectives move 2 (n-1)/n
  (all-reduce) or (n-1)/n (all-gather, reduce-scatter) of the payload and run at inter-node speed once the
  group leaves a node. Groups are consecutive ranks, replica groups strided by G;
- with a one-GPU step (``--profile RUN``: a run folder's measured mean step time and model FLOPs; or
  ``--step-s``/``--mfu`` with ``--peak-tflops``): the step time, samples/s and MFU at each world of ``--world
  8,64,1024``. A rank's compute is the one-GPU step scaled to its batch; the communication above is added, less
  the ``--overlap`` fraction of it that hides behind that compute (``step_time``). At world 1 there is nothing
  to communicate, so the measured step comes back unchanged. docs/scaling.md explains the model and its limits.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from gemzoo.api import ConfigError
from gemzoo_sharding_2d.layout import Layout, plan_layout

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}


def parse_bytes(text: str) -> float:
    """'141GB' -> 141e9, '80GiB' -> 80 * 2**30; ConfigError naming the text otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ConfigError(f"--hbm {text!r}: give a size such as 141GB or 80GiB")
    return float(m.group(1)) * UNITS[m.group(2).lower()]


@dataclass(frozen=True)
class Links:
    nvlink_gbs: float = 450.0  # per GPU, within a node
    ib_gbs: float = 50.0  # per GPU, between nodes
    gpus_per_node: int = 8


def _peers_on_node(n: int, stride: int, links: Links) -> int:
    """How many members of a group of ``n`` ranks spaced ``stride`` apart share a node (self included)."""
    return min(n, max(1, links.gpus_per_node // stride)) if stride < links.gpus_per_node else 1


def a2a_seconds(nbytes: float, n: int, stride: int, links: Links) -> float:
    if n <= 1:
        return 0.0
    k = _peers_on_node(n, stride, links)
    out = nbytes * (n - 1) / n
    intra, inter = out * (k - 1) / (n - 1), out * (n - k) / (n - 1)
    return max(intra / (links.nvlink_gbs * 1e9), inter / (links.ib_gbs * 1e9))


def ring_seconds(wire_bytes: float, n: int, stride: int, links: Links) -> float:
    if n <= 1:
        return 0.0
    on_node = _peers_on_node(n, stride, links) == n
    return wire_bytes / ((links.nvlink_gbs if on_node else links.ib_gbs) * 1e9)


def embedding_traffic(layout: Layout, features: list[str], batch: float, ids_per_sample: dict[str, float],
                      replica_sync: str = "gradients", sync_every: int = 1, rank: int | None = None) -> dict[str, float]:
    """Bytes a rank hands to each collective of the engine per training step, every rank of the job training
    ``batch`` samples with ``ids_per_sample`` mean ids a feature: those of group rank ``rank``, exactly; with
    ``rank=None`` the busiest rank's in each category (table-wise owners send the pooled lookups of the whole
    group; row-wise layouts are the same on every rank)."""
    G, R = layout.group_size, layout.replicas
    table_of = {f: t for t, s in layout.tables.items() for f in s.feature_names}
    owned_cols, stored, pieces = [0] * G, [0] * G, [0] * G  # per group rank
    all_cols = n_pairs = 0
    ids = 0.0
    for f in features:
        blocks = layout.blocks[table_of[f]]
        if blocks:
            ids += batch * ids_per_sample[f] * len({b.col_off for b in blocks})
        for b in blocks:
            owned_cols[b.rank] += b.cols
            all_cols += b.cols
            n_pairs += 1
    for bs in layout.blocks.values():
        for b in bs:
            stored[b.rank] += b.rows * b.cols
            pieces[b.rank] += math.ceil(b.rows / R) * b.cols
    pick = (lambda v: v[rank]) if rank is not None else max  # noqa: E731
    out = {}
    if G > 1:
        out["a2a_ids"] = 8 * (2 * G + batch * n_pairs + ids)
        out["a2a_pooled_fwd"] = 4 * G * batch * pick(owned_cols)  # an owner's pieces, to every source
        out["a2a_pooled_bwd"] = 4 * batch * all_cols  # a rank's gradients, to every owner
    if R > 1 and layout.strategy == "fully_sharded":
        out["replica_all_gather"] = 4 * pick(pieces)
        out["replica_reduce_scatter"] = 4 * pick(pieces) * R
    elif R > 1:
        out["replica_sync"] = 4 * pick(stored) * (1 if replica_sync == "gradients" else 2 / sync_every)
    return out


def describe_config(cfg, batch_per_rank: float | None = None, flop_batches: int = 0) -> dict:
    """What the calculation needs from a config: tables, features, mean tokens and ids per sample, dense sizes;
    with ``flop_batches`` the model FLOPs a sample (forward + backward, as the trainer counts them for MFU),
    averaged over that many of the dataset's first batches."""
    import torch

    from gemzoo.api import configured, transformer_blocks

    ds = configured("dataset", cfg.data.source, cfg).build(cfg.data, cfg.run.seed)
    batch = ds.train_batch(0)
    with torch.device("meta"):
        model = configured("model", cfg.model.family, cfg).build(cfg.model, ds.info)
    flops_per_sample = None
    if flop_batches:
        drawn = [batch, *(ds.train_batch(i) for i in range(1, flop_batches))]
        flops_per_sample = sum(model.flops(b) for b in drawn) / sum(b.num_samples for b in drawn)
    sparse = {id(p) for p in model.sparse_arch.parameters()} if getattr(model, "sparse_arch", None) else set()
    blocks = {id(p) for b in transformer_blocks(model) for p in b.parameters()}
    dense = [p for p in model.parameters() if id(p) not in sparse]
    keys = list(getattr(batch, "sparse_keys", ()) or ())
    lengths = getattr(batch, "sparse_lengths", None)
    b = batch.num_samples
    ids = {k: float(lengths[i * b:(i + 1) * b].double().mean()) for i, k in enumerate(keys)} if keys else {}
    return {"tables": model.embedding_tables() if sparse else [], "features": keys, "ids_per_sample": ids,
            "tokens_per_sample": batch.num_tokens / max(b, 1),
            "batch_per_rank": float(batch_per_rank if batch_per_rank is not None else cfg.data.batch_size),
            "dense_params": sum(p.numel() for p in dense), "block_params": sum(p.numel() for p in dense
                                                                             if id(p) in blocks),
            "d_model": cfg.model.d_model, "layers": len(transformer_blocks(model)),
            "ffn_mult": getattr(cfg.model, "ffn_mult", 4), "dense_parallel": cfg.run.dense_parallel,
            "flops_per_sample": flops_per_sample}


def layout_estimate(desc: dict, world: int, group: int, strategy: str, links: Links, *, sharding: str = "row_wise",
                    replica_sync: str = "gradients", sync_every: int = 1) -> dict:
    """Memory (bytes a rank) and traffic (bytes a rank a step; seconds) of one layout."""
    R = world // group
    layout = plan_layout(desc["tables"], group, R, strategy, [sharding], use_torchrec=False)
    B = desc["batch_per_rank"]
    traffic = embedding_traffic(layout, desc["features"], B, desc["ids_per_sample"], replica_sync, sync_every)
    whole = sum(s.numel for s in layout.tables.values()) * 4
    per_rank = [0.0] * group  # the busiest rank must fit: table-wise layouts are uneven
    for bs in layout.blocks.values():
        for b in bs:
            per_rank[b.rank] += math.ceil(b.rows / (R if strategy == "fully_sharded" else 1)) * b.cols * 4
    stored = max(per_rank)
    stored += sum(s.numel * 4 for t, s in layout.tables.items() if not layout.blocks[t])  # data-parallel tables
    fsdp = desc["dense_parallel"] == "fsdp" and world > 1
    rest = desc["dense_params"] - (desc["block_params"] if fsdp else 0)
    dense_bytes = 16 * (rest + (desc["block_params"] / world if fsdp else 0))
    tokens = B * desc["tokens_per_sample"]
    activations = tokens * desc["d_model"] * desc["layers"] * (10 + 6 * desc["ffn_mult"])
    transient = whole / group if strategy == "fully_sharded" and R > 1 else 0.0
    memory = {"tables": stored, "optimizer_state": stored, "dense": dense_bytes, "activations": activations,
              "gathered_group_shard": transient}
    memory["total"] = sum(memory.values())
    # dense traffic: the gradient all-reduce of replicated parameters over all ranks, FSDP gathers of blocks
    traffic["dense_all_reduce"] = 4 * rest if world > 1 else 0.0
    traffic["fsdp_gathers"] = 3 * 4 * desc["block_params"] / world if fsdp else 0.0  # 2 all-gathers + 1 reduce-scatter
    seconds = {
        "a2a": a2a_seconds(sum(traffic.get(k, 0) for k in ("a2a_ids", "a2a_pooled_fwd", "a2a_pooled_bwd")), group,
                           1, links),
        "replica": ring_seconds(traffic.get("replica_sync", 0) * 2 * (R - 1) / max(R, 1)
                                + (traffic.get("replica_all_gather", 0) + traffic.get("replica_reduce_scatter", 0) / R)
                                * (R - 1), R, group, links),
        "dense": ring_seconds(traffic["dense_all_reduce"] * 2 * (world - 1) / world
                              + traffic["fsdp_gathers"] * (world - 1), world, 1, links),
    }
    seconds["total"] = sum(seconds.values())
    return {"world": world, "group_size": group, "replicas": R, "strategy": strategy if R > 1 else "1d",
            "sharding": sharding, "memory": memory, "traffic": traffic, "seconds": seconds}


@dataclass(frozen=True)
class Profile:
    """One GPU's step, measured (``--profile RUN``) or stated (``--step-s``, ``--mfu``): its time, the model FLOPs
    and samples of that step, the peak FLOP/s of the device (MFU's denominator) and where the numbers came from."""

    step_s: float
    flops: float
    batch: float
    peak_flops: float
    source: str

    def __post_init__(self):
        for name in ("step_s", "flops", "batch", "peak_flops"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"the one-GPU profile's {name} must be a positive number, got {value!r} "
                                  f"(from {self.source})")

    @property
    def mfu(self) -> float:
        return self.flops / self.step_s / self.peak_flops


def _json_lines(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill: the rest of the file still counts
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def profile_from_run(folder: str | Path, peak_tflops: float | None = None) -> tuple[Profile, str]:
    """The one-GPU profile of a ``gemzoo train`` run folder and the path of its config.toml: the mean step time
    and model FLOPs a step of its steps after warm-up (the last ``end`` event's ``mean_step_s`` and
    ``mean_tflops``; without one, those of its metrics rows after the first), its batch (``data.batch_size``)
    and the peak its MFU was measured against (``peak_tflops`` overrides it)."""
    run = Path(folder)
    metrics, config = run / "metrics.jsonl", run / "config.toml"
    if not metrics.is_file() or not config.is_file():
        raise ConfigError(f"--profile {folder}: not a run folder of gemzoo train (it needs metrics.jsonl and "
                          "config.toml); give the --out folder of a one-GPU run, e.g. runs/gem-bench")
    rows = _json_lines(metrics)
    start = next((r for r in reversed(rows) if r.get("event") in ("start", "resume")), {})
    if int(start.get("world_size", 1)) != 1:
        raise ConfigError(f"--profile {folder}: that run had {start['world_size']} ranks, so its step time holds "
                          "their communication already; profile a one-process run (gemzoo train, no torchrun)")
    end = next((r for r in reversed(rows) if r.get("event") == "end" and r.get("mean_tflops")), None)
    if end is not None and (end.get("mean_step_s") or end.get("mean_samples_per_s")):
        from gemzoo.api import load_config

        batch = float(load_config(str(config)).data.batch_size)
        step_s = end.get("mean_step_s") or batch / end["mean_samples_per_s"]
        flops = end["mean_tflops"] * 1e12 * step_s
        how = f"mean of {end.get('measured_steps', '?')} steps after {end.get('warmup_steps', '?')} warm-up"
    else:
        steps = [r for r in rows if "event" not in r and r.get("step_s") and r.get("tflops")]
        steps = steps[1:] or steps  # the first row holds the warm-up (compiles, first allocations)
        if not steps:
            raise ConfigError(f"--profile {folder}: metrics.jsonl has no step rows with step_s and tflops yet; "
                              "let the run log a few rows (run.log_every) first")
        from gemzoo.api import load_config

        batch = float(load_config(str(config)).data.batch_size)
        step_s = sum(r["step_s"] for r in steps) / len(steps)
        flops = sum(r["tflops"] * 1e12 * r["step_s"] for r in steps) / len(steps)
        how = f"mean of {len(steps)} metrics rows"
    peak = peak_tflops * 1e12 if peak_tflops else float(start.get("peak_flops") or 0)
    if peak <= 0:
        raise ConfigError(f"--profile {folder}: its start event names no peak_flops; give --peak-tflops")
    return Profile(step_s, flops, batch, peak, f"{run} ({how})"), str(config)


def stated_profile(desc: dict, *, step_s: float | None, mfu: float | None, peak_tflops: float | None) -> Profile:
    """A one-GPU step from ``--step-s`` or ``--mfu`` (and ``--peak-tflops``) and the config's model FLOPs, at the
    plan's batch a rank."""
    if peak_tflops is None or not peak_tflops > 0:
        raise ConfigError("--step-s and --mfu need --peak-tflops (the device's dense peak, e.g. 989 for an H100 or "
                          "H200 in bf16), or set run.peak_tflops in the config")
    if (step_s is None) == (mfu is None):
        raise ConfigError("give one of --step-s (the measured one-GPU step) and --mfu (an assumed one-GPU MFU)")
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError(f"--mfu is a fraction in (0, 1], e.g. 0.42, got {mfu!r}")
    batch = desc["batch_per_rank"]
    flops = desc["flops_per_sample"] * batch
    peak = peak_tflops * 1e12
    if step_s is None:
        return Profile(flops / (mfu * peak), flops, batch, peak, f"--mfu {mfu:g} of {peak_tflops:g} TFLOP/s")
    return Profile(step_s, flops, batch, peak, f"--step-s {step_s:g}")


def step_time(layout: dict, profile: Profile, batch: float, overlap: float) -> dict:
    """Step time, throughput and MFU of one layout at its world: the one-GPU step scaled to ``batch`` samples (the
    compute: a rank's own forward and backward, which do not depend on the world), plus the layout's
    communication time, of which the fraction ``overlap`` hides behind the compute (never more than all of it)."""
    if not 0 <= overlap <= 1:
        raise ConfigError(f"--overlap is the fraction of communication hidden behind compute, in [0, 1]; "
                          f"got {overlap!r}")
    compute = profile.step_s * batch / profile.batch
    flops = profile.flops * batch / profile.batch
    comm = layout["seconds"]["total"]
    hidden = min(overlap * comm, compute)
    step = compute + comm - hidden
    return {"compute_s": compute, "comm_s": comm, "exposed_comm_s": comm - hidden, "step_s": step,
            "samples_per_s": layout["world"] * batch / step, "tflops_per_gpu": flops / step / 1e12,
            "mfu": flops / step / profile.peak_flops, "scaling_efficiency": compute / step}


def group_for(world: int, group: int) -> int:
    """The group size used at ``world``: ``group``, or the whole world when it is smaller and divides ``group``
    (``--world 1,8,64`` with groups of 8)."""
    if world < 1 or group < 1:
        raise ConfigError(f"--world and --group are positive rank counts, got {world} and {group}")
    if world % group == 0:
        return group
    if group % world == 0:
        return world
    raise ConfigError(f"--group {group} does not divide --world {world}: world = group x replicas")


def plan_report(cfg, world: int, group: int, hbm: float, links: Links = Links(), *, strategies=("replicated",
                "fully_sharded"), sharding: str = "row_wise", replica_sync: str = "gradients", sync_every: int = 1,
                batch_per_rank: float | None = None, desc: dict | None = None, profile: Profile | None = None,
                overlap: float = 0.0) -> dict:
    if world < 1 or group < 1 or world % group:
        raise ConfigError(f"--group {group} does not divide --world {world}: world = group x replicas")
    desc = desc or describe_config(cfg, batch_per_rank)
    rows = {"1d": layout_estimate(desc, world, world, "replicated", links, sharding=sharding)}
    for s in strategies:
        rows[f"2d-{s}"] = layout_estimate(desc, world, group, s, links, sharding=sharding,
                                          replica_sync=replica_sync, sync_every=sync_every)
    for r in rows.values():
        r["fits_hbm"] = r["memory"]["total"] <= hbm
        if profile is not None:
            r["step"] = step_time(r, profile, desc["batch_per_rank"], overlap)
    public = {k: v for k, v in desc.items() if k != "tables"}
    public["table_bytes"] = sum(t.num_embeddings * t.embedding_dim * 4 for t in desc["tables"])
    out = {"world": world, "group": group, "hbm": hbm, "links": links.__dict__, "model": public, "layouts": rows}
    if profile is not None:
        out["profile"] = {**asdict(profile), "mfu": profile.mfu}
        out["overlap"] = overlap
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:,.3f} GB" if x >= 1e7 else f"{x / 1e6:,.3f} MB" if x >= 1e4 else f"{x:,.0f} B"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.3f} ms"


def _ms1(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def render(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:  # the tables are wide: at least 180 columns, more where the terminal has them
        console = Console()
        console = Console(width=max(console.width, 180))
    m, L = report["model"], report["links"]
    console.print(f"[bold]gemzoo plan[/]: world {report['world']}, groups of {report['group']}, "
                  f"{m['batch_per_rank']:g} samples a rank ({m['tokens_per_sample']:.0f} events, "
                  f"{len(m['features'])} sparse features), tables {_gb(m['table_bytes'])} fp32, "
                  f"{m['dense_params'] / 1e6:,.1f} M dense parameters; links: NVLink {L['nvlink_gbs']:g} GB/s within "
                  f"{L['gpus_per_node']} GPUs, {L['ib_gbs']:g} GB/s a GPU between nodes; HBM {_gb(report['hbm'])}")
    mem = Table(title="memory per rank")
    for c in ("layout", "G x R", "tables", "optimizer state", "dense (+grad, AdamW)", "activations (est.)",
              "gathered shard", "total", "fits HBM"):
        mem.add_column(c, justify="right" if c not in ("layout",) else "left")
    comm = Table(title="communication per rank per step (bytes handed to collectives; time at the link bandwidths)")
    for c in ("layout", "a2a ids", "a2a pooled fwd+bwd", "replica sync", "replica gather+scatter",
              "dense all-reduce", "FSDP gathers", "a2a time", "replica time", "dense time", "total time"):
        comm.add_column(c, justify="right" if c != "layout" else "left")
    for name, r in report["layouts"].items():
        mm, t, s = r["memory"], r["traffic"], r["seconds"]
        mem.add_row(name, f"{r['group_size']} x {r['replicas']}", _gb(mm["tables"]), _gb(mm["optimizer_state"]),
                    _gb(mm["dense"]), _gb(mm["activations"]), _gb(mm["gathered_group_shard"]), _gb(mm["total"]),
                    "yes" if r["fits_hbm"] else "[red]no[/]")
        comm.add_row(name, _gb(t.get("a2a_ids", 0)), _gb(t.get("a2a_pooled_fwd", 0) + t.get("a2a_pooled_bwd", 0)),
                     _gb(t.get("replica_sync", 0)),
                     _gb(t.get("replica_all_gather", 0) + t.get("replica_reduce_scatter", 0)),
                     _gb(t["dense_all_reduce"]), _gb(t["fsdp_gathers"]), _ms(s["a2a"]), _ms(s["replica"]),
                     _ms(s["dense"]), _ms(s["total"]))
    console.print(mem)
    console.print(comm)


def render_scaling(reports: list[dict], console=None, *, details: bool = False) -> None:
    """One row per world and layout: memory a rank, bytes and seconds of communication a step, and with a
    profile the step time, samples/s and MFU. Layouts that are 1D in disguise (one replica) are left out."""
    from rich.console import Console
    from rich.table import Table

    if console is None:  # as wide as the table: nothing cut
        console = Console()
        console = Console(width=max(console.width, 190))
    first = reports[0]
    timed = "profile" in first
    if not details:  # the header line `render` prints for one world
        m, L = first["model"], first["links"]
        console.print(f"[bold]gemzoo plan[/]: worlds {', '.join(str(r['world']) for r in reports)}, groups of "
                      f"{reports[-1]['group']}, {m['batch_per_rank']:g} samples a rank, tables "
                      f"{_gb(m['table_bytes'])} fp32, {m['dense_params'] / 1e6:,.1f} M dense parameters; links: NVLink "
                      f"{L['nvlink_gbs']:g} GB/s within {L['gpus_per_node']} GPUs, {L['ib_gbs']:g} GB/s between "
                      f"nodes; HBM {_gb(first['hbm'])}")
    if timed:
        p = first["profile"]
        console.print(f"one GPU: {p['step_s'] * 1e3:,.1f} ms a step of {p['batch']:g} samples, "
                      f"{p['flops'] / 1e12:,.3g} TFLOP (model), MFU {100 * p['mfu']:.1f}% of "
                      f"{p['peak_flops'] / 1e12:g} TFLOP/s, from {p['source']}; overlap {first['overlap']:g} of "
                      "the communication hidden behind compute")
    title = "step time and MFU by world" if timed else "memory and communication by world"
    table = Table(title=title)
    cols = ["world", "layout", "G x R", "memory a rank", "fits HBM", "comm bytes a rank", "comm time"]
    if timed:
        cols += ["compute", "exposed comm", "step", "samples/s (all)", "MFU", "vs 1 GPU"]
    for c in cols:
        table.add_column(c, justify="left" if c == "layout" else "right", no_wrap=c == "layout")
    for rep in reports:
        for name, r in rep["layouts"].items():
            if name != "1d" and r["replicas"] == 1:
                continue
            cells = [str(rep["world"]), name, f"{r['group_size']} x {r['replicas']}", _gb(r["memory"]["total"]),
                     "yes" if r["fits_hbm"] else "[red]no[/]", _gb(sum(r["traffic"].values())),
                     _ms1(r["seconds"]["total"])]
            if timed:
                st = r["step"]
                cells += [_ms1(st["compute_s"]), _ms1(st["exposed_comm_s"]), _ms1(st["step_s"]),
                          f"{st['samples_per_s']:,.0f}", f"{100 * st['mfu']:.1f}%",
                          f"{st['scaling_efficiency']:.2f}"]
            table.add_row(*cells)
    console.print(table)


def worlds(text: str) -> list[int]:
    """``--world 8,64,1024`` -> [8, 64, 1024] (argparse type)."""
    import argparse

    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give rank counts separated by commas, e.g. 8,64,1024")
    return values


def cmd_plan(args) -> int:
    from gemzoo.api import load_config

    if not 0 <= args.overlap <= 1:
        raise ConfigError(f"--overlap is the fraction of communication hidden behind compute, in [0, 1]; got "
                          f"{args.overlap!r}")
    profile, config = None, args.config
    if args.profile is not None:
        if args.step_s is not None or args.mfu is not None:
            raise ConfigError("--profile gives the one-GPU step; leave out --step-s and --mfu")
        profile, run_config = profile_from_run(args.profile, args.peak_tflops)
        config = config or run_config
    if config is None:
        raise ConfigError("give --config F (e.g. configs/gem-bench.toml) or --profile RUN (a run folder: its "
                          "config.toml and measured step)")
    cfg = load_config(config, overrides=list(args.set or []), plugins=args.plugins)
    timed = profile is not None or args.step_s is not None or args.mfu is not None
    desc = describe_config(cfg, args.batch_per_rank, flop_batches=args.flop_batches if timed else 0)
    if timed and profile is None:
        profile = stated_profile(desc, step_s=args.step_s, mfu=args.mfu,
                                 peak_tflops=args.peak_tflops or cfg.run.peak_tflops)
    links = Links(args.nvlink, args.ib, args.gpus_per_node)
    strategies = ("replicated", "fully_sharded") if args.strategy == "both" else (args.strategy,)
    hbm = parse_bytes(args.hbm)
    reports = [plan_report(cfg, w, group_for(w, args.group), hbm, links, strategies=strategies,
                           sharding=args.sharding, replica_sync=args.replica_sync, sync_every=args.sync_every,
                           desc=desc, profile=profile, overlap=args.overlap) for w in args.world]
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1))
    elif len(reports) == 1:
        render(reports[0])
        if profile is not None:
            render_scaling(reports, details=True)
    else:
        render_scaling(reports)
    return 0


PLAN_EXAMPLES = """examples:
  gemzoo plan --config configs/gem-bench.toml --world 4096 --group 64 --hbm 141GB
  gemzoo plan --config configs/gem-bench.toml --world 1,8,64,1024 --step-s 0.210 --peak-tflops 989 --overlap 0.5
  gemzoo plan --profile runs/gem-bench --world 8,64,1024 --group 8        # a one-GPU run's measured step
  gemzoo plan --config configs/gem-1b.toml --world 8,64,1024 --mfu 0.42 --peak-tflops 989   # not measured yet
  gemzoo plan --config configs/gem-tiny.toml --world 16 --group 4 --hbm 80GiB --json

With a one-GPU step (--profile, --step-s or --mfu) each world gets its step time, samples/s and MFU: the
one-GPU step scaled to the batch a rank, plus the layout's communication at the link bandwidths, less the
--overlap fraction of it hidden behind compute. World 1 gives the one-GPU step back. docs/scaling.md.
"""


def add_command(cli) -> None:
    import argparse

    p = cli.add_parser("plan", help="per-rank memory and per-step communication of 1D vs 2D embedding sharding "
                                    "at a target scale (no GPU)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=PLAN_EXAMPLES)
    p.add_argument("--config", help="a TOML config (its tables, model and data); default: --profile's config.toml")
    p.add_argument("--world", type=worlds, required=True, metavar="W[,W...]",
                   help="ranks (GPUs) in the target job, or several: 8,64,1024")
    p.add_argument("--group", type=int, default=8, help="G: ranks a sharding group (default 8, one node; a "
                   "smaller world that divides it is one group)")
    p.add_argument("--profile", metavar="RUN", help="a one-GPU gemzoo train run folder: its measured mean step "
                   "time and model FLOPs (metrics.jsonl) give step time and MFU at each world")
    p.add_argument("--step-s", type=float, help="the one-GPU step time in seconds at --batch-per-rank samples "
                   "(instead of --profile; needs --peak-tflops)")
    p.add_argument("--mfu", type=float, help="an assumed one-GPU MFU (0-1) for a config not measured yet: the step "
                   "is its model FLOPs over MFU x peak (needs --peak-tflops)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s, MFU's denominator (default: the "
                   "profile's, or the config's run.peak_tflops)")
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of the communication hidden behind "
                   "compute, 0-1 (default 0: all of it adds to the step)")
    p.add_argument("--flop-batches", type=int, default=4, help="batches of the dataset that average the model's "
                   "FLOPs a sample for --step-s/--mfu (default 4)")
    p.add_argument("--hbm", default="141GB", help="memory a GPU (default 141GB, an H200)")
    p.add_argument("--strategy", default="both", choices=("both", "replicated", "fully_sharded"))
    p.add_argument("--sharding", default="row_wise", choices=("row_wise", "table_wise", "column_wise"),
                   help="how tables are placed within a group (default row_wise)")
    p.add_argument("--replica-sync", default="gradients", choices=("gradients", "weights"))
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--batch-per-rank", type=float, default=None,
                   help="samples a rank a step (default: the config's data.batch_size, as on one GPU)")
    p.add_argument("--nvlink", type=float, default=450.0, help="GB/s a GPU within a node (default 450)")
    p.add_argument("--ib", type=float, default=50.0, help="GB/s a GPU between nodes (default 50)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--plugins", default=None, help="comma-separated plugins, as for train")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(func=cmd_plan)
