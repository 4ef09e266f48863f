"""``gemzoo new-plugin NAME --kind KIND``: write a plugin distribution that installs and passes its tests.

    gemzoo new-plugin myattn --kind attention            # -> ./gemzoo-myattn/
    pip install -e gemzoo-myattn && pytest gemzoo-myattn/tests

The distribution follows plugins/gemzoo-jfa: ``pyproject.toml`` (``[build-system]``, ``version``, the
``gemzoo`` entry point), ``gemzoo_<name>/plugin.py`` with the hookimpl, one module holding the
implementation the author fills in, ``tests/`` that run the kind's conformance checks against the
*installed* entry point, and a README. Every kind starts from a working default (the attention kernel calls
the ``reference`` kernel, the precision policy runs fp32, the planner keeps tables whole, ...), so the tests
pass as generated and keep passing while the author replaces the default.
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path
from string import Template

from gemzoo import kinds
from gemzoo.errors import ConfigError, PluginError

NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

# ------------------------------------------------------------------------------------------------ shared
PYPROJECT = """\
[build-system]
requires = ["setuptools>=70", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "gemzoo-$name"
version = "0.1.0"
description = "$summary"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["gemzoo", "torch"]

[project.entry-points.gemzoo]
$name = "$mod.plugin"

[tool.setuptools.packages.find]
include = ["$mod*"]

[tool.pytest.ini_options]
testpaths = ["tests"]
addopts = "--import-mode=importlib"
"""

INIT = '''\
"""gemzoo-$name: $summary"""

__version__ = "0.1.0"
'''

README = """\
# gemzoo-$name

$summary: a gemzoo `$kind` plugin, registered as `$name` through the `gemzoo` entry-point group.

## Install and check

```bash
pip install -e .            # add --no-build-isolation --no-deps inside a ready gemzoo environment
gemzoo list $kind      # shows $name
pytest tests                # the $kind conformance checks, against the installed entry point
```

## Use

```bash
$use
```

## Where things are

- `$mod/plugin.py`: the hook, `$hook(register)`, registering `$name`.
- `$mod/$impl.py`: the implementation. $fill
- `tests/test_$mod.py`: $tests

The interface is documented in gemzoo's `docs/kinds/$kind.md` ($protocol).
"""

# Every kind's plugin.py: its kind's hook (from gemzoo.kinds) registers the entry the template's "plugin" fields
# name (what it is, the gemzoo.interfaces name it needs if any, what it imports from the implementation module).
PLUGIN = '''\
"""Registers the $$name $what with gemzoo."""

import gemzoo
$core
from $$mod.$$impl import $imports


@gemzoo.hookimpl
def $hook(register):
    register("$$name", $entry)
'''

# Used by the kinds whose conformance includes a short training run (planner, model, dataset).
TINY_RUN = '''

def tiny_run(tmp_path, *, plugins=None, model=None, data=None, steps=3):
    """A few steps of a tiny GEM-like run on the CPU; returns the trainer's result."""
    from gemzoo.config import load_config
    from gemzoo.train.trainer import train

    raw = {
        "run": {"name": "tiny", "steps": steps, "out_dir": str(tmp_path / "run"), "device": "cpu", "log_every": 1},
        "model": model or {"family": "gem", "d_model": 32, "num_layers": 1, "num_heads": 2, "embedding_dim": 16,
                           "mlp_dims": [32]},
        "data": data or {"source": "synthetic-gem", "batch_size": 8, "max_len": 16, "median_len": 8,
                         "num_items": 100, "num_sparse_tables": 2, "sparse_table_size": 50},
        "eval": {"every": steps, "batches": 1},
        "checkpoint": {"every": steps, "keep": 1},
    }
    return train(load_config(raw=raw, plugins=plugins), progress=False)
'''

# ------------------------------------------------------------------------------------------------ kinds
ATTENTION = {
    "impl": "kernel",
    "summary": "a jagged attention kernel",
    "protocol": "`gemzoo.interfaces.AttentionKernel`, `AttentionCapabilities`; semantics in `docs/attention.md`",
    "use": "gemzoo train --config configs/gem-tiny.toml --plugins $name",
    "fill": "It starts by calling the `reference` kernel, so the conformance suite passes before you change "
            "anything; replace the body of `${func}_attention` with your kernel, and widen `CAPABILITIES` as it "
            "learns more (the suite tests every combination it declares).",
    "tests": "`gemzoo.testing.attention_cases` / `check_attention` over every declared capability, forward and "
             "backward against the float64 reference.",
    "plugin": {"what": "attention kernel", "core": "FunctionKernel", "imports": "CAPABILITIES, ${func}_attention",
               "entry": 'FunctionKernel(${func}_attention, CAPABILITIES, description="$summary")'},
    "files": {
        "kernel.py": '''\
"""The $name attention kernel: q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv] jagged by int64 offsets [B+1].

Semantics (docs/attention.md): per sequence, S = scale * Q K^T with scale 1/sqrt(D) by default; key j is
allowed for query i when causal is off or j <= i + (Lk - Lq) (bottom-right), within ``window`` and in the same
``block_size`` block; softmax over the allowed keys; a row with no allowed key outputs 0.
"""

from __future__ import annotations

import gemzoo
from gemzoo.interfaces import AttentionCapabilities
from gemzoo.api import check_inputs

# What this kernel supports. The conformance suite tests every combination declared here, and the trainer
# refuses a model whose attention sites need something missing, naming the kernels that can serve it.
CAPABILITIES = AttentionCapabilities(window=True, block=True)


def ${func}_attention(
    q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None, norm=None,
    max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None,
):
    options = dict(causal=causal, activation=activation, scale=scale, norm=norm, max_q_len=max_q_len,
                   max_k_len=max_k_len, block_size=block_size, window=window, rope_theta=rope_theta)
    # The one input check every kernel runs: shapes, offsets, option values, hints, and a PluginError for
    # anything CAPABILITIES does not declare (also when the kernel is called directly).
    q_offsets, k_offsets = check_inputs(
        q, k, v, q_offsets, k_offsets, capabilities=CAPABILITIES, kernel="$name", **options)
    # The starting point: the reference kernel (per-sequence torch, the oracle). Replace with your own.
    reference = gemzoo.registry.get("attention", "reference")
    return reference(q, k, v, q_offsets, k_offsets, **options)
''',
        "test": '''\
"""The attention conformance suite, run on the installed $name kernel."""

import pytest
import torch

import gemzoo
from gemzoo.interfaces import AttentionRequest
from gemzoo.testing import attention_cases, check_attention

KERNEL = gemzoo.registry.get("attention", "$name")


def test_registered_through_the_entry_point():
    assert "$name" in gemzoo.registry.names("attention")


@pytest.mark.parametrize("case", attention_cases(KERNEL.capabilities), ids=str)
def test_conformance(case):
    check_attention(KERNEL, case, device="cpu")


@pytest.mark.parametrize("case", attention_cases(KERNEL.capabilities, quick=True), ids=str)
def test_conformance_bf16(case):
    check_attention(KERNEL, case, device="cpu", dtype=torch.bfloat16)


def test_capabilities_say_what_is_missing():
    missing = KERNEL.capabilities.missing(AttentionRequest(activation="no-such-activation"))
    assert missing and "no-such-activation" in missing[0]
''',
    },
}

PRECISION = {
    "impl": "policy",
    "summary": "a precision policy",
    "protocol": "`gemzoo.interfaces.PrecisionPolicy`, `PrecisionCapabilities`",
    "use": "gemzoo train --config configs/gem-tiny.toml --plugins $name   # precision.keep lists modules kept in bf16",
    "fill": "`${cls}Linear.forward` starts as a plain fp32 matmul; replace it with your low-precision one "
            "(quantize input and weight, GEMM, dequantize) and set `linear_rtol` to the error it promises.",
    "tests": "`gemzoo.testing.check_precision_linear` (the policy's linear against fp32, forward and backward, "
             "within the declared `linear_rtol`), and `apply` swaps every linear that `precision.keep` does not match.",
    "plugin": {"what": "precision policy", "imports": "${cls}Policy", "entry": '${cls}Policy()'},
    "files": {
        "policy.py": '''\
"""The $name precision policy: every nn.Linear not matched by ``precision.keep`` becomes a ``${cls}Linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.interfaces import PrecisionCapabilities, PrecisionConfig
from gemzoo.interfaces.precision import adopt_linear, swap_linears


class ${cls}Linear(nn.Linear):
    """Shares the original linear's parameters (fp32 master weights); only the matmul changes."""

    precision = "$name"  # what `gemzoo config show` reports for this module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The starting point: fp32. Replace with your low-precision matmul.
        return F.linear(x, self.weight, self.bias)


class ${cls}Policy:
    # linear_rtol: ||y - y_fp32|| / ||y_fp32|| this policy's linear promises (checked by the conformance test).
    capabilities = PrecisionCapabilities(linear_rtol=1e-5, compute_dtype=torch.float32)
    description = "$summary"

    def make_linear(self, linear: nn.Linear) -> nn.Module:
        return adopt_linear(${cls}Linear, linear)

    def apply(self, model: nn.Module, cfg: PrecisionConfig) -> nn.Module:
        swap_linears(model, self.make_linear, cfg.keep)
        return model
''',
        "test": '''\
"""Precision conformance, run on the installed $name policy."""

import torch
from torch import nn

import gemzoo
from gemzoo.interfaces import PrecisionConfig, PrecisionPolicy
from gemzoo.testing import check_precision_linear

POLICY = gemzoo.registry.get("precision", "$name")


def test_registered_and_follows_the_protocol():
    assert "$name" in gemzoo.registry.names("precision")
    assert isinstance(POLICY, PrecisionPolicy)


def test_linear_matches_fp32_within_its_tolerance():
    check_precision_linear(POLICY)


def test_apply_swaps_all_but_kept_linears():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    before = model(x)
    model = POLICY.apply(model, PrecisionConfig(keep=["2"]))
    assert getattr(model[0], "precision", None) == "$name" and type(model[2]) is nn.Linear
    rel = (model(x) - before).norm() / before.norm()
    assert rel <= max(POLICY.capabilities.linear_rtol, 1e-6) * 10
''',
    },
}

MEMORY = {
    "impl": "policy",
    "summary": "a memory policy",
    "protocol": "`gemzoo.interfaces.MemoryPolicy`",
    "use": "gemzoo train --config configs/gem-tiny.toml --plugins $name",
    "fill": "`apply` starts by returning the model unchanged and `step_context` by doing nothing; wrap blocks in "
            "activation checkpointing, or compress saved tensors with `torch.autograd.graph.saved_tensors_hooks`.",
    "tests": "loss and every gradient with the policy equal those without it (within `TOLERANCE`), on a small "
             "model, and the policy satisfies the protocol.",
    "plugin": {"what": "memory policy", "imports": "${cls}Memory", "entry": '${cls}Memory()'},
    "files": {
        "policy.py": '''\
"""The $name memory policy: trade compute (or precision) for activation memory."""

from __future__ import annotations

import contextlib

from torch import nn


class ${cls}Memory:
    description = "$summary"

    def apply(self, model: nn.Module, cfg=None) -> nn.Module:
        """Wrap the model (e.g. run each transformer block under torch.utils.checkpoint). Starts as a no-op."""
        return model

    def step_context(self):
        """Entered around each forward+backward, e.g. ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``."""
        return contextlib.nullcontext()
''',
        "test": '''\
"""Memory-policy conformance, run on the installed $name policy: loss and gradients unchanged."""

import copy

import torch
from torch import nn

import gemzoo
from gemzoo.interfaces import MemoryPolicy

POLICY = gemzoo.registry.get("memory", "$name")
TOLERANCE = 1e-6  # a lossy policy (fp8 saved activations, ...) sets what it promises here


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.ff = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


def loss_and_grads(model, x, policy=None):
    context = policy.step_context() if policy else None
    if context is not None:
        context.__enter__()
    try:
        loss = model(x).square().mean()
        loss.backward()
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_registered_and_follows_the_protocol():
    assert "$name" in gemzoo.registry.names("memory")
    assert isinstance(POLICY, MemoryPolicy)


def test_loss_and_gradients_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(Block(16), Block(16))
    x = torch.randn(32, 16)
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), x)
    loss, grads = loss_and_grads(POLICY.apply(model), x, POLICY)
    assert torch.allclose(loss, ref_loss, rtol=TOLERANCE, atol=TOLERANCE)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=TOLERANCE, atol=TOLERANCE), name
