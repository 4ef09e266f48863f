"""3D dense parallelism from ``run.mesh``: HSDP and tensor parallelism for the transformer blocks.

    run.mesh = { replicate = R, shard = S, tp = T }      # R * S * T = world size; shard defaults to the rest

- The dense mesh is one DeviceMesh ``(replicate, shard, tp)`` beside the planner's (its dims come from
  ``Planner.mesh_dims``; :func:`gemzoo.distributed.build_mesh` builds both). Data parallelism is
  ``replicate x shard`` (flattened to ``dp``): those ranks load different samples; the T ranks of a ``tp``
  group load the same ones.
- Tensor parallelism (T > 1), DTensor ``parallelize_module`` on ``tp``: every transformer block gives its plan
  (``block.tp_plan()``: module name -> ``"colwise"``, ``"colwise:K"`` or ``"rowwise"``). Column-wise layers
  (q/k/v, the first MLP projection) keep this rank's heads / hidden units, row-wise ones (the output
  projections) sum the ranks' parts (all-reduce), so each rank sees every token and attention kernels run
  unchanged on the local heads. ``"colwise:K"`` is a fused projection of K parts (qkv: 3) each split by heads:
  its rows are put in rank order first (:func:`to_rank_rows`), so a plain ``Shard(0)`` gives each rank its heads
  of every part; the parameter records ``(K, T)`` and ``gemzoo.distributed.state`` undoes the order for
  checkpoints, which hold whole tensors in the model's own layout.
- HSDP (R * S > 1): FSDP2 ``fully_shard`` on each block over the 2-D mesh ``(replicate, shard)``: parameters
  sharded over ``shard``, replicated over ``replicate``, gradients reduce-scattered then all-reduced; on top of
  the TP DTensors when T > 1 (FSDP2 + TP).
- Embedding tables are the planner's: the T ranks of a tp group look up the same samples, and torchrec's
  sharded lookups divide their gradients by the world size (``comm_ops`` gradient division; sharding-2d does
  the same), so the T copies average to the data-parallel mean with nothing to correct; whole tables are
  averaged over ``dp`` like any replicated parameter.

- Dropout: every rank draws from the same seeded stream, so dropout on replicated activations is the same on
  the ranks of a tp group (as it must be); dropout on split activations (the MLP's hidden units, hstu's gated
  attention output) draws each rank's mask from that one stream too, so a run with dropout > 0 there is not the
  one-process run bit for bit (with dropout 0 it is, to float rounding) and the ranks' masks are correlated;
  a tensor-parallel RNG tracker (Megatron's) is not built yet.

Works on gloo (CPU) and NCCL alike: the ops are matmuls, all-gathers, reduce-scatters and all-reduces.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
from typing import Any

import torch
from torch import nn

from gemzoo.errors import ConfigError
from gemzoo.interfaces.models import transformer_blocks
from gemzoo.interfaces.precision import BF16Linear


class _DropRedistributeNotice(logging.Filter):
    """Gathering an HSDP + TP parameter whole (checkpoints) takes two all-gathers, which DTensor logs as a
    warning for every parameter on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_DropRedistributeNotice())

FUSED_ATTR = "_gemzoo_tp_rows"  # on a parameter: (K, T), its rows are in rank order (to_rank_rows)
STYLES = ("colwise", "rowwise", "layernorm", "sum_grad")


MESH_DIMS = ("replicate", "shard", "tp")  # run.mesh's dims, outermost first


