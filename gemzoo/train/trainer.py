"""The trainer. ``train(cfg)`` reads in assembly order (DESIGN.md), top to bottom:

 1. config (already validated)   2. distributed init + mesh   3. dataset, batching policy
 4. model on meta                5. attention kernel per site  6. precision policy
 7. planner (sparse), dense DP   8. memory policy, compile     9. optimizers
10. resume                      11. loop: step, metrics, eval, atomic checkpoints
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gemzoo import registry
from gemzoo.config import Config
from gemzoo.distributed import (World, all_reduce_gradients, clip_grad_norm, init_distributed, pick_device,
                                shard_dense_blocks)
from gemzoo.embedding import use_sparse_gradients
from gemzoo.errors import CheckpointError, PluginError, TrainingError
from gemzoo.interfaces.planner import Topology
from gemzoo.interfaces.precision import PrecisionConfig
from gemzoo.models.common import attention_sites
from gemzoo.train import checkpoint as ckpt
from gemzoo.train.flops import peak_flops
from gemzoo.train.metrics import MetricsLog, step_metrics
from gemzoo.train.tensorboard import maybe_tensorboard


@dataclass
class TrainResult:
    final_loss: float
    steps: int
    eval: dict[str, float] = field(default_factory=dict)
    out_dir: Path | None = None
    history: list[dict] = field(default_factory=list)


def configured(kind: str, name: str, cfg: Config):
    """Registry entry ``name``, configured with its [plugins.options.NAME] table if it has one."""
    obj = registry.get(kind, name)
    options = cfg.plugins.options.get(name)
    if options is not None:
        obj = obj.configure(options)
    return obj


def select_attention(model: nn.Module, cfg: Config, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Give every attention site the configured kernel; fail if the kernel lacks what a site needs."""
    name = cfg.plugins.attention
    kernel = configured("attention", name, cfg)
    chosen = {}
    for site_name, site in attention_sites(model).items():
        req = site.request.replace(dtype=dtype, device=device.type, backward=True)
        missing = kernel.capabilities.missing(req)
        if missing:
            able = [n for n in registry.names("attention")
                    if not registry.get("attention", n).capabilities.missing(req)]
            raise PluginError(
                f"attention kernel {name!r} cannot serve {site_name}: it lacks {', '.join(missing)}. "
                f"Kernels that can: {', '.join(able) or '(none)'}."
            )
        site.set_kernel(name, kernel)
        chosen[site_name] = name
    return chosen


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


