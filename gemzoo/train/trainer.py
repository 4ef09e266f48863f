"""The trainer. ``train(cfg)`` reads in assembly order (DESIGN.md), top to bottom:

 1. config (already validated)   2. distributed init + mesh   3. dataset, batching policy
 4. model on meta                5. attention kernel per site  6. precision policy
 7. planner (sparse), dense DP   8. memory policy, compile     9. optimizers
10. resume                      11. loop: step, metrics, eval, atomic checkpoints
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gemzoo import kinds, registry
from gemzoo.config import Config
from gemzoo.interfaces.models import host_view
from gemzoo.data.exchange import Lookahead
from gemzoo.distributed import (World, all_reduce_gradients, build_mesh, clip_grad_norm, init_distributed,
                                is_fsdp_shard, pick_device, shard_dense_blocks)
from gemzoo.distributed import state as dstate
from gemzoo.distributed.dense import dense_dims, tensor_parallel_plans
from gemzoo.distributed.comms_groups import comms_summary
from gemzoo.embedding import use_sparse_gradients
from gemzoo.errors import CheckpointError, ConfigError, PluginError, TrainingError
from gemzoo.attention import attention_sites, kernels_that_serve
from gemzoo.interfaces.batching import DataParallelGroup
from gemzoo.interfaces.memory import needs_compile, policy_report
from gemzoo.interfaces.models import transformer_blocks
from gemzoo.interfaces.planner import whole_parameters
from gemzoo.interfaces.planner import SparseOptimizer, Topology
from gemzoo.interfaces.precision import PrecisionConfig
from gemzoo.train import checkpoint as ckpt
from gemzoo.train import run_folder
from gemzoo.train.flops import peak_flops
from gemzoo.train.metrics import MetricsLog, last_step_row, peak_memory_bytes, reduce_across_ranks, step_metrics
from gemzoo.train.resume import check_resumable, config_changes, describe
from gemzoo.train.sparse_adagrad import SparseAdagrad
from gemzoo.train.tensorboard import maybe_tensorboard


class _DropFxTracingNotice(logging.Filter):
    """torchrec calls ``torch.fx.is_fx_tracing()``, which logs a notice about torch.export on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropFxTracingNotice())


@dataclass
class TrainResult:
    final_loss: float | None  # None when no step ran and none was logged (e.g. resuming a finished run)
    steps: int
    eval: dict[str, float] = field(default_factory=dict)
    out_dir: Path | None = None
    history: list[dict] = field(default_factory=list)
    is_main: bool = True  # rank 0 (the one that logs and prints)


@dataclass
class _Launched:
    """A step queued on the device: its loss and logs still tensors, its counts read on the host."""

    step: int
    loss: torch.Tensor
    logs: dict[str, Any]
    share: float
    sums: dict[str, float]


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT stopped the run after a step; a checkpoint of that step was written."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, out_dir: Path):
        self.signum, self.step, self.checkpoint, self.out_dir = signum, step, checkpoint, out_dir
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal_name} after step {step}; checkpoint "
                         f"{checkpoint or out_dir / 'checkpoints'} written; continue with --resume")


class StopSignals:
    """While active (main thread only), SIGTERM and SIGINT ask the loop to stop after the current step.

    A second Ctrl-C stops at once (KeyboardInterrupt). With several ranks the request is agreed on by an
    all-reduce every step, so every rank stops after the same step and writes the same checkpoint."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, world: World, device: torch.device):
        self.world, self.device = world, device
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        print(f"\ngemzoo: {signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
              "(Ctrl-C again stops at once, without one)", file=sys.stderr, flush=True)

    def requested(self) -> int | None:
        """The signal that asked to stop, agreed on by every rank; None to go on."""
        if self.world.world_size <= 1:
            return self.signum
        import torch.distributed as dist

        # on the CPU over gloo (World.host_group): agreed on without waiting for the GPU's queue
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world.host_group)
        return int(flag.item()) or None


def loss_terms(batch) -> int:
    """How many terms the model's loss is the mean of on ``batch``: gem's candidates, retrieval's positions with
    a target, else its samples. With several ranks each rank's loss is weighted by its share of the global count,
    so the update is that of the global batch's loss whatever the split (issue 16)."""
    n = getattr(batch, "num_candidates", None)
    targets = getattr(batch, "targets", None)
    if n is None and isinstance(targets, torch.Tensor):
        n = int((targets >= 0).sum())
    return int(batch.num_samples if n is None else n)