def check_mesh_table(mesh: Any, dense_parallel: str = "fsdp") -> None:
    """``run.mesh`` on its own (the world size is checked when the mesh is built): a table of positive ints
    keyed by replicate, shard, tp; not with ``dense_parallel = "ddp"``."""
    if not isinstance(mesh, dict):
        raise ConfigError(f"run.mesh must be a table such as {{replicate = 2, shard = 2, tp = 1}}, got {mesh!r}")
    for name, size in mesh.items():
        if name not in MESH_DIMS:
            close = difflib.get_close_matches(str(name), MESH_DIMS, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ConfigError(f"run.mesh has an unknown dim {name!r}: it takes {', '.join(MESH_DIMS)} "
                              f"(e.g. {{replicate = 2, shard = 2, tp = 2}}).{hint}")
        if type(size) is not int or size < 1:
            raise ConfigError(f"run.mesh {name} = {size!r}: sizes are integers >= 1")
    if mesh and dense_parallel == "ddp":
        raise ConfigError(f"run.mesh {mesh} lays out the dense parts itself (replicate = R is their data "
                          "parallelism); drop run.dense_parallel = \"ddp\" (keep \"fsdp\") or drop run.mesh")


def dense_dims(mesh: dict[str, int] | None, world_size: int) -> dict[str, int] | None:
    """``run.mesh`` completed to ``{replicate, shard, tp}`` for ``world_size`` ranks; None when it is empty
    (the default layout: ``run.dense_parallel`` over every rank). ``replicate`` and ``tp`` default to 1,
    ``shard`` to the ranks left. A mesh whose product is not the world size is a ConfigError naming them."""
    if not mesh:
        return None
    check_mesh_table(mesh)
    dims = {"replicate": mesh.get("replicate", 1), "shard": mesh.get("shard"), "tp": mesh.get("tp", 1)}
    given = " x ".join(f"{n}={mesh[n]}" for n in MESH_DIMS if n in mesh)
    if dims["shard"] is None:
        rest, left = divmod(world_size, dims["replicate"] * dims["tp"])
        if left or rest < 1:
            raise ConfigError(f"run.mesh {given} does not divide the world of {world_size} ranks (shard would be "
                              f"{world_size}/{dims['replicate'] * dims['tp']}); launch a multiple of "
                              f"{dims['replicate'] * dims['tp']} ranks or change run.mesh")
        dims["shard"] = rest
    total = math.prod(dims.values())
    if total != world_size:
        shape = " x ".join(f"{n}={s}" for n, s in dims.items())
        raise ConfigError(f"run.mesh {shape} = {total} ranks, but the world has {world_size}; launch {total} "
                          f"ranks or change run.mesh so that replicate * shard * tp = {world_size}")
    return dims


# ---- tensor-parallel plans ------------------------------------------------------------------------
def parse_style(style: str, where: str) -> tuple[str, int | tuple[int, ...]]:
    """A plan entry as (kind, parts): ``"colwise"`` -> ("colwise", 1); ``"colwise:3"`` -> ("colwise", 3), a fused
    projection of 3 equal parts (q | k | v); ``"colwise:64,64,32,32"`` -> parts of those row counts (hstu's
    u | v | q | k); ``"rowwise"``; ``"layernorm"`` (a LayerNorm over the split features: statistics summed over
    tp); ``"sum_grad"`` (a module whose replicated output every rank's local heads use: its gradient is summed
    over tp)."""
    kind, _, parts = str(style).partition(":")
    sizes = parts.split(",") if parts else []
    ok = kind in STYLES and all(x.isdigit() and int(x) >= 1 for x in sizes) and (kind == "colwise" or not parts)
    if not ok:
        raise ConfigError(f"{where}: tensor-parallel style {style!r} is not one of 'colwise', 'colwise:K' (a fused "
                          "projection of K equal parts), 'colwise:A,B,...' (parts of those sizes), 'rowwise', "
                          "'layernorm' or 'sum_grad'")
    if len(sizes) > 1:
        return kind, tuple(int(x) for x in sizes)
    return kind, int(sizes[0]) if sizes else 1


def _sizes(parts: int | tuple[int, ...], rows: int) -> tuple[int, ...]:
    return tuple(parts) if isinstance(parts, tuple) else (rows // parts,) * parts


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _tp_linears() -> tuple[type, ...]:
    """The linears whose forward is a DTensor-friendly F.linear: plain ones and bf16's (weights cast, then mm)."""

    return nn.Linear, BF16Linear


def tensor_parallel_plans(model: nn.Module, tp: int) -> list[tuple[str, nn.Module, dict[str, tuple[str, int]]]]:
    """(name, unit, {module: (style, parts)}) for every transformer block (its ``tp_plan()``), then for each
    child of the model whose layers the model's own optional ``tp_plan()`` (dotted names from the model, e.g.
    gem's cross attention and interaction MLP) splits; checked for ``tp`` ranks: every block declares a plan, the
    layers are ``nn.Linear`` (or ``BF16Linear``), and ``tp`` divides every attention's heads and every split
    dimension. Runs on a meta model, so ``gemzoo config validate`` reports it with no ranks."""

    names = {id(m): n for n, m in model.named_modules()}
    units = []
    for block in transformer_blocks(model):
        name = names.get(id(block), type(block).__name__)
        plan_fn = getattr(block, "tp_plan", None)
        if plan_fn is None:
            raise ConfigError(
                f"run.mesh tp={tp}: transformer block {name} ({type(block).__name__}) declares no tensor-parallel "
                "plan (a tp_plan() method); use tp = 1 for this model (HSDP over replicate x shard still works)")
        units.append((name, block, plan_fn()))
    grouped: dict[str, dict[str, str]] = {}
    for path, style in (getattr(model, "tp_plan", lambda: {})() or {}).items():
        parent, _, child = path.partition(".")  # the model's child whose forward runs them: FSDP2 wraps it
        if not child:
            raise ConfigError(f"{type(model).__name__}.tp_plan() names {path!r}: name layers inside a submodule "
                              "(e.g. 'cross.q'), which tensor parallelism and FSDP2 then wrap")
        grouped.setdefault(parent, {})[child] = style
    for parent, plan in grouped.items():
        try:
            units.append((parent, model.get_submodule(parent), plan))
        except AttributeError:
            raise ConfigError(f"{type(model).__name__}.tp_plan() names {parent!r}, which the model does not "
                              "have") from None
    return [(name, unit, _checked_plan(name, unit, plan, tp)) for name, unit, plan in units]


def _checked_plan(name: str, unit: nn.Module, plan: dict[str, str], tp: int) -> dict[str, tuple[str, int]]:
    for sub_name, sub in unit.named_modules():
        for attr in ("num_heads", "num_kv_heads"):  # each rank keeps whole heads, and whole k/v head groups
            heads = getattr(sub, attr, None)
            if isinstance(heads, int) and heads % tp:
                where = f"{name}.{sub_name}" if sub_name else name
                raise ConfigError(f"run.mesh tp={tp} does not divide the attention heads: {where} has {attr}="
                                  f"{heads}; choose tp among {_divisors(heads)} or change model.{attr}")
    out = {}
    for module_name, style in plan.items():
        where = f"{name}.{module_name}"
        kind, parts = parse_style(style, where)
        try:
            layer = unit.get_submodule(module_name)
        except AttributeError:
            raise ConfigError(f"{type(unit).__name__}'s tensor-parallel plan names {module_name!r}, which {name} "
                              "does not have") from None
        out[module_name] = (kind, parts)
        if kind == "sum_grad":
            continue
        if kind == "layernorm":
            if not isinstance(layer, nn.LayerNorm) or len(layer.normalized_shape) != 1:
                raise ConfigError(f"{where}: the 'layernorm' style takes a LayerNorm over one dim, not "
                                  f"{type(layer).__name__}")
            size = layer.normalized_shape[0]
            if size % tp:
                raise ConfigError(f"run.mesh tp={tp} does not divide {where}'s {size} features; choose tp among "
                                  f"{_divisors(size)}")
            continue
        if type(layer) not in _tp_linears():
            raise ConfigError(
                f"run.mesh tp={tp}: {where} is a {type(layer).__name__}, not an nn.Linear or BF16Linear (a "
                "precision policy swapped it); tensor parallelism runs with plugins.precision = \"fp32\" or "
                "\"bf16\" for now (keep the block's linears with precision.keep)")
        size = layer.out_features if kind == "colwise" else layer.in_features
        sizes = _sizes(parts, size) if kind == "colwise" else (size,)
        if sum(sizes) != size:
            raise ConfigError(f"{where}: the parts {list(sizes)} of its plan add up to {sum(sizes)}, not its {size} "
                              "output features")
        if any(n % tp for n in sizes):  # parts of their own sizes (q | k | v with grouped k/v) need not be equal
            what = "output" if kind == "colwise" else "input"
            raise ConfigError(f"run.mesh tp={tp} does not divide {where}'s {what} features ({size}"
                              f"{f' in parts of {list(sizes)}' if len(sizes) > 1 else ''}); choose tp among "
                              f"{_divisors(math.gcd(*sizes))} or change the model's sizes")
    return out


def to_rank_rows(t: torch.Tensor, parts: int | tuple[int, ...], tp: int) -> torch.Tensor:
    """Rows of a fused projection (``parts``: K equal blocks such as q | k | v, or the blocks' row counts)
    reordered by rank: rank r's rows of part 0, of part 1, ... come r-th, so ``Shard(0)`` over ``tp`` ranks gives
    each rank its heads of every part."""
    pieces = [p.reshape(tp, -1, *t.shape[1:]) for p in t.split(_sizes(parts, t.shape[0]))]
    return torch.cat([piece[r] for r in range(tp) for piece in pieces])


def from_rank_rows(t: torch.Tensor, parts: int | tuple[int, ...], tp: int) -> torch.Tensor:
    """The inverse of :func:`to_rank_rows`: the model's own row order."""
    local = [n // tp for n in _sizes(parts, t.shape[0])]
    ranks = [chunk.split(local) for chunk in t.split(sum(local))]
    return torch.cat([ranks[r][i] for i in range(len(local)) for r in range(tp)])


def rank_rows(p) -> tuple[int, int] | None:
    """(parts, tp) when ``p``'s rows are in rank order, else None."""
    return getattr(p, FUSED_ATTR, None)


def parallelize_blocks(model: nn.Module, tp_mesh, tp: int) -> list[tuple[str, nn.Module, dict]]:
    """Tensor parallelism over ``tp_mesh`` on every transformer block (its ``tp_plan()``) and on what the model's
    own ``tp_plan()`` names; returns the plans (:func:`tensor_parallel_plans`)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plans = tensor_parallel_plans(model, tp)
    for _, block, plan in plans:
        styles = {}
        for module_name, (kind, parts) in plan.items():
            if kind == "colwise" and parts != 1:
                layer = block.get_submodule(module_name)
                with torch.no_grad():
                    for p in layer.parameters(recurse=False):
                        p.copy_(to_rank_rows(p, parts, tp))
            styles[module_name] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                                   "layernorm": _FeatureShardedNorm, "sum_grad": _SumGradOverTP}[kind]()
        parallelize_module(block, tp_mesh, styles)
    return plans


class _AllReduceSum(torch.autograd.Function):
    """Sum over the tp group; the backward sums too (each rank's gradient is its local features' part)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumGradBackward(torch.autograd.Function):
    """Identity forward; the gradient summed over the tp group (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _style_base():
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle


class _FeatureShardedNorm(_style_base()):
    """A LayerNorm over features split by heads across tp ranks (hstu's attn_norm over every head's output):
    weight and bias ``Shard(0)``; mean and variance from sums all-reduced over tp, so each rank normalises its
    features with the whole row's statistics."""

    def _apply(self, module: nn.LayerNorm, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Shard(0)])))
        group, tp = device_mesh.get_group(), device_mesh.size()

        def forward(x: torch.Tensor) -> torch.Tensor:
            n = x.shape[-1] * tp
            mean = _AllReduceSum.apply(x.sum(-1, keepdim=True), group) / n
            d = x - mean
            var = _AllReduceSum.apply((d * d).sum(-1, keepdim=True), group) / n
            y = d * torch.rsqrt(var + module.eps)
            if module.weight is not None:
                y = y * module.weight.to_local()
            if module.bias is not None:
                y = y + module.bias.to_local()
            return y

        module.forward = forward
        return module