def fuse_sparse_optimizer(model: nn.Module, cfg: Config) -> None:
    """Ask torchrec to fuse row-wise Adagrad into the sharded tables' backward (fbgemm TBE)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": cfg.optim.sparse_lr})


def is_local_tensor(p: torch.Tensor) -> bool:
    """A plain tensor held whole by this rank (not a ShardedTensor/DTensor with a fused optimizer)."""
    return type(p.data) is torch.Tensor and not hasattr(p, "_in_backward_optimizers")


def is_fsdp_shard(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def build_optimizers(model: nn.Module, cfg: Config) -> dict[str, torch.optim.Optimizer]:
    dense, sparse = split_parameters(model)
    sparse = [p for p in sparse if is_local_tensor(p)]  # sharded ones carry a fused optimizer
    dense = [p for p in dense if is_local_tensor(p) or is_fsdp_shard(p)]
    mixed = len({type(p.data) for p in dense}) > 1  # FSDP2 DTensors beside plain tensors: no foreach
    opts = {"dense": torch.optim.AdamW(dense, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                       foreach=False if mixed else None)}
    if sparse:
        # Row-wise Adagrad is what fbgemm's fused TBE uses for sparse tables; torch's Adagrad here.
        opts["sparse"] = torch.optim.Adagrad(sparse, lr=cfg.optim.sparse_lr)
    return opts


def lr_factor(step: int, cfg: Config) -> float:
    if cfg.optim.warmup_steps > 0 and step < cfg.optim.warmup_steps:
        return (step + 1) / cfg.optim.warmup_steps
    return 1.0


class Trainer:
    """Holds the assembled run; ``gemzoo_step_end`` hooks receive it."""

    def __init__(self, cfg: Config, *, resume: bool | str = False, out_dir: str | None = None,
                 progress: bool = True):
        self.cfg = cfg
        self.resume = resume
        self.out_dir = Path(out_dir or cfg.run.out_dir)
        self.progress = progress
        self.hook = registry.host().pm.hook

    # ----------------------------------------------------------------------------------------
    def assemble(self) -> "Trainer":
        cfg = self.cfg
        # 1. Config: validated by load_config; plugins may look at it.
        self.hook.gemzoo_configure(config=cfg)
        torch.manual_seed(cfg.run.seed)

        # 2. Distributed init through the comms backend; DeviceMesh.
        self.comms = configured("comms", cfg.plugins.comms, cfg)
        device_type = "cuda" if cfg.run.device.startswith("cuda") or (
            cfg.run.device == "auto" and torch.cuda.is_available()) else "cpu"
        self.world: World = init_distributed(self.comms, device_type)
        self.device = pick_device(cfg.run.device, self.world)

        # 3. Dataset, batching policy.
        dspec = registry.get("dataset", cfg.data.source)
        self.dataset = dspec.build(cfg.data, cfg.run.seed)
        self.batching = configured("batching", cfg.plugins.batching, cfg)

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
        compute_dtype = self.precision.capabilities.compute_dtype
        attn_dtype = compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.float32
        self.attention_plan = select_attention(model, cfg, self.device, attn_dtype)
        model = self.precision.apply(model, PrecisionConfig(keep=list(cfg.precision.keep)))

        # 7. Planner for embedding tables; FSDP2 for transformer blocks, the rest data-parallel.
        self.planner = configured("planner", cfg.plugins.planner, cfg)
        topology = Topology(self.world.world_size, self.device.type)
        plan = self.planner.plan(model.embedding_tables(), topology)
        if plan is not None:
            fuse_sparse_optimizer(model, cfg)  # sharded tables update inside their own backward
        model = self.planner.shard(model, plan, self.world.mesh)
        model = shard_dense_blocks(model, self.world, cfg.run.dense_parallel)

        # 8. Memory policies, then torch.compile if asked.
        self.memory = [configured("memory", name, cfg) for name in cfg.plugins.memory]
        for policy in self.memory:
            model = policy.apply(model, cfg)
        self.model = model
        self.forward = torch.compile(model) if cfg.run.compile else model
        self.hook.gemzoo_model_built(model=model, config=cfg)

        # 9. Optimizers: sparse tables and dense AdamW. Unsharded plain-torch tables get sparse gradients,
        #    which the tables' Adagrad applies row by row.
        self.optimizers = build_optimizers(model, cfg)
        if getattr(model, "sparse_arch", None) is not None:
            use_sparse_gradients(model.sparse_arch)
        self.dense_params = [p for p in split_parameters(model)[0] if is_local_tensor(p) or is_fsdp_shard(p)]
        # Parameters every rank holds a full copy of (sharded tables excluded): averaged each step.
        self.replicated_params = [p for p in model.parameters() if p.requires_grad and is_local_tensor(p)]

        # 10. Resume.
        self.start_step = 0
        if self.resume:
            self._resume()
        return self

    def _resume(self) -> None:
        root = self.out_dir / "checkpoints"
        if isinstance(self.resume, str):
            state = ckpt.load_checkpoint(self.resume)
        else:
            state = ckpt.load_latest(root)
            if state is None:
                print(f"no checkpoint under {root}; starting from step 0")
                return
        missing, unexpected = ckpt.load_full_state(self.model, state["model"])
        if missing or unexpected:
            raise CheckpointError(
                f"{state['path']} does not match this model: missing {missing[:5]}, unexpected {unexpected[:5]}. "
                "Was it written with another [model] config?"
            )
        for name, opt in self.optimizers.items():
            if name not in state["optimizers"]:
                raise CheckpointError(f"{state['path']} has no state for optimizer {name!r}")
            opt.load_state_dict(state["optimizers"][name])
            ckpt.redistribute_optimizer_state(opt)
        missing = ckpt.load_fused_optimizer_state(self.model, state["fused_optimizer"])
        if missing:
            print(f"warning: {state['path']} has no state for the fused optimizers of {len(missing)} sharded "
                  f"tables (e.g. {missing[0]}); their Adagrad accumulators restart from zero")
        ckpt.set_rng_state(state["rng"])
        self.start_step = int(state["manifest"]["step"])
        print(f"resumed from {state['path']} at step {self.start_step}")

    # ----------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        batch = self.dataset.train_batch(step)
        if self.world.world_size > 1:
            groups = self.batching.assign(batch.lengths.float() ** 2, self.world.world_size)
            batch = batch.select(groups[self.world.rank])
        batch = batch.to(self.device)
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                group.setdefault("base_lr", group["lr"])
                group["lr"] = group["base_lr"] * lr_factor(step, cfg)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.model.train()
        contexts = [p.step_context() for p in self.memory]
        for c in contexts:
            c.__enter__()
        try:
            out = self.forward(batch)
            loss = out.loss
            if not torch.isfinite(loss):
                raise TrainingError(
                    f"loss is {loss.item()} at step {step}. Lower optim.lr (now {cfg.optim.lr}), set "
                    f"optim.grad_clip, or try precision = \"fp32\"; checkpoints in {self.out_dir / 'checkpoints'} "
                    "are untouched (resume with --resume)."
                )
            loss.backward()
        finally:
            for c in reversed(contexts):
                c.__exit__(None, None, None)
        all_reduce_gradients(self.replicated_params, self.world)
        if cfg.optim.grad_clip > 0:
            clip_grad_norm(self.dense_params, cfg.optim.grad_clip)
        for opt in self.optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        after = getattr(self.precision, "after_optimizer_step", None)
        if after is not None:
            after(self.model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        metrics = step_metrics(loss=float(loss.detach()), seconds=seconds, samples=batch.num_samples,
                               tokens=batch.num_tokens, flops=self.model.flops(batch),
                               peak_flops=self.peak, device=self.device)
        metrics.update({f"train/{k}": v for k, v in out.logs.items()})
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        evaluator = self.model.evaluator()
        for batch in self.dataset.eval_batches(self.cfg.eval.batches):
            evaluator.update(batch.to(self.device))
        self.model.train()
        return {f"eval/{k}": float(v) for k, v in evaluator.compute().items()}

    def save(self, step: int) -> Path | None:
        model_state = ckpt.gather_full_state(self.model.state_dict(), self.world.is_main)  # collective
        fused = ckpt.gather_fused_optimizer_state(self.model, self.world.is_main)  # collective
        optimizer_states = {n: ckpt.gather_optimizer_state(o.state_dict()) for n, o in self.optimizers.items()}
        if not self.world.is_main:
            return None
        plugins = {e.name: {"kind": e.kind, "distribution": e.distribution, "version": e.version}
                   for e in registry.entries() if e.name in self._selected_names()}
        manifest = {"config": self.cfg.to_dict(), "plugins": plugins, "torch": torch.__version__}
        return ckpt.save_checkpoint(
            self.out_dir / "checkpoints", step,
            model_state=model_state,
            optimizers=optimizer_states, fused_optimizer=fused,
            manifest=manifest, keep=self.cfg.checkpoint.keep,
        )

    def _selected_names(self) -> set[str]:
        p = self.cfg.plugins
        return {p.attention, p.precision, p.planner, p.comms, p.batching, *p.memory}

    # ----------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg = self.cfg
        # 11. Loop: step; metrics; eval; atomic checkpoint.
        self.peak, peak_source = peak_flops(self.device, cfg.run.peak_tflops)
        log = MetricsLog(self.out_dir / "metrics.jsonl", append=self.start_step > 0) if self.world.is_main else None
        log = maybe_tensorboard(log, cfg, self.out_dir, self.start_step)  # run.tensorboard: rows as scalars too
        if log:
            log.write({"event": "start", "step": self.start_step, "device": str(self.device),
                       "peak_flops": self.peak, "mfu_peak": peak_source, "attention": cfg.plugins.attention,
                       "precision": cfg.plugins.precision, "memory": cfg.plugins.memory})
        history, last_eval, loss = [], {}, math.nan
        progress = _progress(self.progress and self.world.is_main)
        with progress:
            task = progress.add_task(cfg.run.name, total=cfg.run.steps, completed=self.start_step, info="")
            for step in range(self.start_step, cfg.run.steps):
                metrics = self.train_step(step)
                loss = metrics["loss"]
                done = step + 1
                evaluated = cfg.eval.every > 0 and (done % cfg.eval.every == 0 or done == cfg.run.steps)
                if evaluated:
                    last_eval = self.evaluate()
                    metrics.update(last_eval)
                record = {"step": done, **metrics, "mfu_peak": peak_source}
                history.append(record)
                if log and (done % cfg.run.log_every == 0 or done == cfg.run.steps or evaluated):
                    log.write(record)
                self.hook.gemzoo_step_end(trainer=self, step=done, metrics=metrics)
                if cfg.checkpoint.every > 0 and (done % cfg.checkpoint.every == 0 or done == cfg.run.steps):
                    self.save(done)
                progress.update(task, completed=done, info=_short(metrics))
        if log:
            log.write({"event": "end", "step": cfg.run.steps, "final_loss": loss, **last_eval})
            log.close()
        return TrainResult(loss, cfg.run.steps, last_eval, self.out_dir, history)


def _short(m: dict) -> str:
    parts = [f"loss {m['loss']:.4f}", f"{m['samples_per_s']:.0f} samples/s", f"MFU {100 * m['mfu']:.1f}%"]
    parts += [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items() if k.startswith("eval/")][:3]
    return " | ".join(parts)


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[info]}"), disable=not enabled)


def train(cfg: Config, *, resume: bool | str = False, out_dir: str | None = None, progress: bool = True) -> TrainResult:
    return Trainer(cfg, resume=resume, out_dir=out_dir, progress=progress).assemble().fit()