def compile_model(model: nn.Module, scope: str):
    """What the step calls under ``run.compile``. ``"blocks"`` (regional compilation, as torchtitan does) compiles
    each transformer block's forward in place and leaves the rest eager: the blocks run one code object, so
    they share one compiled graph and compile time does not grow with depth; module hooks (FSDP2's) stay
    outside the graph and state-dict names do not change. ``"model"``, or a model that declares no blocks,
    compiles the whole forward."""
    blocks = transformer_blocks(model) if scope == "blocks" else []
    if not blocks:
        return torch.compile(model)
    for block in blocks:
        block.forward = torch.compile(block.forward)
    return model


def configured(kind: str, name: str, cfg: Config):
    """Registry entry ``name``, configured with its [plugins.options.NAME] table if it has one."""
    obj = registry.get(kind, name)
    options = cfg.plugins.options.get(name)
    if options is not None:
        obj = obj.configure(options)
    return obj


def _site_matches(site_name: str, key: str) -> bool:
    from fnmatch import fnmatch

    return site_name == key or site_name.startswith(key + ".") or fnmatch(site_name, key)


def site_kernel(site_name: str, cfg: Config) -> str:
    """The kernel [plugins.attention_sites] gives ``site_name`` (key: the site's name, a dotted prefix of
    it such as ``cross`` for ``cross.attn``, or an fnmatch pattern), else [plugins] attention."""
    for key, kernel in cfg.plugins.attention_sites.items():
        if _site_matches(site_name, key):
            return kernel
    return cfg.plugins.attention


