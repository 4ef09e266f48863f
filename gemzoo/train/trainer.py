"""The trainer. ``train(cfg)`` assembles a run in this order, top to bottom in ``Trainer.assemble``, then runs
its loop (``gemzoo.train.loop``):

 1. config (already validated)   2. distributed init + mesh   3. dataset, batching policy
 4. model on meta                5. attention kernel per site  6. precision policy
 7. planner (sparse), dense DP   8. memory policy, compile     9. optimizers (``gemzoo.train.optim``)
10. resume                      11. loop: step, metrics, eval, atomic checkpoints
"""

from __future__ import annotations

import logging
import os
import shutil
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemzoo import kinds, registry
from gemzoo.attention import attention_sites, site_kernels_that_serve, site_missing
from gemzoo.config import Config
from gemzoo.data.lookahead import Lookahead
from gemzoo.distributed import World, build_mesh, init_distributed, is_fsdp_shard, pick_device, shard_dense_blocks
from gemzoo.distributed import state as dstate
from gemzoo.distributed.dense import dense_dims, tensor_parallel_plans
from gemzoo.embedding import use_sparse_gradients
from gemzoo.errors import CheckpointError, ConfigError, DataNotFound, PluginError
from gemzoo.interfaces.memory import needs_compile
from gemzoo.interfaces.models import transformer_blocks
from gemzoo.interfaces.planner import SparseOptimizer, Topology
from gemzoo.interfaces.precision import PrecisionConfig
from gemzoo.train import checkpoint as ckpt
from gemzoo.train import provenance, run_folder
from gemzoo.train.console import RunLog, banner
from gemzoo.train.flops import peak_flops
from gemzoo.train.loop import StepLoop, TrainResult
from gemzoo.train.optim import apply_optimizer_settings, build_optimizers, split_parameters
from gemzoo.train.resume import check_resumable, config_changes, describe


