"""Registers the memory policy ``auto-ac``: the PT2 min-cut partitioner decides what to recompute.

``torch._functorch.config.activation_memory_budget`` (0..1) caps the activations a compiled graph saves
for backward, as a fraction of what the default (runtime-optimised) partition saves; the partitioner
solves a knapsack (``activation_memory_budget_solver``) over recomputable nodes, priced by a runtime
estimator. Options (``[plugins.options.auto-ac]``, validated by ``AutoACOptions``)::

    budget = 0.5          # fixed budget, 0 (recompute everything it can) .. 1 (torch's default partition)
    target_gib = 45.0     # or: a peak-memory target; the budget is searched over the first steps
    trials = 5            # measured steps the search may use (each new budget recompiles the model)
    tolerance_gib = 1.0   # stop searching once a fitting peak is within this much of the target
    solver = "dp"         # knapsack solver: "dp", "greedy", "ilp" (needs scipy)
    estimator = "flops"   # runtime estimator of aten ops: "flops" or "profile" (benchmarks each op, GPU)
    recompute_custom_ops = false  # custom ops (attention kernels, MX casts) are priced as very expensive,
                                  # so they are saved unless nothing else fits
    dynamic = true        # compile with dynamic shapes from the first call (jagged batches change shape
                          # every step; otherwise every new budget compiles twice)

The target search measures the fwd+bwd peak of real training steps (``torch.cuda.max_memory_allocated``;
on CPU an estimate: parameters, their gradients and the bytes saved for backward). Step 0 only warms up
(compiles, allocates optimizer state); step 1 runs at budget 0, the smallest peak reachable, and a target
below it stops the run with that figure; then budget 1, then regula falsi between the closest budgets
that fit and that do not. Every step computes the same loss whatever the budget (recompute is exact up to
reduction order), so the search costs compile time only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from gemzoo.api import ConfigError, TakesOptions, hookimpl

GEMZOO_API = ">=1,<2"

GIB = 2**30
SOLVERS = ("dp", "greedy", "ilp", "dp_knapsack_sliding_hirschberg")
ESTIMATORS = ("flops", "profile")
CUSTOM_OP_COST = 1e18  # FLOP-equivalents: more than any GEMM, so custom ops are the last thing recomputed


@dataclass
class AutoACOptions:
    budget: float | None = None
    target_gib: float | None = None
    trials: int = 5
    tolerance_gib: float = 1.0
    solver: str = "dp"
    estimator: str = "flops"
    recompute_custom_ops: bool = False
    dynamic: bool = True

    def __post_init__(self):
        where = "plugins.options.auto-ac"
        if self.budget is not None and self.target_gib is not None:
            raise ConfigError(f"{where}: give budget or target_gib, not both (budget={self.budget}, "
                              f"target_gib={self.target_gib})")
        if self.budget is not None and not 0.0 <= self.budget <= 1.0:
            raise ConfigError(f"{where}.budget must be in [0, 1] (0 recomputes all it can, 1 is torch's default "
                              f"partition), got {self.budget}")
        if self.target_gib is not None and not (self.target_gib > 0 and math.isfinite(self.target_gib)):
            raise ConfigError(f"{where}.target_gib must be a positive number of GiB, got {self.target_gib}")
        if self.trials < 2:
            raise ConfigError(f"{where}.trials must be >= 2 (budget 0 and budget 1 are always measured), "
                              f"got {self.trials}")
        if self.tolerance_gib < 0:
            raise ConfigError(f"{where}.tolerance_gib must be >= 0, got {self.tolerance_gib}")
        if self.solver not in SOLVERS:
            raise ConfigError(f"{where}.solver must be one of {', '.join(SOLVERS)}, got {self.solver!r}")
        if self.estimator not in ESTIMATORS:
            raise ConfigError(f"{where}.estimator must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}")


# ------------------------------------------------------------------------------------------ the search
@dataclass
class Trial:
    budget: float
    peak_bytes: int
    step: int

    def as_dict(self) -> dict:
        return {"budget": round(self.budget, 4), "peak_gib": round(self.peak_bytes / GIB, 3), "step": self.step}


class BudgetSearch:
    """Finds the largest budget whose measured peak meets ``target_bytes``, in at most ``trials`` measurements.

    ``budget()`` is the budget to measure next (``None`` once done); ``record(peak_bytes, step)`` adds the
    measurement. Budget 0 first (the smallest reachable peak: a target below it is a ConfigError naming
    it), then 1 (if it fits, nothing needs recomputing), then regula falsi inside the bracket
    [largest budget that fits, smallest that does not]. ``chosen`` is the answer.
    """

    def __init__(self, target_bytes: float, trials: int = 5, tolerance_bytes: float = GIB, where: str = "auto-ac"):
        self.target, self.max_trials, self.tol, self.where = float(target_bytes), trials, float(tolerance_bytes), where
        self.trials: list[Trial] = []
        self.chosen: float | None = None
        self._next: float | None = 0.0
        self.revisions = 0

    @property
    def done(self) -> bool:
        return self.chosen is not None

    def budget(self) -> float | None:
        return None if self.done else self._next

    def fits(self) -> list[Trial]:
        return [t for t in self.trials if t.peak_bytes <= self.target]

    def record(self, peak_bytes: int, step: int = -1) -> None:
        if self.done:
            raise RuntimeError("BudgetSearch.record after the search finished")
        b = self._next
        self.trials.append(Trial(b, int(peak_bytes), step))
        if len(self.trials) == 1:  # budget 0: the floor
            if peak_bytes > self.target:
                raise ConfigError(
                    f"{self.where}: target_gib = {self.target / GIB:.2f} is unreachable: the smallest peak reached "
                    f"was {peak_bytes / GIB:.2f} GiB (activation_memory_budget = 0, step {step}). Set target_gib to "
                    f"at least {math.ceil(peak_bytes / GIB * 10) / 10:.1f}, or lower the memory another way "
                    "(data.batch_size, memory = [\"act-quant\", ...], a smaller model).")
            self._next = 1.0
            return
        if len(self.trials) == 2 and peak_bytes <= self.target:  # budget 1 fits: recompute nothing extra
            self.chosen = 1.0
            return
        lo = max(self.fits(), key=lambda t: t.budget)  # budget 0 always fits here
        above = [t for t in self.trials if t.peak_bytes > self.target]
        if lo.peak_bytes >= self.target - self.tol or len(self.trials) >= self.max_trials or not above:
            self.chosen = lo.budget
            return
        hi = min(above, key=lambda t: t.budget)
        span = hi.peak_bytes - lo.peak_bytes
        frac = (self.target - lo.peak_bytes) / span if span > 0 else 0.5
        # regula falsi, kept off the bracket's ends so a bent curve still shrinks the bracket
        frac = min(max(frac, 0.1), 0.9)
        nxt = lo.budget + frac * (hi.budget - lo.budget)
        if hi.budget - lo.budget < 1e-3:
            self.chosen = lo.budget
            return
        self._next = nxt


    def revise(self, peak_bytes: int, step: int = -1) -> bool:
        """After the search, a step at the chosen budget peaked above the target: a larger batch than the
        trials saw (jagged batches vary in tokens, and activations scale with them). That peak becomes the
        chosen budget's, and every larger budget's, measured peak; the search measures once more below it and
        chooses again. At most ``trials`` revisions a run; True when the search goes on."""
        if not self.done or peak_bytes <= self.target or self.revisions >= self.max_trials or self.chosen == 0.0:
            return False
        self.revisions += 1
        hi = self.chosen
        for t in self.trials:
            if t.budget >= hi:
                t.peak_bytes = max(t.peak_bytes, int(peak_bytes))
        self.trials.append(Trial(hi, int(peak_bytes), step))
        lo = max((t for t in self.trials if t.peak_bytes <= self.target), key=lambda t: t.budget)
        span = peak_bytes - lo.peak_bytes
        frac = min(max((self.target - lo.peak_bytes) / span if span > 0 else 0.5, 0.1), 0.9)
        self.chosen, self._next = None, lo.budget + frac * (hi - lo.budget)
        return True


# ------------------------------------------------------------------------------------------ compiler glue
def _custom_estimator(aten_mode: str, recompute_custom_ops: bool):
    """A CustomRuntimeEstimator: aten ops by ``aten_mode``; non-aten custom ops (opaque to FlopCounterMode,
    which would count them as free) at CUSTOM_OP_COST unless ``recompute_custom_ops``. None if this torch
    has no CustomRuntimeEstimator."""
    try:
        from torch._inductor.custom_graph_pass import CustomRuntimeEstimator
    except ImportError:
        return None
    from torch._functorch import config as fconfig
    from torch._functorch import partitioners

    class GemzooRuntimeEstimator(CustomRuntimeEstimator):
        def __call__(self, node) -> float:
            target = node.target
            if (not recompute_custom_ops and isinstance(target, torch._ops.OpOverload)
                    and target.namespace not in ("aten", "prims", "_c10d_functional", "c10d_functional")):
                return CUSTOM_OP_COST
            with fconfig.patch(activation_memory_budget_runtime_estimator=aten_mode):
                return float(partitioners.estimate_runtime(node))

        def uuid(self):
            return ("gemzoo-auto-ac", "estimator-v1", aten_mode, recompute_custom_ops)

    return GemzooRuntimeEstimator()


def set_budget(budget: float) -> None:
    torch._functorch.config.activation_memory_budget = float(budget)


def recompile() -> None:
    """Drop every compiled graph, so the next call partitions again under the current budget."""
    torch._dynamo.reset()


def _top_hooks():
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True)
    except (AttributeError, TypeError):
        return None


class SavedBytes:
    """Counts the bytes saved for backward while active (unique storages, parameters excluded).

    It chains onto the saved-tensor hooks active when entered (counting what those pack), so a
    policy whose hooks sit below (e.g. act-quant listed earlier) is measured after packing."""

    def __init__(self, skip_storages: set[int] = frozenset()):
        self.skip = set(skip_storages)
        self.bytes = 0
        self.tensors = 0
        self._seen: set[int] = set()
        self._ctx = None

    def _count(self, obj) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.device.type == "meta":
                return
            st = obj.untyped_storage()
            key = st.data_ptr()
            if key in self.skip or key in self._seen:
                return
            self._seen.add(key)
            self.bytes += st.nbytes()
            self.tensors += 1
        elif isinstance(obj, (tuple, list)):
            for o in obj:
                self._count(o)
        elif hasattr(obj, "__dict__"):  # a packed object (e.g. act-quant's Packed: fp8 data and scales)
            for o in vars(obj).values():
                if isinstance(o, (torch.Tensor, tuple, list)):
                    self._count(o)

    def __enter__(self) -> SavedBytes:
        inner = _top_hooks()
        inner_pack, inner_unpack = inner if inner else (None, None)

        @torch.compiler.disable  # autograd calls hooks from eager code inside compiled frames: never trace them
        def pack(t):
            packed = inner_pack(t) if inner_pack is not None else t
            self._count(packed)
            return packed

        @torch.compiler.disable
        def unpack(p):
            return inner_unpack(p) if inner_unpack is not None else p

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


def _storages(model: nn.Module) -> tuple[set[int], int]:
    keys, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta" or t.layout != torch.strided:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in keys:
            keys.add(st.data_ptr())
            total += st.nbytes()
    return keys, total


# ------------------------------------------------------------------------------------------ the policy
class AutoACPolicy(TakesOptions):
    """Compiler-chosen activation checkpointing: a fixed ``budget`` or one searched to meet ``target_gib``."""

    options_cls = AutoACOptions
    needs_compile = True
    description = "compiler-chosen recompute under torch._functorch activation_memory_budget (budget or target_gib)"

    def __init__(self, options: AutoACOptions | None = None):
        super().__init__(options)
        self._reset_state()

    def _reset_state(self) -> None:
        o = self.options
        self.search = None if o.target_gib is None else BudgetSearch(o.target_gib * GIB, o.trials,
                                                                     o.tolerance_gib * GIB)
        self.current = 0.0 if self.search is not None else (0.5 if o.budget is None else o.budget)
        self.step_index = 0
        self.peak_after: int | None = None
        self.saved_bytes: int | None = None
        self.saved_tensors: int | None = None
        self.estimator_note = ""
        self._reset_pending = False
        self._probe_at = 1
        self.device = torch.device("cpu")
        self._param_keys: set[int] = set()
        self._static_bytes = 0

    # -- MemoryPolicy -------------------------------------------------------------------------------
    def apply(self, model: nn.Module, cfg=None) -> nn.Module:
        self._reset_state()
        o = self.options
        fc = torch._functorch.config
        fc.activation_memory_budget_solver = o.solver
        est = _custom_estimator(o.estimator, o.recompute_custom_ops)
        if est is None:
            fc.activation_memory_budget_runtime_estimator = o.estimator
            self.estimator_note = (f"{o.estimator} (this torch has no CustomRuntimeEstimator: custom ops are priced "
                                   "as free and may be recomputed first)")
        else:
            fc.activation_memory_budget_runtime_estimator = est
            self.estimator_note = f"{o.estimator}; custom ops " + ("by flops" if o.recompute_custom_ops else "saved first")
        if o.dynamic:
            torch._dynamo.config.assume_static_by_default = False  # jagged: a new shape every step
        set_budget(self.current)
        recompile()  # graphs compiled under another budget must not be reused
        param = next(iter(model.parameters()), None)
        if param is not None and param.device.type != "meta":
            self.device = param.device
        self._param_keys, param_bytes = _storages(model)
        self._static_bytes = 2 * param_bytes  # parameters + gradients (the CPU estimate)
        return model

    def step_context(self):
        return self._step()

    @contextlib.contextmanager
    def _step(self):
        step = self.step_index
        search = self.search
        measuring = search is not None and not search.done and step >= 1  # step 0 warms up (compile, opt state)
        cuda = self.device.type == "cuda"
        # The caching allocator counts on the host, as the step allocates: its peak needs no wait for the GPU,
        # so this policy does not stop the trainer queueing steps ahead (run.sync = "log").
        if cuda and (measuring or self._reset_pending):
            torch.cuda.reset_peak_memory_stats(self.device)
            self._reset_pending = False
        probe = measuring or step == self._probe_at
        counter = SavedBytes(self._param_keys) if probe else contextlib.nullcontext()
        with counter:
            yield
        self.step_index += 1
        if probe and counter.tensors:
            self.saved_bytes, self.saved_tensors = counter.bytes, counter.tensors
        if cuda:
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = self._static_bytes + (counter.bytes if probe else (self.saved_bytes or 0))
        if not measuring:
            if search is None or search.done:
                self.peak_after = max(self.peak_after or 0, peak)
            if search is not None and search.done and cuda and search.revise(peak, step):
                print(f"auto-ac: step {step} peaked at {peak / GIB:.2f} GiB at budget {self.current:.3f}, over "
                      f"target_gib = {self.options.target_gib:g} (a larger batch than the trials saw); measuring "
                      f"budget {search.budget():.3f}", flush=True)
                self.peak_after = None
                self.current = search.budget()
                set_budget(self.current)
                recompile()
            return
        search.record(peak, step)
        nxt = search.chosen if search.done else search.budget()
        if search.done:
            print(f"auto-ac: {self.summary()}", flush=True)
            self._probe_at = self.step_index  # count what the chosen budget saves
            self._reset_pending = True
        if nxt != self.current:
            self.current = nxt
            set_budget(nxt)
            recompile()

    # -- reporting ----------------------------------------------------------------------------------
    def summary(self) -> str:
        if self.search is None:
            text = f"activation_memory_budget = {self.current:g} (fixed)"
        elif not self.search.done:
            text = f"searching a budget for target_gib = {self.options.target_gib:g} (now {self.current:.3f})"
        else:
            trials = ", ".join(f"{t.budget:.3f} -> {t.peak_bytes / GIB:.2f} GiB" for t in self.search.trials)
            text = (f"chose activation_memory_budget = {self.search.chosen:.3f} for target_gib = "
                    f"{self.options.target_gib:g} (trials: {trials})")
        if self.saved_bytes is not None:
            text += f"; {self.saved_bytes / GIB:.2f} GiB saved for backward per step"
        if self.peak_after is not None and self.device.type == "cuda":
            text += f"; peak {self.peak_after / GIB:.2f} GiB"
        return text

    def report(self) -> dict:
        s = self.search
        return {
            "budget": self.current if s is None or not s.done else s.chosen,
            "source": "budget" if s is None else "target_gib",
            "target_gib": self.options.target_gib,
            "trials": [] if s is None else [t.as_dict() for t in s.trials],
            "searching": bool(s is not None and not s.done),
            "saved_for_backward_bytes_per_step": self.saved_bytes,
            "saved_for_backward_tensors": self.saved_tensors,
            "peak_gib_after_search": None if self.peak_after is None else round(self.peak_after / GIB, 3),
            "peak_is_estimate": self.device.type != "cuda",
            "estimator": self.estimator_note,
            "solver": self.options.solver,
            "summary": self.summary(),
        }


@hookimpl
def gemzoo_register_memory(register):
    register("auto-ac", AutoACPolicy())