''',
    },
}

BATCHING = {
    "impl": "policy",
    "summary": "a batching policy",
    "protocol": "`gemzoo.interfaces.BatchingPolicy`",
    "use": "torchrun --nproc_per_node 2 -m gemzoo.cli train --config configs/gem-tiny.toml --plugins $name",
    "fill": "`assign` starts as greedy longest-processing-time balancing of the per-sample costs; replace it "
            "(Karmarkar-Karp, ...) keeping its contract: every sample on exactly one rank, deterministically.",
    "tests": "every sample assigned exactly once, deterministic, loads within one sample's cost of each other's "
             "mean, and the one-rank and empty cases.",
    "plugin": {"what": "batching policy", "imports": "${cls}Batching", "entry": '${cls}Batching()'},
    "files": {
        "policy.py": '''\
"""The $name batching policy: split a global batch's samples across data-parallel ranks by cost."""

from __future__ import annotations

import torch


class ${cls}Batching:
    description = "$summary"

    def assign(self, costs: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        """Sample indices per rank; ``costs[i]`` is sample i's work (e.g. its attention pairs).

        The starting point: greedy longest-processing-time first (each sample, largest first, goes to the
        least-loaded rank; ties to the lower rank), which is deterministic."""
        loads = [0.0] * world_size
        groups: list[list[int]] = [[] for _ in range(world_size)]
        order = torch.argsort(costs.double().cpu(), descending=True, stable=True).tolist()
        values = costs.double().cpu().tolist()
        for i in order:
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            groups[rank].append(i)
            loads[rank] += values[i]
        return [torch.tensor(sorted(g), dtype=torch.long) for g in groups]
''',
        "test": '''\
"""Batching conformance, run on the installed $name policy."""

import pytest
import torch

import gemzoo
from gemzoo.interfaces import BatchingPolicy

POLICY = gemzoo.registry.get("batching", "$name")


def test_registered_and_follows_the_protocol():
    assert "$name" in gemzoo.registry.names("batching")
    assert isinstance(POLICY, BatchingPolicy)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_sample_once_deterministic_balanced(world_size, seed):
    g = torch.Generator().manual_seed(seed)
    costs = (torch.rand(37, generator=g) * 100).round() ** 2  # jagged work: squared lengths
    groups = POLICY.assign(costs, world_size)
    assert len(groups) == world_size
    assigned = torch.cat(groups).sort().values
    assert torch.equal(assigned, torch.arange(37)), "every sample must go to exactly one rank"
    again = POLICY.assign(costs.clone(), world_size)
    assert all(torch.equal(a, b) for a, b in zip(groups, again)), "assign must be deterministic"
    loads = torch.stack([costs[gr].sum() for gr in groups])
    assert float(loads.max() - costs.sum() / world_size) <= float(costs.max())


def test_no_samples():
    groups = POLICY.assign(torch.zeros(0), 4)
    assert len(groups) == 4 and all(gr.numel() == 0 for gr in groups)
''',
    },
}

COMMS = {
    "impl": "backend",
    "summary": "a communication backend",
    "protocol": "`gemzoo.interfaces.CommsBackend`, `CommsCapabilities`",
    "use": "torchrun --nproc_per_node 2 -m gemzoo.cli train --config configs/gem-tiny.toml --plugins $name",
    "fill": "`backend_for` starts by naming c10d's own backends (gloo on CPU, nccl on GPU) and `install` does "
            "nothing; register your own with `torch.distributed.Backend.register_backend` in `install`, return "
            "its name, and list the collectives it runs itself in `capabilities.implements`.",
    "tests": "a one-process group through the backend; all_reduce, all_gather and broadcast give c10d's answers.",
    "plugin": {"what": "communication backend", "imports": "${cls}Comms", "entry": '${cls}Comms()'},
    "files": {
        "backend.py": '''\
"""The $name communication backend: makes a c10d backend available by name."""

from __future__ import annotations

from gemzoo.interfaces import CommsCapabilities


class ${cls}Comms:
    # sm_free: moves data with copy engines only; implements: the collectives it runs itself (the rest go to c10d).
    capabilities = CommsCapabilities(sm_free=False, implements=frozenset())
    description = "$summary"

    def backend_for(self, device_type: str) -> str:
        """The backend string for ``init_process_group`` on ``device_type`` ("cpu" or "cuda")."""
        return "nccl" if device_type == "cuda" else "gloo"

    def install(self) -> None:
        """Register the backend, e.g. ``torch.distributed.Backend.register_backend("$name", create, devices=[...])``."""
''',
        "test": '''\
"""Comms conformance, run on the installed $name backend: collectives give c10d's answers."""

import pytest
import torch
import torch.distributed as dist

import gemzoo
from gemzoo.interfaces import CommsBackend

BACKEND = gemzoo.registry.get("comms", "$name")


def test_registered_and_follows_the_protocol():
    assert "$name" in gemzoo.registry.names("comms")
    assert isinstance(BACKEND, CommsBackend)


@pytest.fixture
def group():
    BACKEND.install()
    dist.init_process_group(BACKEND.backend_for("cpu"), store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collectives_on_one_rank(group):
    x = torch.arange(6, dtype=torch.float32)
    y = x.clone()
    dist.all_reduce(y)
    assert torch.equal(y, x)
    out = [torch.empty_like(x)]
    dist.all_gather(out, x)
    assert torch.equal(out[0], x)
    b = x.clone()
    dist.broadcast(b, src=0)
    assert torch.equal(b, x)
''',
    },
}

PLANNER = {
    "impl": "planner",
    "summary": "an embedding sharding planner",
    "protocol": "`gemzoo.interfaces.Planner`, `Topology`, `WholeTables`",
    "use": "torchrun --nproc_per_node 2 -m gemzoo.cli train --config configs/gem-tiny.toml --plugins $name",
    "fill": "`plan` starts by returning None (every rank keeps whole tables, replicated and all-reduced like "
            "other dense parameters) and `shard` by returning the model; wrap torchrec's planner and "
            "`DistributedModelParallel` to shard instead, and override what `WholeTables` gives for the rest "
            "of the protocol (`mesh_dims`, `attach_optimizer`, `replicated_parameters`, `sync`, `state_dict`, "
            "`load_state_dict`).",
    "tests": "plan on a one-rank topology, then a short training run with the planner whose loss is finite and "
             "whose checkpoint the trainer wrote.",
    "plugin": {"what": "planner", "imports": "${cls}Planner", "entry": '${cls}Planner()'},
    "files": {
        "planner.py": '''\
"""The $name planner: decides where embedding tables live and shards the model accordingly."""

from __future__ import annotations

from typing import Any

from torch import nn

from gemzoo.interfaces import Topology, WholeTables


class ${cls}Planner(WholeTables):
    """WholeTables gives the rest of the Planner protocol for tables kept whole on every rank (mesh_dims,
    attach_optimizer, replicated_parameters, sync, state_dict, load_state_dict); override what you place."""

    description = "$summary"

    def plan(self, tables: list[Any], topology: Topology) -> Any:
        """A sharding plan for ``tables`` (one config per table), or None to keep every table whole on every rank."""
        return None

    def shard(self, model: nn.Module, plan: Any, mesh: Any) -> nn.Module:
        """``model`` with its tables placed by ``plan`` (e.g. torchrec DistributedModelParallel)."""
        return model
''',
        "test": '''\
"""Planner conformance, run on the installed $name planner: plan, shard, train, checkpoint."""

import math

import gemzoo
from gemzoo.interfaces import Planner, Topology

PLANNER = gemzoo.registry.get("planner", "$name")
''' + TINY_RUN + '''

def test_registered_and_follows_the_protocol():
    assert "$name" in gemzoo.registry.names("planner")
    assert isinstance(PLANNER, Planner)


def test_plan_and_train(tmp_path):
    PLANNER.plan([], Topology(1, "cpu"))
    result = tiny_run(tmp_path, plugins="$name")
    assert math.isfinite(result.final_loss)
    assert any((tmp_path / "run" / "checkpoints").glob("step-*"))
''',
    },
}

MODEL = {
    "impl": "model",
    "summary": "a model family",
    "protocol": "`gemzoo.interfaces.RecModel`, `ModelSpec`, `ModelOutput`, `Evaluator`",
    "use": "gemzoo train --config my.toml   # with [model] family = \"$name\" and [data] source = \"synthetic-gem\"",
    "fill": "The starting point ranks GEM-like candidates (the `synthetic-gem` batches) against an attention "
            "summary of each user's history; its attention goes through `JaggedAttention`, so every attention "
            "plugin serves it. Keep `forward`, `flops`, `evaluator`, `init_weights` and `embedding_tables`.",
    "tests": "built on `meta` as the trainer does, forward and backward, FLOPs, the evaluator, and a short "
             "training run on `synthetic-gem` with two attention kernels.",
    "plugin": {"what": "model family", "core": "ModelSpec", "imports": "${cls}Config, ${cls}Model",
               "entry": 'ModelSpec(${cls}Config, ${cls}Model, "$summary")'},
    "files": {
        "model.py": '''\
"""The $name model family: scores each user's candidates against attention over the user's history."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.api import AttentionRequest, JaggedAttention, ModelOutput


@dataclass
class ${cls}Config:
    """The keys [model] accepts when family = "$name"."""

    family: str = "$name"
    d_model: int = 32
    num_heads: int = 2


class ${cls}Model(nn.Module):
    def __init__(self, cfg: ${cls}Config, info: dict):
        super().__init__()
        if cfg.d_model % cfg.num_heads:
            raise ValueError(f"d_model {cfg.d_model} must be a multiple of num_heads {cfg.num_heads}")
        self.cfg = cfg
        self.sparse_arch = None  # no pooled embedding tables: every parameter trains with AdamW
        d = cfg.d_model
        self.items = nn.Embedding(info["num_items"], d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn = JaggedAttention(AttentionRequest(causal=True))  # the trainer picks the kernel
        self.out = nn.Linear(d, d)

    def init_weights(self) -> None:
        nn.init.normal_(self.items.weight, std=0.1)
        for lin in (self.qkv, self.out):
            nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
            nn.init.zeros_(lin.bias)

    def embedding_tables(self) -> list:
        return []

    def user_vectors(self, batch) -> torch.Tensor:
        h, d = self.cfg.num_heads, self.cfg.d_model
        x = self.items(batch.history_items)
        q, k, v = self.qkv(x).view(-1, 3, h, d // h).unbind(1)
        y = x + self.out(self.attn(q, k, v, batch.history_offsets).reshape(-1, d))
        b = batch.num_samples
        owner = torch.repeat_interleave(torch.arange(b, device=y.device), batch.lengths)
        summed = torch.zeros(b, d, dtype=y.dtype, device=y.device).index_add(0, owner, y)
        return summed / batch.lengths.clamp_min(1).unsqueeze(1).to(y.dtype)  # empty history -> zeros

    def logits(self, batch) -> torch.Tensor:
        users = self.user_vectors(batch)
        owner = torch.repeat_interleave(torch.arange(batch.num_samples, device=users.device), batch.cand_lengths)
        return (users[owner] * self.items(batch.cand_items)).sum(-1) / self.cfg.d_model ** 0.5

    def forward(self, batch) -> ModelOutput:
        return ModelOutput(F.binary_cross_entropy_with_logits(self.logits(batch).float(), batch.click.float()), {})

    def flops(self, batch) -> int:
        """Forward+backward model FLOPs over real tokens (PaLM convention: backward = 2x forward)."""
        d, t = self.cfg.d_model, batch.num_tokens
        pairs = int((batch.lengths * (batch.lengths + 1) // 2).sum())  # causal (query, key) pairs
        linears = 2 * t * d * (3 * d) + 2 * t * d * d
        attention = 4 * d * pairs  # QK^T and PV, all heads
        return 3 * (linears + attention)

    def cost_model(self, batch) -> torch.Tensor:
        """Each sample's share of ``flops`` (float64, sums to it): what a batching policy balances across ranks."""
        d, n = self.cfg.d_model, batch.lengths.to(torch.float64)
        return 3 * ((2 * d * (3 * d) + 2 * d * d) * n + 4 * d * (n * (n + 1) / 2))

    def evaluator(self):
        return ClickAUC(self)


class ClickAUC:
    """Held-out click AUC (rank statistic; ties count half) over every candidate of the eval batches."""

    def __init__(self, model: ${cls}Model):
        self.model, self.scores, self.labels = model, [], []

    def update(self, batch) -> None:
        self.scores.append(self.model.logits(batch).float().cpu())
        self.labels.append(batch.click.float().cpu())

    def compute(self) -> dict[str, float]:
        s, y = torch.cat(self.scores), torch.cat(self.labels)
        pos, neg = s[y > 0.5], s[y <= 0.5]
        if pos.numel() == 0 or neg.numel() == 0:
            return {"auc_click": float("nan")}
        wins = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
        return {"auc_click": float(wins / (pos.numel() * neg.numel()))}
''',
        "test": '''\
"""Model conformance, run on the installed $name family: build on meta, step, FLOPs, evaluator, train."""

import math

import pytest
import torch

import gemzoo

SPEC = gemzoo.registry.get("model", "$name")
''' + TINY_RUN + '''

def dataset():
    spec = gemzoo.registry.get("dataset", "synthetic-gem")
    return spec.build(spec.config_cls(batch_size=8, max_len=16, median_len=8, num_items=100), 0)


def test_build_on_meta_then_step():
    data = dataset()
    with torch.device("meta"):
        model = SPEC.build(SPEC.config_cls(), data.info)
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    batch = data.train_batch(0)
    out = model(batch)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert model.flops(batch) > 0
    evaluator = model.evaluator()
    with torch.no_grad():
        for b in data.eval_batches(2):
            evaluator.update(b)
    metrics = evaluator.compute()
    assert metrics and all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize("attention", ["reference", "sdpa-padded"])
def test_trains_with_attention_plugins(tmp_path, attention):
    result = tiny_run(tmp_path, plugins=attention, model={"family": "$name"})
    assert math.isfinite(result.final_loss) and 0.0 <= result.eval["eval/auc_click"] <= 1.0
''',
    },
}

DATASET = {
    "impl": "dataset",
    "summary": "a dataset",
    "protocol": "`gemzoo.interfaces.DatasetSpec`; batches as `gemzoo.data.batch.GemBatch` for the gem family",
    "use": "gemzoo train --config my.toml   # with [data] source = \"$name\" and [model] family = \"gem\"",
    "fill": "The starting point draws its batches from the built-in `synthetic-gem` stream, so the `gem` model "
            "trains on it as generated; replace `train_batch` and `eval_batches` with your reader, returning the "
            "same batch type, and describe your data in `info` (item count, sparse tables).",
    "tests": "seeded and deterministic batches, held-out batches distinct from training ones, and a short `gem` "
             "training run on the dataset.",
    "plugin": {"what": "dataset", "core": "DatasetSpec", "imports": "${cls}Config, build",
               "entry": 'DatasetSpec(${cls}Config, build, "$summary")'},
    "files": {
        "dataset.py": '''\
"""The $name dataset: training batches by step, fixed held-out batches, and ``info`` for the model."""

from __future__ import annotations

from dataclasses import dataclass

import gemzoo


@dataclass
class ${cls}Config:
    """The keys [data] accepts when source = "$name"."""

    source: str = "$name"
    batch_size: int = 32
    max_len: int = 64
    num_items: int = 1000
    num_sparse_tables: int = 2
    sparse_table_size: int = 1000


class ${cls}Dataset:
    def __init__(self, cfg: ${cls}Config, seed: int = 0):
        # The starting point: the synthetic-gem stream. Replace with your own reader.
        base = gemzoo.registry.get("dataset", "synthetic-gem")
        self._stream = base.build(base.config_cls(batch_size=cfg.batch_size, max_len=cfg.max_len,
                                                  num_items=cfg.num_items, num_sparse_tables=cfg.num_sparse_tables,
                                                  sparse_table_size=cfg.sparse_table_size), seed)
        self.cfg, self.seed = cfg, seed
        self.info = self._stream.info  # what the model is built from: num_items, sparse_tables, ...

    def train_batch(self, step: int):
        """The training batch of ``step``: a pure function of (seed, step), so resumed runs see the same data."""
        return self._stream.train_batch(step)

    def eval_batches(self, n: int) -> list:
        """``n`` held-out batches, the same ones every call."""
        return self._stream.eval_batches(n)


def build(cfg: ${cls}Config, seed: int = 0) -> ${cls}Dataset:
    return ${cls}Dataset(cfg, seed)
''',
        "test": '''\
"""Dataset conformance, run on the installed $name dataset."""

import math

import torch

import gemzoo

SPEC = gemzoo.registry.get("dataset", "$name")
''' + TINY_RUN + '''

def same(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("history_items", "history_offsets", "cand_items"))


def test_batches_are_seeded_and_held_out_ones_differ():
    cfg = SPEC.config_cls(batch_size=8, max_len=16)
    one, two = SPEC.build(cfg, 0), SPEC.build(cfg, 0)
    assert same(one.train_batch(3), two.train_batch(3))
    assert not same(one.train_batch(3), one.train_batch(4))
    held_out = one.eval_batches(2)
    assert len(held_out) == 2 and same(held_out[0], one.eval_batches(2)[0])
    assert not any(same(h, one.train_batch(s)) for h in held_out for s in range(3))
    assert one.train_batch(0).num_samples == 8


def test_gem_trains_on_it(tmp_path):
    result = tiny_run(tmp_path, data={"source": "$name", "batch_size": 8, "max_len": 16, "num_items": 100,
                                      "sparse_table_size": 50})
    assert math.isfinite(result.final_loss) and 0.0 <= result.eval["eval/auc_click"] <= 1.0
''',
    },
}

TEMPLATES = {"attention": ATTENTION, "precision": PRECISION, "planner": PLANNER, "comms": COMMS,
             "memory": MEMORY, "batching": BATCHING, "model": MODEL, "dataset": DATASET}
_stale = set(TEMPLATES) - set(kinds.names())
assert not _stale, f"scaffold templates for kinds that gemzoo.kinds does not have: {sorted(_stale)}"
# The kinds `new-plugin --kind` offers: those of the kinds table (in its order) that have a template. A kind added
# to the table without one is simply not offered yet.
KINDS = tuple(name for name in kinds.names() if name in TEMPLATES)


def module_name(name: str) -> str:
    return "gemzoo_" + name.replace("-", "_")


def check_name(name: str, *, registry=None) -> None:
    if not NAME.match(name):
        raise ConfigError(f"plugin name {name!r}: use lower-case letters and digits, words joined by '-' "
                          "(e.g. myattn, my-fp8)")
    if keyword.iskeyword(name.replace("-", "_")):
        raise ConfigError(f"plugin name {name!r} is a Python keyword; choose another")
    if registry is not None:
        entry = registry.find(name)
        if entry is not None:
            raise PluginError(f"the name {name!r} is taken: {entry.kind} {name!r} of distribution "
                              f"{entry.distribution}. Plugin names are unique across kinds; choose another")


def render(name: str, kind: str) -> dict[str, str]:
    """Relative path -> file text of the distribution ``gemzoo-<name>`` for ``kind``."""
    if kind not in TEMPLATES:
        raise ConfigError(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
    t = TEMPLATES[kind]
    mod = module_name(name)
    words = re.split(r"[-_]", name)
    values = {"name": name, "mod": mod, "kind": kind, "func": "_".join(words),
              "cls": "".join(w[:1].upper() + w[1:] for w in words), "impl": t["impl"],
              "summary": f"{t['summary']} ({name})"}

    def sub(text: str) -> str:
        return Template(text).substitute(values)

    hook = kinds.kind(kind).hook
    plugin = t["plugin"]
    core = f"from gemzoo.api import {plugin['core']}\n" if plugin.get("core") else ""
    # Fields of the README refer to $name etc. themselves: substitute them first.
    readme_values = {k: sub(t[k]) for k in ("protocol", "use", "fill", "tests")}
    readme_values["hook"] = hook
    files = {
        "pyproject.toml": sub(PYPROJECT),
        f"{mod}/__init__.py": sub(INIT),
        f"{mod}/plugin.py": sub(Template(PLUGIN).substitute(plugin, core=core, hook=hook)),
        f"{mod}/{t['impl']}.py": sub(t["files"][f"{t['impl']}.py"]),
        f"tests/test_{mod}.py": sub(t["files"]["test"]),
        "README.md": Template(README).substitute({**values, **readme_values}),
    }
    return files


def write_plugin(name: str, kind: str, dest: str | Path = ".", *, registry=None) -> Path:
    """Write ``dest/gemzoo-<name>/``; refuses an existing folder and a name already registered."""
    check_name(name, registry=registry)
    files = render(name, kind)
    root = Path(dest) / f"gemzoo-{name}"
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another --dir or name")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# --------------------------------------------------------------------------------------------- CLI
def add_command(sub) -> None:
    n = sub.add_parser("new-plugin", help="write a plugin distribution for a kind, ready to pip install -e",
                       description="Write gemzoo-NAME/: pyproject.toml with the gemzoo entry point, the hookimpl, an "
                       "implementation that works as generated, conformance tests and a README.")
    n.add_argument("name", metavar="NAME", help="the registered name, e.g. myattn (also gemzoo-NAME, gemzoo_NAME)")
    n.add_argument("--kind", required=True, choices=KINDS)
    n.add_argument("--dir", default=".", help="where to create gemzoo-NAME/ (default: the current folder)")
    n.set_defaults(func=cmd_new_plugin)


def cmd_new_plugin(args) -> int:
    from gemzoo import registry

    root = write_plugin(args.name, args.kind, args.dir, registry=registry)
    print(f"wrote {root}/ ({args.kind} plugin {args.name!r}). Next:\n"
          f"  pip install -e {root}\n  gemzoo list {args.kind} {args.name}\n  pytest {root}/tests")
    return 0
