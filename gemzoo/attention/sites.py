"""Attention sites: the ``nn.Module`` through which a model calls attention, and the kernel wrapper plugins
register.

A model calls attention only through :class:`JaggedAttention` modules, its named *sites*; the trainer gives
each site a kernel ([plugins.attention_sites], else [plugins] attention), and policies (mxfp8's attention,
act-quant) find them with :func:`attention_sites`. :class:`FunctionKernel` wraps a plain function as a
registrable kernel, with an optional CPU fallback looked up in the registry.

A site whose request has ``relative_bias`` passes its :class:`RelativeAttentionBias` to a kernel that declares
``relative_bias`` (computed inside the kernel's tiles); to a kernel that declares only ``bias`` (e.g.
``sdpa-padded``) it passes the bias materialised as a padded [B, 1, Lq, Lk] tensor
(:func:`materialize_relative_bias`). :func:`site_missing` is the assembly-time check that accepts either.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from gemzoo import registry
from gemzoo.attention.checks import check_inputs
from gemzoo.attention.semantics import materialize_relative_bias
from gemzoo.errors import PluginError
from gemzoo.interfaces.attention import AttentionCapabilities, AttentionRequest
from gemzoo.jagged import max_length


@dataclass
class FunctionKernel:
    """Wrap a plain function as a kernel with capabilities (the usual way to register one).

    ``cpu_fallback`` names a registered kernel that serves CPU tensors (``reference`` when that one is not
    registered), for GPU-only kernels that still run a config anywhere. The call is first checked
    against *this* kernel's capabilities, so the fallback never accepts what this kernel does not declare.
    """

    fn: object
    capabilities: AttentionCapabilities = field(default_factory=AttentionCapabilities)
    description: str = ""
    cpu_fallback: str | None = None
    _cpu_kernel: object = field(default=None, init=False, repr=False, compare=False)
    _accepts: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)
    _undeclared: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        self._accepts = accepted_keywords(self.fn)
        self._undeclared = tuple(name for name, flag in CAPABILITY_OF_OPTION.items()
                                 if not getattr(self.capabilities, flag))

    def __call__(self, q, k, v, q_offsets, k_offsets=None, **kw):
        if self.cpu_fallback is not None and q.device.type == "cpu":
            check_inputs(q, k, v, q_offsets, k_offsets, capabilities=self.capabilities, kernel=self, **kw)
            return self._fallback()(q, k, v, q_offsets, k_offsets, **kw)
        if any(kw.get(name) is not None for name in self._undeclared) or (
                not self.capabilities.grouped_kv and _grouped(q, k)):  # raises PluginError naming who can
            check_inputs(q, k, v, q_offsets, k_offsets, capabilities=self.capabilities, kernel=self, **kw)
        if self._accepts is not None and any(name not in self._accepts for name in kw):
            kw = self._known_options(q, k, v, q_offsets, k_offsets, kw)
        return self.fn(q, k, v, q_offsets, k_offsets, **kw)

    def _known_options(self, q, k, v, q_offsets, k_offsets, kw: dict) -> dict:
        """``kw`` without the options ``fn`` does not take, so that a kernel written before an option existed
        keeps working: an option left at ``None`` (off) is dropped; one that is set is checked against the
        declared capabilities, which raises :class:`PluginError` naming the kernels that can serve it."""
        unknown = [name for name in kw if name not in self._accepts]
        if any(kw[name] is not None for name in unknown):
            check_inputs(q, k, v, q_offsets, k_offsets, capabilities=self.capabilities, kernel=self, **kw)
            taken = ", ".join(name for name in unknown if kw[name] is not None)
            name = getattr(self.fn, "__name__", type(self.fn).__name__)
            raise PluginError(f"attention kernel function {name}() takes no {taken} argument, though its "
                              "capabilities declare it; add it to the function's signature or drop the capability")
        return {name: value for name, value in kw.items() if name in self._accepts}

    def _fallback(self):
        """The CPU kernel, looked up in the registry once."""
        if self._cpu_kernel is None:
            name = self.cpu_fallback if self.cpu_fallback in registry.names("attention") else "reference"
            self._cpu_kernel = registry.get("attention", name)
        return self._cpu_kernel


def _grouped(q, k) -> bool:
    """k has fewer heads than q (grouped k/v): served only by kernels that declare ``grouped_kv``."""
    return (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 3 == k.dim()
            and q.shape[1] != k.shape[1])


# the options a kernel may take only with the capability beside them; FunctionKernel refuses them otherwise,
# whether or not its function would accept the argument (and k/v with fewer heads than q without grouped_kv)
CAPABILITY_OF_OPTION = {"bias": "bias", "relative_bias": "relative_bias", "rope_theta": "rotary",
                        "window": "window", "block_size": "block"}


def accepted_keywords(fn) -> frozenset[str] | None:
    """The keyword arguments ``fn`` takes, or ``None`` when it takes any (``**kwargs``) or has no signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C++ function without a Python signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params
                     if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def served_request(req: AttentionRequest, capabilities: AttentionCapabilities) -> AttentionRequest:
    """``req`` as a site passes it to a kernel with ``capabilities``: a relative bias goes materialised, as
    ``bias``, to a kernel that declares ``bias`` but not ``relative_bias``."""
    if req.relative_bias and not capabilities.relative_bias and capabilities.bias:
        return req.replace(relative_bias=False, bias=True)
    return req