class _SumGradOverTP(_style_base()):
    """A module whose output every rank computes whole and uses with its local heads only (hstu's relative
    attention bias): its gradient is summed over tp, so its (replicated) parameters get the whole gradient.
    The output is a tensor, or a dataclass (a RelativeAttentionBias) whose floating tensor fields are each
    such an output."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = device_mesh.get_group()
        module.register_forward_hook(lambda m, args, out: _sum_grad_over(out, group))
        return module


def _sum_grad_over(out, group):
    if isinstance(out, torch.Tensor):
        return _SumGradBackward.apply(out, group)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{
            f.name: _SumGradBackward.apply(getattr(out, f.name), group) for f in dataclasses.fields(out)
            if isinstance(getattr(out, f.name), torch.Tensor) and getattr(out, f.name).is_floating_point()})
    raise TypeError(f"the 'sum_grad' tensor-parallel style takes a module whose output is a tensor or a "
                    f"dataclass of tensors, got {type(out).__name__}")


def mark_rank_rows(plans, tp: int) -> None:
    """After FSDP2 (which makes new parameter objects): tag each fused projection's parameters with (K, T)."""
    for _, block, plan in plans:
        for module_name, (kind, parts) in plan.items():
            if kind == "colwise" and parts != 1:
                for p in block.get_submodule(module_name).parameters(recurse=False):
                    setattr(p, FUSED_ATTR, (parts, tp))


def shard_dense(model: nn.Module, world) -> nn.Module:
    """Tensor parallelism over ``tp``, then FSDP2 (HSDP) over ``(replicate, shard)``, on every transformer block
    and every module the model's ``tp_plan()`` splits; other dense parameters stay whole on every rank (their
    gradients are averaged over ``dp``)."""
    mesh = world.dense_mesh
    tp = mesh["tp"].size()
    plans = parallelize_blocks(model, mesh["tp"], tp) if tp > 1 else []
    if world.dp_mesh.size() > 1:
        from torch.distributed.fsdp import fully_shard

        units = list(transformer_blocks(model))
        units += [unit for _, unit, _ in plans if not any(unit is b for b in units)]
        for unit in units:
            fully_shard(unit, mesh=mesh["replicate", "shard"])
    mark_rank_rows(plans, tp)
    return model
