"""The optimizers of a run: which parameters train with which optimizer, their settings, and warm-up."""

from __future__ import annotations

import torch
from torch import nn

from gemzoo.config import Config
from gemzoo.distributed import is_fsdp_shard
from gemzoo.interfaces.planner import whole_parameters
from gemzoo.train.sparse_adagrad import SparseAdagrad


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
    """What step ``step`` multiplies each group's ``base_lr`` by: a linear warm-up over optim.warmup_steps."""
    if cfg.optim.warmup_steps > 0 and step < cfg.optim.warmup_steps:
        return (step + 1) / cfg.optim.warmup_steps
    return 1.0