def site_missing(capabilities: AttentionCapabilities, req: AttentionRequest) -> list[str]:
    """What a site's ``req`` needs that a kernel with ``capabilities`` lacks, given what the site adapts (a
    relative bias is served by ``relative_bias`` or, materialised, by ``bias``)."""
    missing = capabilities.missing(served_request(req, capabilities))
    return [("relative_bias (fused relative position/time bias) or bias (additive attention bias)"
             if m.startswith("relative_bias") else m) for m in missing]


def site_kernels_that_serve(req: AttentionRequest) -> list[str]:
    """Registered attention kernels that can serve a site's ``req`` (for error messages)."""
    return [n for n in registry.names("attention") if not site_missing(registry.get("attention", n).capabilities, req)]


# A model calls attention only through JaggedAttention modules, its named *sites*; the trainer gives each site
# a kernel ([plugins.attention_sites], else [plugins] attention), and policies (mxfp8's attention, act-quant)
# find them with attention_sites(model). Model plugins build their sites from here.

class JaggedAttention(nn.Module):
    """The one place a model calls attention. The trainer picks the kernel for each site by name.

    ``request`` says what the site needs (activation, causal, asymmetric...); the trainer checks it
    against the chosen kernel's capabilities and fails at assembly time if the kernel lacks something.
    """

    def __init__(self, request: AttentionRequest, **options):
        super().__init__()
        self.request = request
        self.options = options  # fixed keyword options: window, block_size, norm, scale...
        self.kernel_name = "reference"
        self._kernel = None
        self._output_checked = False
        self.add_options()

    def add_options(self, **options) -> None:
        """Add fixed options; the request then asks for what they need (window, block, rotary), so the
        assembly check requires a kernel that declares them."""
        self.options.update(options)
        o = self.options
        self.request = self.request.replace(window=self.request.window or o.get("window") is not None,
                                            block=self.request.block or o.get("block_size") is not None,
                                            rotary=self.request.rotary or o.get("rope_theta") is not None)

    def mask_options(self) -> dict:
        """The options that change which pairs are allowed (for FLOP counts)."""
        return {k: self.options.get(k) for k in ("block_size", "window")}

    @property
    def kernel(self):
        if self._kernel is None:
            self._kernel = registry.get("attention", self.kernel_name)
        return self._kernel

    def set_kernel(self, name: str, kernel) -> None:
        self.kernel_name, self._kernel = name, kernel
        self._output_checked = False

    def forward(self, q, k, v, q_offsets, k_offsets=None, **overrides) -> torch.Tensor:
        kw = {"causal": self.request.causal, "activation": self.request.activation, **self.options, **overrides}
        if kw.get("relative_bias") is not None:
            kw = self._serve_relative_bias(kw, q_offsets, k_offsets)
        out = self.kernel(q, k, v, q_offsets, k_offsets, **kw)
        if not self._output_checked:  # a plugin's kernel returning the wrong thing fails here, by name
            check_kernel_output(out, q, v, self.kernel_name)
            self._output_checked = True
        return out

    def _serve_relative_bias(self, kw: dict, q_offsets, k_offsets) -> dict:
        """A kernel that declares ``relative_bias`` takes it as it is; one that declares only ``bias`` gets it
        materialised; any other gets it as it is and raises, naming what it lacks."""
        caps = self.kernel.capabilities
        if caps.relative_bias or not caps.bias:
            return kw
        if kw.get("bias") is not None:
            raise PluginError(f"attention kernel {self.kernel_name!r} takes one additive bias: this site passes "
                              "both bias and relative_bias; choose a kernel that declares relative_bias")
        kw = dict(kw)
        k_offsets = q_offsets if k_offsets is None else k_offsets
        lq = kw.get("max_q_len") if kw.get("max_q_len") is not None else max_length(q_offsets)
        lk = kw.get("max_k_len") if kw.get("max_k_len") is not None else max_length(k_offsets)
        kw["bias"] = materialize_relative_bias(kw.pop("relative_bias"), q_offsets, k_offsets, lq, lk)
        return kw

    def extra_repr(self) -> str:
        return f"kernel={self.kernel_name}, request={self.request}"


def check_kernel_output(out, q: torch.Tensor, v: torch.Tensor, kernel_name: str) -> None:
    """The first call's output of an attention kernel must be a [Tq, H, Dv] tensor of q's dtype and device;
    otherwise a PluginError names the kernel and the plugin distribution that registered it."""
    want = (q.shape[0], q.shape[1], v.shape[2])
    if isinstance(out, torch.Tensor) and tuple(out.shape) == want and out.dtype == q.dtype \
            and out.device == q.device:
        return
    try:
        entry = registry.entry("attention", kernel_name)
        origin = f"plugin {entry.plugin!r} of distribution {entry.distribution!r}"
    except Exception:  # noqa: BLE001 - set by hand, not registered: name the kernel only
        origin = "a kernel that is not registered"
    got = (f"a {type(out).__name__}" if not isinstance(out, torch.Tensor)
           else f"shape {tuple(out.shape)}, {out.dtype} on {out.device}")
    raise PluginError(
        f"attention kernel {kernel_name!r} ({origin}) returned {got}; it must return a tensor of shape "
        f"[Tq, H, Dv] = {want}, {q.dtype} on {q.device}. Fix the kernel, or choose another with --plugins."
    )


def attention_sites(model: nn.Module) -> dict[str, JaggedAttention]:
    """Module name -> JaggedAttention site, in module order (the names [plugins.attention_sites] matches)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, JaggedAttention)}