def select_attention(model: nn.Module, cfg: Config, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Give every attention site its kernel ([plugins.attention_sites], else [plugins] attention); fail if
    the kernel lacks what a site needs."""
    sites = attention_sites(model)
    unmatched = [key for key in cfg.plugins.attention_sites
                 if not any(_site_matches(s, key) for s in sites)]
    if unmatched:
        raise ConfigError(f"[plugins.attention_sites] {', '.join(unmatched)} names no attention site of this model; "
                          f"its sites are {', '.join(sites) or '(none)'}")
    chosen = {}
    for site_name, site in sites.items():
        name = site_kernel(site_name, cfg)
        kernel = configured("attention", name, cfg)
        req = site.request.replace(dtype=dtype, device=device.type, backward=True)
        missing = kernel.capabilities.missing(req)
        if missing:
            able = kernels_that_serve(req)
            raise PluginError(
                f"attention kernel {name!r} cannot serve {site_name}: it lacks {', '.join(missing)}. "
                f"Kernels that can: {', '.join(able) or '(none)'}. Choose one for this site with "
                f'[plugins.attention_sites] {site_name.split(".")[0]} = "<kernel>" (or --set '
                f'plugins.attention_sites.{site_name.split(".")[0]}=<kernel>).'
            )
        site.set_kernel(name, kernel)
        chosen[site_name] = name
    return chosen


def attention_dtype(precision) -> torch.dtype:
    """The dtype attention runs in under a precision policy."""
    compute_dtype = precision.capabilities.compute_dtype
    return compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.float32


def build_on_meta(cfg: Config) -> nn.Module:
    """Assembly steps 3-6 with no weights and no training: the dataset, the model on ``meta``, an attention
    kernel per site and the precision policy. ``gemzoo config validate`` runs it, so what ``train``
    would reject there (heads that do not divide d_model, batch_size 0, a missing data file, a kernel
    without a capability a site needs, a run.mesh tp that does not divide the heads) is reported without
    training."""
    device = pick_device(cfg.run.device, World())
    dataset = registry.get("dataset", cfg.data.source).build(cfg.data, cfg.run.seed)
    with torch.device("meta"):
        model = registry.get("model", cfg.model.family).build(cfg.model, dataset.info)
    precision = configured("precision", cfg.plugins.precision, cfg)
    select_attention(model, cfg, device, attention_dtype(precision))
    model = precision.apply(model, PrecisionConfig(keep=list(cfg.precision.keep)))
    if cfg.run.mesh.get("tp", 1) > 1:
        tensor_parallel_plans(model, cfg.run.mesh["tp"])
    return model


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, sparse): the pooled tables under ``model.sparse_arch`` train with the sparse optimizer;
    everything else, item and position embeddings of the dense towers included, with AdamW."""
    sparse_arch = getattr(model, "sparse_arch", None)
    sparse_ids = {id(p) for p in sparse_arch.parameters()} if sparse_arch is not None else set()
    dense, sparse = [], []
    for p in model.parameters():
        if p.requires_grad:
            (sparse if id(p) in sparse_ids else dense).append(p)
    return dense, sparse


def build_optimizers(model: nn.Module, cfg: Config, replicated: list[nn.Parameter] | None = None
                     ) -> dict[str, torch.optim.Optimizer]:
    """AdamW for the dense parameters this rank updates (whole or FSDP2 shards), Adagrad for the whole tables.
    ``replicated``: the planner's ``replicated_parameters`` (default: every whole parameter); tables outside
    it are the planner's (sharded, their optimizer fused)."""
    whole = {id(p) for p in (whole_parameters(model) if replicated is None else replicated)}
    dense, sparse = split_parameters(model)
    sparse = [p for p in sparse if id(p) in whole]
    dense = [p for p in dense if id(p) in whole or is_fsdp_shard(p)]
    mixed = len({type(p.data) for p in dense}) > 1  # FSDP2 DTensors beside plain tensors: no foreach
    betas = tuple(cfg.optim.betas)
    if len(betas) != 2 or not all(isinstance(x, (int, float)) and 0.0 <= x < 1.0 for x in betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1) (AdamW's beta1, beta2), got {cfg.optim.betas!r}")
    # plain CUDA tensors: the fused kernel (one launch per dtype group, as torchtitan's default); FSDP2 DTensors
    # beside plain tensors: the per-tensor loop; otherwise torch's default (foreach)
    fused = bool(dense) and not mixed and all(p.device.type == "cuda" and type(p.data) is torch.Tensor for p in dense)
    impl = {"fused": True} if fused else {"foreach": False if mixed else None}
    opts = {"dense": torch.optim.AdamW(dense, lr=cfg.optim.lr, betas=betas, weight_decay=cfg.optim.weight_decay,
                                       **impl)}
    if sparse:
        # Row-wise Adagrad is what fbgemm's fused TBE uses for sparse tables; Adagrad here, whose sparse step on
        # a GPU never waits for the host (torch's coalesce is a sync per table), torch's own on the CPU.
        opts["sparse"] = SparseAdagrad(sparse, lr=cfg.optim.sparse_lr)
    return opts


def apply_optimizer_settings(optimizers: dict[str, torch.optim.Optimizer], cfg: Config) -> None:
    """Set the config's hyper-parameters on the param groups (after loading optimizer state on resume,
    which brings the checkpoint's back). ``base_lr`` is what warm-up scales each step."""
    settings = {"dense": {"lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay,
                          "betas": tuple(cfg.optim.betas)},
                "sparse": {"lr": cfg.optim.sparse_lr}}
    for name, opt in optimizers.items():
        for group in opt.param_groups:
            group.update(settings.get(name, {}))
            if "lr" in settings.get(name, {}):
                group["base_lr"] = group["lr"]


def lr_factor(step: int, cfg: Config) -> float:
    if cfg.optim.warmup_steps > 0 and step < cfg.optim.warmup_steps:
        return (step + 1) / cfg.optim.warmup_steps
    return 1.0


class Trainer:
    """Holds the assembled run; ``gemzoo_step_end`` hooks receive it."""

    def __init__(self, cfg: Config, *, resume: bool | str = False, out_dir: str | None = None,
                 progress: bool = True, overwrite: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.overwrite = overwrite
        self.out_dir = Path(out_dir or cfg.run.out_dir)
        self.progress = progress
        self.hook = registry.host().pm.hook
        self.resume_changes: list[tuple[str, Any, Any]] = []

    def say(self, message: str, *, err: bool = False) -> None:
        """Print on rank 0 only."""
        if self.world.is_main:
            print(message, file=sys.stderr if err else sys.stdout, flush=True)

    # ----------------------------------------------------------------------------------------
    def assemble(self) -> "Trainer":
        cfg = self.cfg
        # 1. Config: validated by load_config; plugins may look at it. One run folder holds one run.
        run_folder.check_run_folder(self.out_dir, resume=bool(self.resume), overwrite=self.overwrite)
        self.hook.gemzoo_configure(config=cfg)
        torch.manual_seed(cfg.run.seed)

        # 2. Distributed init through the comms backend; the DeviceMesh with the planner's dims (+ dense dp), and
        #    with run.mesh the dense (replicate, shard, tp) mesh of HSDP and tensor parallelism.
        self.comms = configured("comms", cfg.plugins.comms, cfg)
        self.planner = configured("planner", cfg.plugins.planner, cfg)
        device_type = "cuda" if cfg.run.device.startswith("cuda") or (
            cfg.run.device == "auto" and torch.cuda.is_available()) else "cpu"
        self.world: World = init_distributed(self.comms, device_type)
        self.topology = Topology(self.world.world_size, device_type)
        build_mesh(self.world, device_type, self.planner.mesh_dims(self.topology),
                   dense_dims(cfg.run.mesh, self.world.world_size), comms=self.comms)
        self.device = pick_device(cfg.run.device, self.world)
        self.peak, self.peak_source = peak_flops(self.device, cfg.run.peak_tflops)  # MFU's denominator, per device
        if self.world.is_main:
            if self.overwrite and run_folder.clear_run_folder(self.out_dir):
                print(f"--overwrite: deleted the previous run's files in {self.out_dir}", flush=True)
            ckpt.remove_stale_temporaries(self.out_dir / run_folder.CHECKPOINTS)
        if self.world.world_size > 1:
            import torch.distributed as dist

            dist.barrier()  # no rank looks at the run folder before rank 0 has cleaned it

        # 3. Dataset, batching policy.
        dspec = registry.get("dataset", cfg.data.source)
        self.dataset = dspec.build(cfg.data, cfg.run.seed)
        self.batching = configured("batching", cfg.plugins.batching, cfg)
        self.lookahead = Lookahead(self.batching, name=cfg.plugins.batching)

        # 4. Model, built on meta, then materialised and initialised deterministically.
        mspec = registry.get("model", cfg.model.family)
        with torch.device("meta"):
            model = mspec.build(cfg.model, self.dataset.info)
        model = model.to_empty(device=self.device)
        torch.manual_seed(cfg.run.seed)
        with torch.no_grad():
            model.init_weights()

        # 5. Attention kernel per site; 6. precision policy.
        self.precision = configured("precision", cfg.plugins.precision, cfg)
        self.attention_plan = select_attention(model, cfg, self.device, attention_dtype(self.precision))
        model = self.precision.apply(model, PrecisionConfig(keep=list(cfg.precision.keep)))

        # 7. Planner for embedding tables (its optimizer fused into the tables it shards); FSDP2 for transformer
        #    blocks (run.mesh: tensor parallelism over tp, then HSDP), the rest data-parallel.
        plan = self.planner.plan(model.embedding_tables(), self.topology)
        self.planner.attach_optimizer(model, plan, SparseOptimizer(lr=cfg.optim.sparse_lr))
        model = self.planner.shard(model, plan, self.world.mesh)
        model = shard_dense_blocks(model, self.world, cfg.run.dense_parallel)

        # 8. Memory policies, then torch.compile if asked (or if a policy works through it, e.g. auto-ac).
        self.memory = [configured("memory", name, cfg) for name in cfg.plugins.memory]
        compilers = [n for n, p in zip(cfg.plugins.memory, self.memory) if needs_compile(p)]
        if compilers and not cfg.run.compile:
            if self.world.is_main:
                print(f"memory policy {', '.join(compilers)} works through torch.compile: run.compile turned on")
            cfg.run.compile = True
        for policy in self.memory:
            model = policy.apply(model, cfg)
        self.model = model
        self.forward = compile_model(model, cfg.run.compile_scope) if cfg.run.compile else model
        self.hook.gemzoo_model_built(model=model, config=cfg)

        # 9. Optimizers: sparse tables and dense AdamW. Unsharded plain-torch tables get sparse gradients,
        #    which the tables' Adagrad applies row by row.
        #    The planner says which parameters every rank holds a full copy of: their gradients are averaged
        #    over dp each step; the rest are FSDP2 shards or the planner's own tables.
        self.replicated_params = self.planner.replicated_parameters(model)
        self.optimizers = build_optimizers(model, cfg, self.replicated_params)
        if getattr(model, "sparse_arch", None) is not None:
            use_sparse_gradients(model.sparse_arch)
        whole = {id(p) for p in self.replicated_params}
        self.dense_params = [p for p in split_parameters(model)[0] if id(p) in whole or is_fsdp_shard(p)]

        # 10. Resume.
        self.start_step = 0
        if self.resume:
            self._resume()
        return self

    def _resume(self) -> None:
        root = self.out_dir / run_folder.CHECKPOINTS
        explicit = isinstance(self.resume, str)
        if explicit:
            state = ckpt.load_resume_path(self.resume)
        else:
            state = ckpt.load_latest(root)
            if state is None:
                self.say(f"no checkpoint under {root}; starting from step 0")
                return
        step = int(state["manifest"]["step"])
        saved_cfg = state["manifest"].get("config")
        if saved_cfg is None:
            self.say(f"warning: {state['path']} records no config; cannot check that it fits this one", err=True)
        else:
            self.resume_changes = check_resumable(saved_cfg, self.cfg.to_dict(), str(state["path"]))
        if step > self.cfg.run.steps:
            raise ConfigError(f"run.steps is {self.cfg.run.steps} but {state['path']} is at step {step}; "
                              f"pass --steps N with N >= {step}")
        later = [p for p in ckpt.list_checkpoints(root) if ckpt.checkpoint_step(p) > step]
        picked_here = "skipped" in state and Path(state["path"]).parent.resolve() == root.resolve()
        if later and not picked_here:
            raise CheckpointError(
                f"{self.out_dir} holds checkpoints after step {step} ({', '.join(p.name for p in later[:3])}); "
                f"continuing from {state['path']} in it would mix two histories. Continue in a new run folder "
                "(--out DIR), or delete the later checkpoints first.")
        mismatched = dstate.shape_mismatches(self.model, state["model"])
        if mismatched:
            raise CheckpointError(_shape_message(state, mismatched, saved_cfg, self.cfg.to_dict()))
        missing, unexpected = dstate.load_full_state(self.model, state["model"])
        if missing or unexpected:
            raise CheckpointError(
                f"{state['path']} does not match this model: missing {missing[:5]}, unexpected {unexpected[:5]}. "
                "Was it written with another [model] config?"
            )
        for name, opt in self.optimizers.items():
            if name not in state["optimizers"]:
                raise CheckpointError(f"{state['path']} has no state for optimizer {name!r}")
            opt.load_state_dict(state["optimizers"][name])
            dstate.redistribute_optimizer_state(opt)
        apply_optimizer_settings(self.optimizers, self.cfg)  # the config's lr etc., not the checkpoint's
        missing = self.planner.load_state_dict(self.model, state["planner"])
        if missing:
            self.say(f"warning: {state['path']} has no planner state for {len(missing)} entries (e.g. {missing[0]}) "
                     f"of planner {self.cfg.plugins.planner!r}; they restart from zero (e.g. the sharded tables' "
                     "Adagrad accumulators)", err=True)
        ckpt.set_rng_state(state["rng"])
        self.start_step = step
        if self.world.is_main:
            # What the folder holds after `step` is superseded: unusable newer checkpoints (skipped above) are
            # set aside so checkpoint.keep cannot delete the new ones, and later metrics rows are dropped.
            for path in later:
                aside = path.with_name(path.name + ".unusable")
                shutil.rmtree(aside, ignore_errors=True)
                path.rename(aside)
            dropped = run_folder.trim_metrics(self.out_dir / run_folder.METRICS, step)
        changed = f"; changed since the checkpoint: {describe(self.resume_changes)}" if self.resume_changes else ""
        self.say(f"resumed from {state['path']} at step {step}{changed}")
        if self.world.is_main and (later or dropped):
            self.say(f"  superseded after step {step}: {len(later)} unusable checkpoint(s) renamed *.unusable, "
                     f"{dropped} row(s) of {run_folder.METRICS} dropped")

    # ----------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        """One step, waited for: its metrics (``run.sync = "step"``'s unit; ``fit`` may queue several)."""
        t0 = self._mark()
        launched = self.launch_step(step)
        self._wait()
        return self.finish_steps([launched], time.perf_counter() - t0)[0]

    def _reduce_host(self, values: dict[str, float], op: str) -> dict[str, float]:
        """Numbers the host holds, reduced over every rank without waiting for the device (World.host_group)."""
        return reduce_across_ranks(values, op, torch.device("cpu"), self.world.host_group)

    def _mark(self) -> float:
        """The start of a timed stretch: the device's queue drained, the clock read."""
        self._wait()
        return time.perf_counter()

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def launch_step(self, step: int) -> "_Launched":
        """Queue one step's work (load, forward, backward, optimizers) without waiting for the device: nothing
        here reads a device value on one rank (the loss and logs stay tensors), so the host may run ahead.
        ``finish_steps`` reads them. The step's time runs from the previous step's end to its end, loading this
        rank's samples included, as MFU's definition asks (the next part is built on a host thread meanwhile)."""
        cfg = self.cfg
        # This rank loads its own part of the global batch; the batching policy, given the model's per-sample
        # costs and the data-parallel group, returns the samples this rank trains. A policy with overlap = True
        # gets the next step's partition computed in a worker (thread or process) while this step trains
        # (collectives stay here; the samples are the same as without: gemzoo.data.exchange.Lookahead).
        dp_mesh = self.world.dp_mesh
        dp = DataParallelGroup() if dp_mesh is None else DataParallelGroup(
            dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group(), host=self.world.dp_host)
        batch = self.lookahead.batch(self.dataset, step, dp, self.device,
                                     lambda part: self.model.cost_model(part),  # looked up only with >1 rank
                                     next_step=step + 1 if step + 1 < cfg.run.steps else None,
                                     last_step=cfg.run.steps - 1)
        # The loss is the global batch's: sum-then-divide by the global count of loss terms. Gradients are
        # averaged over ranks, so rank r scales its mean loss by world * terms_r / terms (1.0 for even splits).
        world = self.world.world_size
        share = 1.0
        if world > 1:
            terms = loss_terms(host_view(batch))  # retrieval counts its targets: from the host copy
            got = self._reduce_host({"terms": terms, "empty": float(terms == 0)}, "sum")
            total = got["terms"]
            if got["empty"]:  # every rank raises, none waits in a collective
                raise TrainingError(f"{int(got['empty'])} of {world} ranks have no loss terms to train at step "
                                    f"{step} (the global batch has {int(total)}); raise data.batch_size to at least "
                                    f"{world}, or use a batching policy that gives every rank samples")
            share = world * terms / total
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                group.setdefault("base_lr", group["lr"])
                group["lr"] = group["base_lr"] * lr_factor(step, cfg)
        self.model.train()
        contexts = [p.step_context() for p in self.memory]
        for c in contexts:
            c.__enter__()
        try:
            out = self.forward(batch)
            loss = out.loss  # checked once the step is done: a check here would wait for the forward
            (loss if share == 1.0 else loss * share).backward()
        finally:
            for c in reversed(contexts):
                c.__exit__(None, None, None)
        all_reduce_gradients(self.replicated_params, self.world)
        if cfg.optim.grad_clip > 0:
            clip_grad_norm(self.dense_params, cfg.optim.grad_clip)
        for opt in self.optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.planner.sync(self.model, step)  # e.g. replica groups of 2D sharding average their tables
        after = getattr(self.precision, "after_optimizer_step", None)
        if after is not None:
            after(self.model)
        # what the step's numbers need, read from the host copy of the batch (no device sync)
        host = host_view(batch)
        sums = {"samples": batch.num_samples, "tokens": host.num_tokens, "flops": self.model.flops(host)}
        return _Launched(step, loss.detach(), {k: v.detach() if isinstance(v, torch.Tensor) else v
                                               for k, v in out.logs.items()}, share, sums)

    def finish_steps(self, launched: "list[_Launched]", seconds: float) -> list[dict[str, float]]:
        """The metrics of steps queued by ``launch_step`` once the device has run them; ``seconds``: each
        step's time (the stretch's mean when several were queued). Raises at the first non-finite loss.

        Several ranks: the loss (and the model's logs) is the global batch's, each rank's weighted by its share
        of the loss terms, the objective the averaged gradients descend; throughput counts every rank's
        samples, tokens and FLOPs over the slowest rank's time; MFU is against the peak of all devices; memory
        is the largest rank's."""
        cfg, world = self.cfg, self.world.world_size
        # one read for every queued value
        values = [torch.as_tensor(v).detach().reshape(()).to("cpu", torch.float64)
                  for s in launched for v in (s.loss, *s.logs.values())]
        flat = iter(torch.stack(values).tolist() if values else [])
        results = []
        for s in launched:
            means = {"loss": next(flat), **{f"train/{k}": next(flat) for k in s.logs}}
            means = {k: v * s.share for k, v in means.items()}  # weighted by the rank's share of the loss terms
            sums = dict(s.sums)
            # the ranks of a tensor-parallel group train the same samples: each counts 1/copies of them
            if self.world.copies > 1:
                sums = {k: v / self.world.copies for k, v in sums.items()}
            maxes = {"seconds": seconds, "peak_mem_bytes": peak_memory_bytes(self.device)}
            if world > 1:
                means = {k: v / world for k, v in self._reduce_host(means, "sum").items()}
                sums = self._reduce_host(sums, "sum")
                maxes = self._reduce_host(maxes, "max")
            if not math.isfinite(means["loss"]):  # the global loss, so every rank stops here together
                raise TrainingError(
                    f"loss is {means['loss']} at step {s.step}. Lower optim.lr (now {cfg.optim.lr}), set "
                    f"optim.grad_clip, or try precision = \"fp32\"; checkpoints in {self.out_dir / 'checkpoints'} "
                    "are untouched (resume with --resume).")
            metrics = step_metrics(loss=means.pop("loss"), seconds=maxes["seconds"], samples=int(sums["samples"]),
                                   tokens=int(sums["tokens"]), flops=sums["flops"], peak_flops=self.peak * world,
                                   device=self.device, peak_mem_bytes=maxes["peak_mem_bytes"])
            metrics.update(means)
            results.append(metrics)
        return results

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        evaluator = self.model.evaluator()
        for batch in self.dataset.eval_batches(self.cfg.eval.batches):
            evaluator.update(batch.to(self.device))
        self.model.train()
        return {f"eval/{k}": float(v) for k, v in evaluator.compute().items()}

    def save(self, step: int) -> Path | None:
        # Whole tensors on rank 0, whatever the layout (collectives: every rank takes part).
        model_state = dstate.gather_full_state(self.model.state_dict(), self.world.is_main,
                                               dstate.rank_row_names(self.model))
        planner_state = self.planner.state_dict(self.model)
        optimizer_states = {n: dstate.gather_optimizer_state(o.state_dict(), dstate.optimizer_rank_rows(o))
                            for n, o in self.optimizers.items()}
        if not self.world.is_main:
            return None
        plugins = {e.name: {"kind": e.kind, "distribution": e.distribution, "version": e.version}
                   for e in registry.entries() if e.name in self._selected_names()}
        manifest = {"config": self.cfg.to_dict(), "plugins": plugins, "torch": torch.__version__}
        return ckpt.save_checkpoint(
            self.out_dir / "checkpoints", step,
            model_state=model_state,
            optimizers=optimizer_states, planner_state=planner_state,
            manifest=manifest, keep=self.cfg.checkpoint.keep,
        )

    def memory_reports(self) -> dict[str, dict]:
        """What each memory policy reports it did (bytes saved per step, chosen budget, ...); {} entries dropped."""
        reports = {n: policy_report(p) for n, p in zip(self.cfg.plugins.memory, self.memory)}
        return {n: r for n, r in reports.items() if r}

    def log_memory_reports(self, log: MetricsLog | None) -> None:
        reports = self.memory_reports()
        if not reports or not self.world.is_main:
            return
        if log:
            log.write({"event": "memory", **reports})
        for name, r in reports.items():
            summary = r.get("summary")
            if summary:
                print(f"{name}: {summary}", flush=True)

    def _selected_names(self) -> set[str]:
        return {name for names in kinds.selected(self.cfg.plugins).values() for name in names}

    # ----------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg = self.cfg
        # 11. Loop: step; metrics; eval; atomic checkpoint.
        peak_source = self.peak_source
        main = self.world.is_main
        metrics_path = self.out_dir / run_folder.METRICS
        log = MetricsLog(metrics_path, append=self.start_step > 0) if main else None
        log = maybe_tensorboard(log, cfg, self.out_dir, self.start_step)  # run.tensorboard: rows as scalars too
        if log:
            mesh = self.world.mesh
            log.write({"event": "resume" if self.start_step > 0 else "start", "step": self.start_step,
                       "device": str(self.device), "world_size": self.world.world_size,
                       "mesh": None if mesh is None else {"shape": list(mesh.mesh.shape),
                                                          "dims": list(mesh.mesh_dim_names or ())},
                       **({} if self.world.dense_mesh is None else {"dense_mesh": {
                           "shape": list(self.world.dense_mesh.mesh.shape),
                           "dims": list(self.world.dense_mesh.mesh_dim_names)}}),
                       "peak_flops": self.peak, "mfu_peak": peak_source, "attention": cfg.plugins.attention,
                       "precision": cfg.plugins.precision, "memory": cfg.plugins.memory,
                       "comms": comms_summary(cfg.plugins.comms, self.comms, mesh),
                       **({"changed": {k: [o, n] for k, o, n in self.resume_changes}} if self.resume_changes else {})})
        if self.start_step >= cfg.run.steps:
            return self._already_done(log, metrics_path)
        history, last_eval, loss = [], {}, math.nan
        show = self.progress and main
        lines = show and not sys.stdout.isatty()  # batch jobs: a plain line every run.log_every steps
        progress = _progress(show and not lines)
        t_start = time.perf_counter()
        with progress, StopSignals(self.world, self.device) as stop, self.lookahead:
            task = progress.add_task(cfg.run.name, total=cfg.run.steps, completed=self.start_step, info="")
            # Steps are queued (launch_step) and read together (finish_steps) at each *point*: every step with
            # run.sync = "step"; with "log" only steps that write a row, evaluate, checkpoint, end the run or stop.
            queued, t_mark = [], self._mark()
            for step in range(self.start_step, cfg.run.steps):
                queued.append(self.launch_step(step))
                done = step + 1
                last = done == cfg.run.steps
                evaluated = cfg.eval.every > 0 and (done % cfg.eval.every == 0 or last)
                logged = done % cfg.run.log_every == 0 or last
                checkpointed = cfg.checkpoint.every > 0 and (done % cfg.checkpoint.every == 0 or last)
                signum = None if cfg.run.sync == "step" else stop.requested()  # a stop request makes a point
                if not (cfg.run.sync == "step" or logged or evaluated or checkpointed or last or signum):
                    continue
                self._wait()
                seconds = (time.perf_counter() - t_mark) / len(queued)
                for s, metrics in zip(queued, self.finish_steps(queued, seconds)):
                    at = s.step + 1
                    loss = metrics["loss"]
                    if at == done and evaluated:
                        last_eval = self.evaluate()
                        metrics.update(last_eval)
                    record = {"step": at, **metrics, "mfu_peak": peak_source}
                    history.append(record)
                    if at == done and log and (logged or evaluated):
                        log.write(record)
                    if at == done and lines and (logged or evaluated):
                        eta = (time.perf_counter() - t_start) / (done - self.start_step) * (cfg.run.steps - done)
                        print(log_line(done, cfg.run.steps, metrics, eta), flush=True)
                    self.hook.gemzoo_step_end(trainer=self, step=at, metrics=metrics)
                queued = []
                saved = self.save(done) if checkpointed else None
                progress.update(task, completed=done, info=_short(metrics))
                signum = signum or stop.requested()  # one asked for meanwhile (by a step-end hook, say)
                if signum and done < cfg.run.steps:
                    if saved is None:
                        saved = self.save(done)
                    if log:
                        log.write({"event": "interrupted", "step": done, "signal": signal.Signals(signum).name})
                        log.close()
                    raise TrainingInterrupted(signum, done, saved, self.out_dir)
                t_mark = self._mark()
        self.log_memory_reports(log)
        if log:
            log.write({"event": "end", "step": cfg.run.steps, "final_loss": loss, **last_eval})
            log.close()
        return TrainResult(loss, cfg.run.steps, last_eval, self.out_dir, history, main)

    def _already_done(self, log: MetricsLog | None, metrics_path: Path) -> TrainResult:
        """Resuming a run that has reached run.steps: nothing to train; report its last logged numbers."""
        steps = self.cfg.run.steps
        self.say(f"nothing to train: the run in {self.out_dir} is at step {self.start_step} and run.steps is "
                 f"{steps}; pass --steps N (N > {self.start_step}) to train further")
        row = last_step_row(metrics_path, self.start_step) if self.world.is_main else None
        evals = {k: v for k, v in (row or {}).items() if k.startswith("eval/")}
        loss = row.get("loss") if row else None
        if log:
            log.write({"event": "end", "step": steps, "final_loss": loss, **evals})
            log.close()
        return TrainResult(loss, steps, evals, self.out_dir, [], self.world.is_main)


def _shape_message(state: dict, mismatched: list, saved_cfg: dict | None, current_cfg: dict) -> str:
    """CheckpointError text: each tensor with both shapes, and the config keys that may explain it."""
    tensors = "; ".join(f"{name} is {list(saved)} in the checkpoint but {list(own)} in this model"
                        for name, saved, own in mismatched[:5])
    if saved_cfg is None:
        keys = "the checkpoint records no config to compare with"
    else:
        changed = [c for c in sum(config_changes(saved_cfg, current_cfg), [])
                   if c[0].startswith(("model.", "data."))]
        keys = (f"config keys that differ: {describe(changed)}" if changed else
                "the [model] and [data] keys agree, so a size that comes from the data (e.g. the file in "
                "data.path) or from the model's code has changed")
    return (f"{state['path']} does not fit this model: {tensors} ({keys}). Resume with the config the checkpoint "
            "was written with, or start a new run (--out DIR).")


def _short(m: dict) -> str:
    parts = [f"loss {m['loss']:.4f}", f"{m['samples_per_s']:.0f} samples/s", f"MFU {100 * m['mfu']:.1f}%"]
    parts += [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items() if k.startswith("eval/")][:3]
    return " | ".join(parts)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def log_line(step: int, steps: int, m: dict, eta_s: float) -> str:
    """One plain line for logs that are not a terminal (torchtitan style)."""
    parts = [f"step {step:>{len(str(steps))}}/{steps}", f"loss {m['loss']:.4f}",
             f"samples/s {m['samples_per_s']:,.0f}", f"tokens/s {m['tokens_per_s']:,.0f}",
             f"tflops {m['tflops']:.3g}", f"mfu {100 * m['mfu']:.2f}%", f"mem {m['peak_mem_gib']:.2f} GiB",
             f"eta {_clock(eta_s)}"]
    parts += [f"{k} {v:.4f}" for k, v in m.items() if k.startswith("eval/")]
    return "  ".join(parts)


def _progress(enabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    disable=not enabled)


def train(cfg: Config, *, resume: bool | str = False, out_dir: str | None = None, progress: bool = True,
          overwrite: bool = False) -> TrainResult:
    return Trainer(cfg, resume=resume, out_dir=out_dir, progress=progress, overwrite=overwrite).assemble().fit()
