"""Attention kernels over jagged sequences.

    out = kernel(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                 norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None)

q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv] -> out [Tq, H, Dv]. For sequence b with lengths Lq, Lk and
shift s = Lk - Lq, key j is allowed for query i iff (not causal or j <= i + s) and
(window is None or i + s - j < window) and (block_size is None or (i + s) // block_size == j // block_size).
softmax: a row with no allowed key outputs 0. Other activations: P = act(S) on allowed keys, / norm.
NaN stays in its own sequence. docs/attention.md has the whole contract; :func:`check_inputs` is the one
input check every kernel runs (shapes, dtypes, offsets, option values, hints and declared capabilities).

This module is the public home of the semantics: the mask rule (:func:`pair_allowed`, :func:`allowed_mask`),
RoPE and the pointwise activations, and :func:`reference_attention`, the per-sequence oracle that the
``reference`` kernel registers and every kernel's tests and benchmarks compare against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

ACTIVATIONS = ("softmax", "silu", "gelu", "gelu_tanh", "relu", "relu2", "leaky_relu", "hardswish", "identity")


@dataclass(frozen=True)
class AttentionCapabilities:
    activations: frozenset[str] = frozenset({"softmax"})
    causal: bool = True
    non_causal: bool = True
    asymmetric: bool = True  # Lq != Lk
    window: bool = False
    block: bool = False
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    backward_devices: frozenset[str] = frozenset({"cpu", "cuda"})
    head_dims: tuple[int, ...] | None = None  # None: any
    rotary: bool = False  # rope_theta
    bias: bool = False  # an additive score bias, bias= [B, 1 or H, >= Lq, >= Lk] padded

    def missing(self, req: "AttentionRequest") -> list[str]:
        """Human-readable list of what ``req`` needs that this kernel lacks."""
        out = []
        if req.activation not in self.activations:
            out.append(f"activation={req.activation!r}")
        if req.causal and not self.causal:
            out.append("causal=True")
        if not req.causal and not self.non_causal:
            out.append("causal=False")
        if req.asymmetric and not self.asymmetric:
            out.append("asymmetric Lq != Lk")
        if req.window and not self.window:
            out.append("window")
        if req.block and not self.block:
            out.append("block_size")
        if req.dtype is not None and req.dtype not in self.dtypes:
            out.append(f"dtype {req.dtype}")
        if req.device is not None and req.device not in self.devices:
            out.append(f"device {req.device!r}")
        if req.backward and req.device is not None and req.device not in self.backward_devices:
            out.append(f"backward on {req.device!r}")
        if req.head_dim is not None and self.head_dims is not None and req.head_dim not in self.head_dims:
            out.append(f"head_dim {req.head_dim}")
        if req.rotary and not self.rotary:
            out.append("rope_theta (rotary)")
        if req.bias and not self.bias:
            out.append("bias (additive attention bias)")
        return out


@dataclass(frozen=True)
class AttentionRequest:
    """What one attention site of a model needs; checked against capabilities at assembly time."""

    activation: str = "softmax"
    causal: bool = True
    asymmetric: bool = False
    window: bool = False
    block: bool = False
    dtype: torch.dtype | None = None
    device: str | None = None
    backward: bool = True
    head_dim: int | None = None
    rotary: bool = False
    bias: bool = False

    def replace(self, **kw) -> "AttentionRequest":
        from dataclasses import replace

        return replace(self, **kw)


@runtime_checkable
class AttentionKernel(Protocol):
    capabilities: AttentionCapabilities

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_offsets: torch.Tensor,
        k_offsets: torch.Tensor | None = None,
        *,
        causal: bool = True,
        activation: str = "softmax",
        scale: float | None = None,
        norm: float | None = None,
        max_q_len: int | None = None,
        max_k_len: int | None = None,
        block_size: int | None = None,
        window: int | None = None,
        rope_theta: float | None = None,
    ) -> torch.Tensor: ...


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

    def __call__(self, q, k, v, q_offsets, k_offsets=None, **kw):
        if self.cpu_fallback is not None and q.device.type == "cpu":
            check_inputs(q, k, v, q_offsets, k_offsets, capabilities=self.capabilities, kernel=self, **kw)
            return self._fallback()(q, k, v, q_offsets, k_offsets, **kw)
        return self.fn(q, k, v, q_offsets, k_offsets, **kw)

    def _fallback(self):
        """The CPU kernel, looked up in the registry once."""
        if self._cpu_kernel is None:
            from gemzoo import registry

            name = self.cpu_fallback if self.cpu_fallback in registry.names("attention") else "reference"
            self._cpu_kernel = registry.get("attention", name)
        return self._cpu_kernel


def pair_allowed(i: torch.Tensor, j: torch.Tensor, *, causal: bool, window: int | None,
                 block_size: int | None) -> torch.Tensor:
    """DESIGN.md's rule for query positions ``i`` (already shifted by Lk - Lq) and key positions ``j``,
    broadcast against each other."""
    ok = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (i - j) < window
    if block_size is not None:
        ok &= torch.div(i, block_size, rounding_mode="floor") == torch.div(j, block_size, rounding_mode="floor")
    return ok


def allowed_mask(lq: int, lk: int, *, causal: bool, window: int | None, block_size: int | None, device=None):
    """Boolean [lq, lk] mask of allowed (query, key) pairs for one sequence."""
    i = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
    j = torch.arange(lk, device=device).unsqueeze(0)
    return pair_allowed(i, j, causal=causal, window=window, block_size=block_size)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE of DESIGN.md, half-split convention: x [L, H, D] (D even) rotated at positions ``pos`` [L], pairs
    (d, d + D/2) by the angle pos * theta^(-2d/D). Computed in x's dtype (fp32 or fp64 in the reference)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2 / x.shape[-1])
    ang = (pos.to(torch.float64)[:, None] * inv_freq[None, :]).to(x.dtype)[:, None, :]  # [L, 1, D/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_activation(scores: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(scores)
    if activation == "gelu":
        return torch.nn.functional.gelu(scores)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(scores, approximate="tanh")
    if activation == "relu":
        return torch.relu(scores)
    if activation == "relu2":
        return torch.relu(scores).square()
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu(scores, 0.01)
    if activation == "hardswish":
        return torch.nn.functional.hardswish(scores)
    if activation == "identity":
        return scores
    raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")


def kernels_that_serve(req: AttentionRequest, exclude: str | None = None) -> list[str]:
    """Registered attention kernels whose capabilities cover ``req`` (for error messages)."""
    from gemzoo import registry

    return [n for n in registry.names("attention")
            if n != exclude and not registry.get("attention", n).capabilities.missing(req)]


def _kernel_name(kernel) -> str:
    if isinstance(kernel, str) or kernel is None:
        return kernel or "this kernel"
    from gemzoo import registry

    try:
        return next(e.name for e in registry.entries("attention") if e.obj is kernel)
    except Exception:  # not registered (or the registry cannot load): the function's own name
        return getattr(kernel, "__name__", type(kernel).__name__)


class _OffsetsCache:
    """Offsets tensors validated already (validation syncs with the device), with their longest sequence; a
    tensor modified in place is validated again (gemzoo.jagged.TensorCache)."""

    def __init__(self, size: int = 64):
        from gemzoo.jagged import TensorCache

        self.cache = TensorCache(size)

    def longest(self, offsets: torch.Tensor, total: int, device, name: str) -> int:
        from gemzoo.jagged import max_length, validate_offsets

        def validate() -> int:
            validate_offsets(offsets, total, device=device, name=name)
            return max_length(offsets)

        return self.cache.get((offsets,), (total,), validate)


_offsets_cache = _OffsetsCache()


def validated_longest(offsets: torch.Tensor, total: int, *, device=None, name: str = "offsets",
                      host: torch.Tensor | None = None) -> int:
    """The longest sequence of ``offsets`` (over ``total`` value rows), validated as ``check_inputs`` does and
    through its cache, so the attention sites given these offsets later trust them.

    Reading device offsets is a host sync. ``host``: the same offsets on the host (the batch before its copy,
    ``gemzoo.data.batch.host_view``); they are validated and measured instead, and nothing waits for the
    device. Without it, a model that calls this in its prologue, before any layer runs, still moves the sync
    to where it waits only for the batch's copy (gem's cross attention otherwise read its candidate offsets
    after the whole tower)."""
    device = offsets.device if device is None else device
    if host is None or host is offsets or host.device.type != "cpu":
        return _offsets_cache.longest(offsets, total, device, name)
    from gemzoo.errors import JaggedShapeError
    from gemzoo.jagged import max_length, validate_offsets

    if host.shape != offsets.shape:
        raise JaggedShapeError(f"the host copy of {name} has shape {tuple(host.shape)} but {name} has "
                               f"{tuple(offsets.shape)}; pass the offsets the batch was moved from")

    def from_host() -> int:
        if offsets.dtype != torch.int64 or offsets.device != torch.device(device):
            validate_offsets(offsets, total, device=device, name=name)  # its message, from its first checks
        validate_offsets(host, total, name=name)
        return max_length(host)

    return _offsets_cache.cache.get((offsets,), (total,), from_host)


def _positive_int(value, name: str, meaning: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 ({meaning}) or None, got {value!r}")


def _check_bias(bias, q, q_offsets, longest: tuple[int, int] | None) -> None:
    """``bias`` is a floating tensor [B, 1 or H, >= longest Lq, >= longest Lk] on q's device: entry
    [b, h, i, j] is added to the score of query i and key j of sequence b (rows and columns past a
    sequence's lengths are ignored). ``longest``: the validated (Lq, Lk) maxima (None while compiling)."""
    from gemzoo.errors import JaggedShapeError

    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.dim() != 4:
        raise JaggedShapeError(f"bias must be a floating tensor [B, 1 or H, Lq_max, Lk_max], got "
                               f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    if bias.device != q.device:
        raise ValueError(f"bias is on {bias.device} but q is on {q.device}; move it with bias.to(q.device)")
    b, h = q_offsets.numel() - 1, q.shape[1]
    if bias.shape[0] != b or bias.shape[1] not in (1, h):
        raise JaggedShapeError(f"bias has shape {tuple(bias.shape)}; it needs [B={b}, 1 or H={h}, Lq_max, Lk_max]")
    if longest is not None and (bias.shape[2] < longest[0] or bias.shape[3] < longest[1]):
        raise JaggedShapeError(f"bias {tuple(bias.shape)} is smaller than the longest sequences (Lq "
                               f"{longest[0]}, Lk {longest[1]}); pad it to at least those")


def check_inputs(q, k, v, q_offsets, k_offsets=None, activation: str = "softmax", *, capabilities=None,
                 kernel=None, causal: bool = True, scale=None, norm=None, max_q_len=None, max_k_len=None,
                 block_size=None, window=None, rope_theta=None, bias=None):
    """The one input check of every attention kernel; returns ``(q_offsets, k_offsets)``, contiguous, with
    ``k_offsets`` defaulting to ``q_offsets``.

    Checks shapes, dtypes and devices; option values (``window`` and ``block_size`` are ints >= 1, ``norm``
    only with pointwise activations); the offsets (validated fully the first time a tensor is seen, then
    trusted until it changes); the hints ``max_q_len``/``max_k_len`` against the real longest sequences;
    and, given ``capabilities``, that the call asks for nothing the kernel does not declare. An option outside
    them raises :class:`PluginError` naming the registered kernels that can serve the call. ``kernel`` is the
    kernel (or its name) for messages. Under ``torch.compile`` the data-dependent checks are skipped.
    """
    from gemzoo.errors import JaggedShapeError, PluginError

    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [T, H, D], got {type(t).__name__}")
        if t.dim() != 3:
            raise JaggedShapeError(f"{name} must be [T, H, D], got shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise JaggedShapeError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [Tk, H]")
    if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]:
        raise JaggedShapeError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on H and D")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    _positive_int(window, "window", "the number of keys a query sees: itself and the window - 1 before it")
    _positive_int(block_size, "block_size", "the length of each attention block")
    if rope_theta is not None:
        if (isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0
                or rope_theta == float("inf")):
            raise ValueError(f"rope_theta must be a finite number > 0 (the RoPE base, e.g. 10000.0) or None, "
                             f"got {rope_theta!r}")
        if q.dim() == 3 and q.shape[2] % 2:
            raise ValueError(f"rope_theta needs an even head dim (pairs (d, d + D/2)), got D={q.shape[2]}; "
                             "change head_dim or pass rope_theta=None")
    for name, hint in (("max_q_len", max_q_len), ("max_k_len", max_k_len)):
        if hint is not None and (isinstance(hint, bool) or not isinstance(hint, int) or hint < 0):
            raise ValueError(f"{name} must be an int >= 0 (a bound on the sequence lengths) or None, got {hint!r}")
    if norm is not None:
        if activation == "softmax":
            raise ValueError("norm divides pointwise activations only (softmax is normalised already); "
                             "pass norm=None with activation='softmax'")
        if not isinstance(norm, (int, float)) or isinstance(norm, bool) or norm == 0 or norm != norm:
            raise ValueError(f"norm must be a non-zero number or None, got {norm!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale):
        raise ValueError(f"scale must be a number or None (None: 1/sqrt(D)), got {scale!r}")
    if k_offsets is None:
        k_offsets = q_offsets
        if k.shape[0] != q.shape[0]:
            raise JaggedShapeError("k_offsets is required when k and q have different numbers of rows")
    compiling = torch.compiler.is_compiling()
    if capabilities is not None:
        asymmetric = False
        if not capabilities.asymmetric and k_offsets is not q_offsets:
            asymmetric = compiling or k_offsets.shape != q_offsets.shape or not torch.equal(k_offsets, q_offsets)
        req = AttentionRequest(
            activation, bool(causal), asymmetric, window is not None, block_size is not None, q.dtype,
            q.device.type, torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)), q.shape[2],
            rope_theta is not None, bias is not None,
        )
        missing = capabilities.missing(req)
        if missing:
            name = _kernel_name(kernel)
            able = kernels_that_serve(req, exclude=name)
            raise PluginError(
                f"attention kernel {name!r} does not support {', '.join(missing)} (see its capabilities). "
                f"Registered kernels that can serve this call: {', '.join(able) or '(none)'}."
            )
    elif rope_theta is not None:
        raise PluginError(f"attention kernel {_kernel_name(kernel)!r} does not support rope_theta (rotary)")
    elif bias is not None:
        raise PluginError(f"attention kernel {_kernel_name(kernel)!r} does not support bias (additive attention bias)")
    for name, off, t in (("q_offsets", q_offsets, q), ("k_offsets", k_offsets, k)):
        if not isinstance(off, torch.Tensor) or off.dtype != torch.int64 or off.dim() != 1:
            raise JaggedShapeError(f"{name} must be a 1-D int64 tensor, got "
                                   f"{getattr(off, 'dtype', type(off).__name__)}; convert with {name}.long()")
        if off.device != t.device:
            raise JaggedShapeError(f"{name} is on {off.device} but the values are on {t.device}; "
                                   f"move it with {name}.to(values.device)")
    if k_offsets.numel() != q_offsets.numel():
        raise JaggedShapeError(
            f"q_offsets has {q_offsets.numel() - 1} sequences but k_offsets has {k_offsets.numel() - 1}")
    longest = None  # (Lq, Lk): validated once per offsets tensor, then from the cache (no device read)
    if not compiling:
        longest = tuple(_offsets_cache.longest(off, t.shape[0], t.device, f"{name}_offsets")
                        for name, off, t in (("q", q_offsets, q), ("k", k_offsets, k)))
        for name, hint, most in (("q", max_q_len, longest[0]), ("k", max_k_len, longest[1])):
            if hint is not None and hint < most:
                raise JaggedShapeError(
                    f"max_{name}_len={hint} is smaller than the longest {'query' if name == 'q' else 'key'} "
                    f"sequence ({most}); pass max_{name}_len >= {most}, or None to have it computed"
                )
    if bias is not None:
        _check_bias(bias, q, q_offsets, longest)
    same = k_offsets is q_offsets
    q_offsets = q_offsets if q_offsets.is_contiguous() else q_offsets.contiguous()
    k_offsets = q_offsets if same else (k_offsets if k_offsets.is_contiguous() else k_offsets.contiguous())
    return q_offsets, k_offsets