class _DropFxTracingNotice(logging.Filter):
    """torchrec calls ``torch.fx.is_fx_tracing()``, which logs a notice about torch.export on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropFxTracingNotice())


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
        missing = site_missing(kernel.capabilities, req)  # a relative bias: relative_bias, or bias materialised
        if missing:
            able = site_kernels_that_serve(req)
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


def build_on_meta(cfg: Config, *, without_data: list[str] | None = None) -> nn.Module:
    """Assembly steps 3-6 with no weights and no training: the dataset, the model on ``meta``, an attention
    kernel per site and the precision policy. ``gemzoo config validate`` runs it, so what ``train``
    would reject there (heads that do not divide d_model, batch_size 0, a kernel without a capability a site
    needs, a run.mesh tp that does not divide the heads) is reported without training.

    ``without_data``: a list to go on without the dataset's files. When they are not there and the dataset
    spec can describe itself from the config (``DatasetSpec.info_without_data``), the model is built from that
    nominal info and the reason is appended to the list; otherwise a missing file is an error, as in ``train``."""
    device = pick_device(cfg.run.device, World())
    dspec = registry.get("dataset", cfg.data.source)
    try:
        info = dspec.build(cfg.data, cfg.run.seed).info
    except DataNotFound as exc:
        if without_data is None or dspec.info_without_data is None:
            raise
        info = dspec.info_without_data(cfg.data)
        without_data.append(str(exc))
    with torch.device("meta"):
        model = registry.get("model", cfg.model.family).build(cfg.model, info)
    precision = configured("precision", cfg.plugins.precision, cfg)
    select_attention(model, cfg, device, attention_dtype(precision))
    model = precision.apply(model, PrecisionConfig(keep=list(cfg.precision.keep)))
    if cfg.run.mesh.get("tp", 1) > 1:
        tensor_parallel_plans(model, cfg.run.mesh["tp"])
    return model


class Trainer(StepLoop):
    """Holds the assembled run; ``gemzoo_step_end`` hooks receive it. ``assemble`` builds it, ``fit`` (the
    loop, from ``StepLoop``) trains it."""

    def __init__(self, cfg: Config, *, resume: bool | str = False, out_dir: str | None = None,
                 progress: bool = True, overwrite: bool = False, command: str | None = None):
        self.cfg = cfg
        self.command = command  # for command.txt and provenance.json; None: this process's command line
        self.resume = resume
        self.overwrite = overwrite
        self.out_dir = Path(out_dir or cfg.run.out_dir)
        self.progress = progress
        self.hook = registry.host().pm.hook
        self.resume_changes: list[tuple[str, Any, Any]] = []
        self.lock: run_folder.RunLock | None = None

    def release(self) -> None:
        """Give up the run folder's lock (``train`` does it when the run ends, however it ends)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ----------------------------------------------------------------------------------------
    def assemble(self) -> Trainer:
        """Assemble the run (steps 1-10); rank 0 opens ``train.log`` and writes the run's provenance files."""
        try:
            return self._assemble()
        except BaseException:
            if self.run_log is not None:
                self.run_log.close()
                self._forget_unstarted_run()
            self.release()  # a run that fails to assemble leaves the folder to the next one
            raise

    def _forget_unstarted_run(self) -> None:
        """A fresh run that failed before its first step leaves the folder as it found it: the provenance files
        and train.log it had written go (the terminal showed the error), so the corrected command can run in the
        same folder. Only files a run writes, and only while there are no metrics or checkpoints."""
        folder = self.out_dir
        if self.resume or (folder / run_folder.METRICS).exists() or (folder / run_folder.CHECKPOINTS).exists():
            return
        run_folder.clear_run_folder(folder)

    def _assemble(self) -> Trainer:
        cfg = self.cfg
        # 1. Config: validated by load_config; plugins may look at it. One run folder holds one run, and one
        #    trainer at a time: rank 0 (RANK is torchrun's) locks it; the other ranks wait at the barrier below.
        if os.environ.get("RANK", "0") == "0":
            self.lock = run_folder.RunLock.acquire(self.out_dir)
        run_folder.check_run_folder(self.out_dir, resume=bool(self.resume), overwrite=self.overwrite)
        self.hook.gemzoo_configure(config=cfg)
        torch.manual_seed(cfg.run.seed)
        torch.set_float32_matmul_precision(cfg.run.matmul_precision)

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
        if self.world.world_size > 1:
            dist.barrier()  # every rank has checked the run folder (step 1) before rank 0 writes into it
        if self.world.is_main:
            if self.overwrite and run_folder.clear_run_folder(self.out_dir):
                print(f"--overwrite: deleted the previous run's files in {self.out_dir}", flush=True)
            ckpt.remove_stale_temporaries(self.out_dir / run_folder.CHECKPOINTS)
            self.run_log = RunLog(self.out_dir, append=bool(self.resume))  # what the terminal shows, kept
        if self.world.world_size > 1:
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
        num_parameters = sum(p.numel() for p in model.parameters())  # before any sharding: the whole model

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
        compilers = [n for n, p in zip(cfg.plugins.memory, self.memory, strict=True) if needs_compile(p)]
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
        if self.world.is_main:
            self._write_provenance(mspec, num_parameters)
        return self

    def _write_provenance(self, mspec, num_parameters: int) -> None:
        """config.toml, command.txt, provenance.json; and the banner ``fit`` prints."""
        cfg = self.cfg
        selected = {name for names in kinds.selected(cfg.plugins).values() for name in names}
        versions = {e.distribution: e.version for e in registry.entries() if e.name in selected}
        provenance.write_provenance(self.out_dir, cfg.to_dict(), command=self.command or provenance.command_line(),
                                    device=self.device, world_size=self.world.world_size, plugins=versions,
                                    start_step=self.start_step)
        about = (getattr(mspec, "description", "") or "").split(":")[0].strip()[:40]
        model = f"{cfg.model.family} ({about})" if about else cfg.model.family
        self.banner_text = banner(
            name=cfg.run.name, model=model, parameters=num_parameters, plugins=kinds.selected(cfg.plugins),
            device=str(self.device), world_size=self.world.world_size, data=cfg.data.source,
            batch_size=cfg.data.batch_size, steps=cfg.run.steps, start_step=self.start_step, out_dir=self.out_dir)

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
            try:
                opt.load_state_dict(state["optimizers"][name])
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                raise CheckpointError(
                    f"{state['path']}: its state for optimizer {name!r} does not fit this run's ({exc}); resume "
                    "from an earlier checkpoint, or start a new run (--out DIR)") from None
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
        if self.world.is_main and later:
            self.say(f"  superseded after step {step}: {len(later)} unusable checkpoint(s) renamed *.unusable")
        for reason in dropped if self.world.is_main else []:
            self.say(f"  dropped from {run_folder.METRICS}: {reason}")

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


def train(cfg: Config, *, resume: bool | str = False, out_dir: str | None = None, progress: bool = True,
          overwrite: bool = False, command: str | None = None) -> TrainResult:
    trainer = Trainer(cfg, resume=resume, out_dir=out_dir, progress=progress, overwrite=overwrite, command=command)
    try:
        return trainer.assemble().fit()
    finally:
        trainer.release()
