"""Registers the memory policy ``act-quant``: tensors saved for backward are kept in fp8.

Inside each forward+backward, ``torch.autograd.graph.saved_tensors_hooks`` packs every eligible saved
tensor into fp8 (``gemzoo_act_quant.quant``) and unpacks it back to its own dtype and shape when backward
needs it. Options (``[plugins.options.act-quant]``, validated by ``ActQuantOptions``)::

    modules = ["*"]       # fnmatch patterns on module names whose saved tensors are quantized ("" = the root)
    exclude = []          # patterns never quantized, e.g. ["head.*", "*.attn.attn"]
    min_numel = 4096      # smaller tensors stay as they are
    elem = "e4m3"         # element format: "e4m3" or "e5m2"
    scale = "auto"        # "row" (a power of two per row), "block32" (per 32 along the last dim; the MX
                          # cast of gemzoo-mxfp8 when installed), "auto" (block32 with gemzoo-mxfp8, else row)
    fp32 = "auto"         # fp32 saved tensors too: "always", "never", "auto" (eager: yes; compiled: only
                          # token-major ones, [>= 1024, ..., >= 32], so statistics like lse [H, T] stay)
    attention = false     # also what attention sites save (q, k, v): their backward recomputes P and
                          # rowsum(dO * O), where fp8 error in v and O does not average out
    inline = true         # compiled graphs: the casts run inside the graphs (PT2 inlines GraphModule
                          # saved-tensor hooks into the forward's epilogue and the backward's prologue, so
                          # Inductor fuses them); false: eager hooks between the graphs, as outside them

Never quantized: integer and bool tensors (offsets, indices, masks), sparse tensors and tensor subclasses,
tensors already in 8 bits (mxfp8's saved MX data and scales: no double quantization), parameters and
their casts/views (the weight a linear saves), rows narrower than 32, and in eager mode tensors outside
autograd's graph (softmax log-sum-exp, norm statistics: quantizing them would distort every gradient
downstream). Each kind of skip is said once. With ``full-ac`` the checkpointed blocks save nothing but
their inputs, so act-quant quantizes what is still saved; with ``auto-ac`` (compiled graphs) it quantizes
what the partitioner decided to save. Module patterns are resolved from module forward hooks, which
compiled graphs do not run: under ``torch.compile`` every eligible tensor the graphs save is quantized
(fp32 ones only when token-major with fp32 = "auto") and the report lists them by shape instead of module.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import sys
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from gemzoo.api import ConfigError, TakesOptions, attention_sites, hookimpl
from gemzoo_act_quant.quant import (
    ELEMS,
    FP8_DTYPES,
    SCALES,
    Packed,
    dequantize,
    mx_api,
    quantize,
    quantize_blocks,
    quantize_rows,
    resolve_scale,
)

GEMZOO_API = ">=1,<2"

GIB = 2**30
MIN_ROW = 32
# autograd nodes that only view or cast their input: a saved tensor reached from a parameter through
# these is the parameter itself (e.g. a bf16 linear's weight.to(bf16).t())
_PASS_THROUGH = ("ToCopyBackward", "TBackward", "ViewBackward", "TransposeBackward", "PermuteBackward",
                 "ExpandBackward", "UnsqueezeBackward", "SqueezeBackward", "AliasBackward", "CloneBackward")
FP32_MODES = ("auto", "always", "never")


@dataclass
class ActQuantOptions:
    modules: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)
    min_numel: int = 4096
    elem: str = "e4m3"
    scale: str = "auto"
    fp32: str = "auto"
    attention: bool = False
    inline: bool = True

    def __post_init__(self):
        where = "plugins.options.act-quant"
        for name in ("modules", "exclude"):
            v = getattr(self, name)
            if isinstance(v, str) or not all(isinstance(p, str) for p in v):
                raise ConfigError(f"{where}.{name} must be a list of fnmatch patterns on module names, e.g. "
                                  f"[\"tower.blocks.*\"], got {v!r}")
        if self.min_numel < 0:
            raise ConfigError(f"{where}.min_numel must be >= 0, got {self.min_numel}")
        if self.elem not in ELEMS:
            raise ConfigError(f"{where}.elem must be one of {', '.join(ELEMS)}, got {self.elem!r}")
        if self.scale not in SCALES:
            raise ConfigError(f"{where}.scale must be one of {', '.join(SCALES)}, got {self.scale!r}")
        if self.fp32 not in FP32_MODES:
            raise ConfigError(f"{where}.fp32 must be one of {', '.join(FP32_MODES)}, got {self.fp32!r}")


SKIP_NOTES = {
    "integer": "integer/bool saved tensors (offsets, indices, masks) are kept as they are",
    "sparse": "sparse saved tensors are kept as they are (no fp8 layout for them)",
    "subclass": "tensor subclasses (DTensor, ...) among the saved tensors are kept as they are",
    "8-bit": "saved tensors already in 8 bits (e.g. mxfp8's MX data and scales) are kept as they are, not quantized twice",
    "fp32": "fp32 saved tensors that are not token-major are kept (in compiled graphs they may be statistics)",
    "statistic": "saved tensors outside autograd's graph (softmax log-sum-exp, norm statistics) are kept exact",
    "custom-op output": "outputs of custom ops saved for their own backward (attention outputs: a flash-style "
                        "backward takes rowsum(dO * O), which fp8 error in O would swamp) are kept exact",
}


def _derived_from_parameter(t: torch.Tensor, depth: int = 4) -> bool:
    fn = t.grad_fn
    for _ in range(depth):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return True
        if not type(fn).__name__.startswith(_PASS_THROUGH):
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


def inline_supported() -> bool:
    """Whether this torch inlines GraphModule saved-tensor hooks into compiled graphs (AOTAutograd)."""
    utils = getattr(getattr(torch._functorch, "_aot_autograd", None), "utils", None)
    return callable(getattr(utils, "saved_tensors_hooks_are_inlineable", None))


def _hook_module(fn, cache_hash: str) -> torch.fx.GraphModule:
    """A saved-tensor hook AOTAutograd can inline: a GraphModule whose one node calls ``fn`` (plain Python,
    traced on fake tensors once per saved tensor of each graph when a graph compiles, and run as is by eager
    autograd outside the graphs). The node is marked as an fx.wrap call with ``cache_hash``, so compiled
    graphs stay cacheable and a change of options or of this file compiles anew rather than reusing a graph
    made with other casts."""
    graph = torch.fx.Graph()
    out = graph.call_function(fn, (graph.placeholder("x"),))
    out.meta["is_wrapped"] = True
    out.meta["user_cache_hash"] = cache_hash
    graph.output(out)
    return torch.fx.GraphModule(nn.Module(), graph)


@functools.cache
def _source_hash() -> str:
    import hashlib
    import pathlib

    return hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:16]


def _dtype_skip(t: torch.Tensor) -> str | None:
    """The dtype rules, eager and traced alike: no integers or bools, nothing already in 8 bits."""
    if not t.is_floating_point():
        return "integer"
    if t.dtype in FP8_DTYPES or t.element_size() < 2:
        return "8-bit"
    return None


def _hint(v) -> int | None:
    """A size as the traced example has it, without a guard on it (None: symbolic with no example)."""
    if isinstance(v, torch.SymInt):
        return None if v.node.hint is None else int(v.node.hint)
    return int(v)


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(t, torch.Tensor) and is_fake(t)


class _Stats:
    def __init__(self):
        self.by_key: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # tensors, bytes before, bytes after
        self.skipped: dict[str, int] = defaultdict(int)

    def add(self, key: str, before: int, after: int) -> None:
        row = self.by_key[key]
        row[0] += 1
        row[1] += before
        row[2] += after

    @property
    def before(self) -> int:
        return sum(r[1] for r in self.by_key.values())

    @property
    def after(self) -> int:
        return sum(r[2] for r in self.by_key.values())


class ActQuantPolicy(TakesOptions):
    """Saved activations in fp8 through saved_tensors_hooks (see the module docstring)."""

    options_cls = ActQuantOptions
    grad_rtol = 0.06  # loss and every gradient within 6% of unquantized (gemzoo.testing.memory checks it)
    description = "tensors saved for backward stored in fp8 (e4m3, power-of-two row or MX block scales)"

    def __init__(self, options: ActQuantOptions | None = None):
        super().__init__(options)
        self.elem = ELEMS[self.options.elem]
        self.compiled = False
        self.said: set[str] = set()
        self._names: list[str] = []
        self._handles = []
        self._param_keys: set[int] = set()
        self._attention: set[str] = set()
        self.last = _Stats()
        self.steps = 0
        self.inlined = False
        self.traced = _Stats()  # what the inlined hooks put into compiled graphs (per graph, at trace time)
        self._step_state: tuple | None = None
        o = self.options
        key = f"act-quant {_source_hash()} {o.elem} {resolve_scale(o.scale)} {o.min_numel} {o.fp32}"
        self._hooks = (_hook_module(self._pack_hook, key + " pack"), _hook_module(self._unpack_hook, key + " unpack"))

    # -- MemoryPolicy -------------------------------------------------------------------------------
    def apply(self, model: nn.Module, cfg=None) -> nn.Module:
        run = getattr(cfg, "run", None)
        self.compiled = bool(getattr(run, "compile", False))
        self.said, self.last, self.steps = set(), _Stats(), 0  # a new run: its own report, its own notes
        self.traced = _Stats()
        self.inlined = self.compiled and self.options.inline and inline_supported()
        if self.compiled and self.options.inline and not self.inlined:
            self._say("inline", f"act-quant: torch {torch.__version__} does not inline saved-tensor hooks into "
                                "compiled graphs; the casts run as eager hooks between them")
        self._param_keys = {p.untyped_storage().data_ptr() for p in model.parameters()
                            if p.device.type != "meta" and p.layout == torch.strided}
        for h in self._handles:
            h.remove()
        self._handles = []
        self._attention = set(attention_sites(model))
        if not self.compiled:  # eager: track the running module for the fnmatch patterns
            for name, module in model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._handles.append(module.register_forward_hook(self._leave_module, always_call=True))
        elif self.options.modules != ["*"] or self.options.exclude:
            self._say("compiled", "act-quant: module patterns cannot be resolved inside torch.compile graphs; every "
                                  "eligible tensor the compiled graphs save is quantized")
        return model

    def _enter_module(self, name: str):
        def hook(module, args):
            self._names.append(name)
        return hook

    def _leave_module(self, module, args, output):
        if self._names:
            self._names.pop()

    def step_context(self):
        return self._step()

    @contextlib.contextmanager
    def _step(self):
        self._names.clear()
        stats = _Stats()
        cache: dict[tuple, tuple] = {}
        kept: dict[int, weakref.ref] = {}
        if self.inlined:  # the same two GraphModules every step: the compiled graphs keep their inlined casts
            self._step_state = (stats, cache, kept)
            pack, unpack = self._hooks
        else:
            pack = torch.compiler.disable(lambda t: self._pack(t, stats, cache, kept))
            unpack = torch.compiler.disable(self._unpack)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._step_state = None
        cache.clear()
        kept.clear()
        self.last = stats
        self.steps += 1

    # -- the inlined hooks (compiled graphs) ------------------------------------------------------------
    def _pack_hook(self, t):
        if not _is_fake(t):  # eager autograd outside the compiled graphs: the ordinary hook
            if self._step_state is None:
                return t
            return self._pack(t, *self._step_state)
        # tracing a graph's saved tensor (fake): only what the metadata tells; the graph keeps it every step
        reason = self._skip_reason_traced(t)
        if reason is not None:
            self.traced.skipped[reason] += 1
            return t
        scale = resolve_scale(self.options.scale)
        packed = quantize_rows(t, self.elem) if scale == "row" else quantize_blocks(t, self.elem)
        self.traced.add(f"<graph> {str(t.dtype).removeprefix('torch.')}[{t.dim()}d x{t.shape[-1]}]", 0, 0)
        # dtype and layout travel as an empty tensor (a hook gives tensors, symbolic scalars or constants):
        # 1-D for row scales, 2-D for blocks of 32, whose [..., n / 32, 32] data unpacks back to [..., n]
        like = torch.empty((0,) if scale == "row" else (0, MIN_ROW), dtype=t.dtype, device=t.device)
        return packed.data, packed.scale, like

    def _unpack_hook(self, p):
        if isinstance(p, tuple):
            data, e, like = p
            y = data.float() * torch.exp2(e.float())
            return (y.flatten(-2) if like.dim() == 2 else y).to(like.dtype)
        return self._unpack(p)

    def _skip_reason_traced(self, t: torch.Tensor) -> str | None:
        """The eager rules that metadata can decide, on the example sizes (no guards: a graph decides once)."""
        dtype_reason = _dtype_skip(t)
        if dtype_reason is not None:
            return dtype_reason
        if t.dim() < 2 or isinstance(t.shape[-1], torch.SymInt):
            return "small"
        rows, numel = _hint(t.shape[0]), _hint(t.numel())
        if t.shape[-1] < MIN_ROW or t.shape[-1] % MIN_ROW or (numel is not None and numel < max(self.options.min_numel, 1)):
            return "small"
        if t.dtype == torch.float32:
            mode = self.options.fp32
            if mode == "never" or (mode == "auto" and (rows is None or rows < 1024)):
                return "fp32"
        if not t.is_contiguous():
            return "strided"
        return None

    # -- hooks --------------------------------------------------------------------------------------
    def _say(self, key: str, message: str) -> None:
        if key not in self.said:
            self.said.add(key)
            print(message, file=sys.stderr, flush=True)

    def _skip_reason(self, t: torch.Tensor) -> str | None:
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            return "subclass"
        if t.layout != torch.strided:
            return "sparse"
        dtype_reason = _dtype_skip(t)
        if dtype_reason is not None:
            return dtype_reason
        if t.device.type == "meta":
            return "meta"
        if t.untyped_storage().data_ptr() in self._param_keys or _derived_from_parameter(t):
            return "parameter"
        if t.numel() < max(self.options.min_numel, 1) or t.dim() == 0 or t.shape[-1] < MIN_ROW:
            return "small"
        if t.dtype == torch.float32:
            mode = self.options.fp32
            # compiled graphs give no autograd context: "auto" takes fp32 tensors only when token-major
            # ([tokens >= 1024, ..., >= 32]); head-major statistics such as attention's lse [H, T] stay
            if mode == "never" or (mode == "auto" and self.compiled and (t.dim() < 2 or t.shape[0] < 1024)):
                return "fp32"
        if not self.compiled and not t.requires_grad:
            return "statistic"
        if not self.compiled and type(t.grad_fn).__name__.startswith("GeneratedBackwardFor_"):
            return "custom-op output"
        return None

    def _module(self) -> str:
        return self._names[-1] if self._names else ""

    def _selected(self, name: str) -> bool:
        o = self.options
        return (any(fnmatch.fnmatchcase(name, p) for p in o.modules)
                and not any(fnmatch.fnmatchcase(name, p) for p in o.exclude))

    def _pack(self, t: torch.Tensor, stats: _Stats, cache: dict, kept: dict):
        reason = self._skip_reason(t)
        if reason is None and not self.compiled:
            module = self._module()
            if not self.options.attention and module in self._attention:
                reason = "attention"
            elif not self._selected(module):
                reason = "pattern"
        storage = t.untyped_storage().data_ptr() if t.layout == torch.strided and type(t) is torch.Tensor else None
        if reason is None and storage in kept and kept[storage]() is not None:
            reason = "shared"  # another saved view keeps this storage exact: an fp8 copy would only add bytes
        if reason is not None:
            if storage is not None and reason not in ("parameter", "small", "integer", "8-bit", "shared"):
                kept[storage] = weakref.ref(t)
            stats.skipped[reason] += 1
            if reason in SKIP_NOTES:
                self._say(reason, f"act-quant: {SKIP_NOTES[reason]} (first: {str(t.dtype).removeprefix('torch.')} "
                                  f"{list(t.shape)})")
            return t
        # the same tensor saved by several ops is packed once; the weak reference makes sure a hit is that
        # very tensor, not a new one that reuses a freed address
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               t._version)
        hit = cache.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        before = t.numel() * t.element_size()
        with torch.no_grad(), torch.profiler.record_function("act_quant.pack"):
            packed = quantize(t.detach(), self.elem, self.options.scale)
        cache[key] = (weakref.ref(t), packed)
        where = self._module() if not self.compiled else "<compiled>"
        stats.add(f"{where or '<root>'} {str(t.dtype).removeprefix('torch.')}[{t.dim()}d x{t.shape[-1]}]",
                  before, packed.nbytes)
        return packed

    @staticmethod
    def _unpack(p):
        if isinstance(p, Packed):
            with torch.no_grad(), torch.profiler.record_function("act_quant.unpack"):
                return dequantize(p)
        return p

    # -- reporting ----------------------------------------------------------------------------------
    def report(self) -> dict:
        s = self.last
        saved = s.before - s.after
        scale = resolve_scale(self.options.scale)
        cast = ("gemzoo_mxfp8 MX cast" if scale == "block32" and mx_api() is not None
                else f"torch power-of-two {scale}")
        quantized = {k: {"tensors": v[0], "bytes": v[1], "fp8_bytes": v[2]}
                     for k, v in sorted(s.by_key.items(), key=lambda kv: -kv[1][1])}
        summary = (f"{sum(v[0] for v in s.by_key.values())} saved tensors a step in {self.options.elem} "
                   f"({cast}): {s.before / GIB:.3f} -> {s.after / GIB:.3f} GiB, {saved / GIB:.3f} GiB saved per step"
                   + (f"; skipped {dict(s.skipped)}" if s.skipped else ""))
        inlined = {k: v[0] for k, v in sorted(self.traced.by_key.items())}
        if self.inlined:
            counted = (f"{sum(inlined.values())} saved tensors are cast (counted per graph compiled)" if inlined
                       else "the saved tensors are cast (graphs from the compile cache: not counted)")
            summary = (f"inside the compiled graphs {counted}, torch power-of-two {scale} fused by Inductor; "
                       "outside them " + summary)
        return {"elem": self.options.elem, "scale": scale, "cast": cast, "compiled": self.compiled,
                "inlined": self.inlined, "inlined_per_graph": inlined, "inlined_skipped": dict(self.traced.skipped),
                "bytes_before_per_step": s.before, "bytes_after_per_step": s.after, "bytes_saved_per_step": saved,
                "quantized": quantized, "skipped": dict(s.skipped), "steps": self.steps, "summary": summary}

    def selection(self) -> dict:
        """What ``gemzoo config show`` lists: the options that pick the quantized tensors."""
        o = self.options
        return {"modules": list(o.modules), "exclude": list(o.exclude), "min_numel": o.min_numel,
                "elem": o.elem, "scale": resolve_scale(o.scale), "fp32": o.fp32, "attention": o.attention,
                "never": ["integer/bool", "sparse", "subclasses", "8-bit (e.g. mxfp8's own)", "parameters",
                          f"rows narrower than {MIN_ROW}", "tensors outside autograd's graph (eager)",
                          "custom-op outputs saved for their own backward (eager)"]}


@hookimpl
def gemzoo_register_memory(register):
    register("act-quant", ActQuantPolicy())