# ------------------------------------------------------------------------------------------ attention sites
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
            from gemzoo import registry

            self._kernel = registry.get("attention", self.kernel_name)
        return self._kernel

    def set_kernel(self, name: str, kernel) -> None:
        self.kernel_name, self._kernel = name, kernel
        self._output_checked = False

    def forward(self, q, k, v, q_offsets, k_offsets=None, **overrides) -> torch.Tensor:
        kw = {"causal": self.request.causal, "activation": self.request.activation, **self.options, **overrides}
        out = self.kernel(q, k, v, q_offsets, k_offsets, **kw)
        if not self._output_checked:  # a plugin's kernel returning the wrong thing fails here, by name
            check_kernel_output(out, q, v, self.kernel_name)
            self._output_checked = True
        return out

    def extra_repr(self) -> str:
        return f"kernel={self.kernel_name}, request={self.request}"


def check_kernel_output(out, q: torch.Tensor, v: torch.Tensor, kernel_name: str) -> None:
    """The first call's output of an attention kernel must be a [Tq, H, Dv] tensor of q's dtype and device;
    otherwise a PluginError names the kernel and the plugin distribution that registered it."""
    want = (q.shape[0], q.shape[1], v.shape[2])
    if isinstance(out, torch.Tensor) and tuple(out.shape) == want and out.dtype == q.dtype \
            and out.device == q.device:
        return
    from gemzoo import registry
    from gemzoo.errors import PluginError

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


# ------------------------------------------------------------------------------------------ the reference
# The executable definition of the semantics above: the ``reference`` kernel (registered by
# gemzoo.builtin.attention) and the oracle every kernel's tests compare against.

REFERENCE_CAPABILITIES = AttentionCapabilities(
    activations=frozenset(ACTIVATIONS), window=True, block=True, rotary=True, bias=True,
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}))


def reference_attention(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                        norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, rope_theta=None,
                        bias=None):
    """Per-sequence torch in fp32 (fp64 stays fp64): slow, obvious, and the definition of correct.
    ``bias`` [B, 1 or H, >= Lq, >= Lk] is added to the scaled scores before the mask and the activation."""
    q_offsets, k_offsets = check_inputs(
        q, k, v, q_offsets, k_offsets, activation, capabilities=REFERENCE_CAPABILITIES, kernel="reference",
        causal=causal, scale=scale, norm=norm, max_q_len=max_q_len, max_k_len=max_k_len, block_size=block_size,
        window=window, rope_theta=rope_theta, bias=bias)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=compute)
    qo, ko = q_offsets.tolist(), k_offsets.tolist()
    pieces = []
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], ko[b], ko[b + 1]
        lq, lk = qe - qs, ke - ks
        if lq == 0:
            continue
        if lk == 0:
            pieces.append(out[qs:qe])
            continue
        qb, kb = q[qs:qe].to(compute), k[ks:ke].to(compute)
        if rope_theta is not None:  # query i at position i + Lk - Lq, key j at j
            qb = apply_rope(qb, torch.arange(lk - lq, lk, device=q.device), rope_theta)
            kb = apply_rope(kb, torch.arange(lk, device=q.device), rope_theta)
        qb, kb = qb.transpose(0, 1), kb.transpose(0, 1)  # [H, Lq, D], [H, Lk, D]
        vb = v[ks:ke].to(compute).transpose(0, 1)
        s = scale * qb @ kb.transpose(1, 2)  # [H, Lq, Lk]
        if bias is not None:
            s = s + bias[b, :, :lq, :lk].to(compute)
        mask = allowed_mask(lq, lk, causal=causal, window=window, block_size=block_size, device=q.device)
        has_key = mask.any(-1, keepdim=True)  # [Lq, 1]
        if activation == "softmax":
            # masked keys get -inf (a NaN score there is dropped); rows with no allowed key get finite
            # dummy scores and are zeroed below, so NaN from the inputs is the only NaN left
            s = s.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0.0)
            p = torch.softmax(s, dim=-1)
        else:
            p = torch.where(mask, apply_activation(s, activation), 0.0)
            if norm is not None:
                p = p / norm
        o = torch.where(has_key, p @ vb, 0.0)  # no allowed key -> exactly 0
        pieces.append(o.transpose(0, 1))
    if not pieces:
        return out.to(q.dtype)
    return torch.cat(pieces, dim=0).to(q.dtype)  # non-empty sequences, in order, tile [0, Tq)
