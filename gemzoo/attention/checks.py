"""The one input check every attention kernel runs, and the cache of offsets it has validated.

:func:`check_inputs` checks shapes, dtypes, devices, option values, the offsets (validated once per tensor,
then trusted until the tensor changes), the length hints and, given a kernel's capabilities, that the call asks
for nothing the kernel does not declare; an option outside them names the registered kernels that can serve the
call (so this module reads the registry). :func:`validated_longest` lets a model validate and measure its offsets
up front, from the batch's host copy when it has one, through the same cache.
"""

from __future__ import annotations

import torch

from gemzoo import registry
from gemzoo.errors import JaggedShapeError, PluginError
from gemzoo.interfaces.attention import ACTIVATIONS, AttentionRequest, RelativeAttentionBias
from gemzoo.jagged import TensorCache, graph_capturing, max_length, validate_offsets


class _OffsetsCache:
    """Offsets tensors validated already (validation syncs with the device), with their longest sequence; a
    tensor modified in place is validated again (gemzoo.jagged.TensorCache)."""

    def __init__(self, size: int = 64):
        self.cache = TensorCache(size)

    def longest(self, offsets: torch.Tensor, total: int, device, name: str) -> int:
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
    ``gemzoo.interfaces.models.host_view``); they are validated and measured instead, and nothing waits for the
    device. Without it, a model that calls this in its prologue, before any layer runs, still moves the sync
    to where it waits only for the batch's copy (gem's cross attention otherwise read its candidate offsets
    after the whole tower)."""
    device = offsets.device if device is None else device
    if host is None or host is offsets or host.device.type != "cpu":
        return _offsets_cache.longest(offsets, total, device, name)
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


def _check_relative_bias(rb, q, k) -> None:
    """``rb`` is a :class:`RelativeAttentionBias` whose tables are floating 1-D tensors on q's device, with
    int64 [Tq] and [Tk] timestamps exactly when it has time weights."""
    if not isinstance(rb, RelativeAttentionBias):
        raise TypeError(f"relative_bias must be a gemzoo RelativeAttentionBias, got {type(rb).__name__}")
    for name, t in (("positions", rb.positions), ("time_weights", rb.time_weights)):
        if t is None and name == "time_weights":
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 1 or t.numel() < 1:
            raise JaggedShapeError(f"relative_bias.{name} must be a non-empty floating 1-D tensor, got "
                                   f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"relative_bias.{name} is on {t.device} but q is on {q.device}; move the module "
                             "that owns it to q's device")
    timed = rb.time_weights is not None
    for name, t, rows in (("q_times", rb.q_times, q.shape[0]), ("k_times", rb.k_times, k.shape[0])):
        if not timed:
            if t is not None:
                raise ValueError(f"relative_bias.{name} is given without time_weights; pass both or neither")
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.shape != (rows,):
            raise JaggedShapeError(f"relative_bias.{name} must be an int64 tensor [{rows}] (one timestamp per row), "
                                   f"got {getattr(t, 'dtype', type(t).__name__)} "
                                   f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
        if t.device != q.device:
            raise ValueError(f"relative_bias.{name} is on {t.device} but q is on {q.device}; move it with .to()")
    d = rb.bucket_divisor
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0 or d == float("inf"):
        raise ValueError(f"relative_bias.bucket_divisor must be a finite number > 0, got {d!r}")


# Calls that passed the check already, by signature (below) and by the identity and version of their offsets
# tensors (gemzoo.jagged.TensorCache): a model's attention sites check the same batch's offsets with the same
# shapes several times a step, and the full check (option values, the capability request, the registry's error
# path, the offsets cache) cost ~15 us of host time per call, as much as a short kernel's launch.
_passed = TensorCache(256)


def _signature(q, k, v, q_offsets, k_offsets, activation, capabilities, causal, scale, norm, max_q_len, max_k_len,
               block_size, window, rope_theta) -> tuple | None:
    """What the result of a passing check depends on besides the offsets tensors' contents, or None where the
    call must take the full check (non-tensor inputs, unhashable option values)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and isinstance(q_offsets, torch.Tensor) and (k_offsets is None or isinstance(k_offsets, torch.Tensor))):
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = (activation, id(capabilities), causal, scale, norm, max_q_len, max_k_len, block_size, window, rope_theta,
           k_offsets is None, grad, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
           v.device)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def check_inputs(q, k, v, q_offsets, k_offsets=None, activation: str = "softmax", *, capabilities=None,
                 kernel=None, causal: bool = True, scale=None, norm=None, max_q_len=None, max_k_len=None,
                 block_size=None, window=None, rope_theta=None, bias=None, relative_bias=None):
    """The one input check of every attention kernel; returns ``(q_offsets, k_offsets)``, contiguous, with
    ``k_offsets`` defaulting to ``q_offsets``. See :func:`check_inputs_uncached` for what it checks.

    A call identical to one that passed (same offsets tensors, unchanged; same shapes, dtypes, devices, gradient
    need, option values and capabilities) passes again without repeating the work; calls with ``bias`` or
    ``relative_bias`` (tensors of their own) and traced calls always run the full check."""
    kw = dict(capabilities=capabilities, kernel=kernel, causal=causal, scale=scale, norm=norm, max_q_len=max_q_len,
              max_k_len=max_k_len, block_size=block_size, window=window, rope_theta=rope_theta, bias=bias,
              relative_bias=relative_bias)
    key = None
    if bias is None and relative_bias is None and not torch.compiler.is_compiling():
        key = _signature(q, k, v, q_offsets, k_offsets, activation, capabilities, causal, scale, norm, max_q_len,
                         max_k_len, block_size, window, rope_theta)
    if key is None:
        return check_inputs_uncached(q, k, v, q_offsets, k_offsets, activation, **kw)

    def check():  # (capabilities, the contiguous copies or None where the offsets are returned as given)
        qo, ko = check_inputs_uncached(q, k, v, q_offsets, k_offsets, activation, **kw)
        return (capabilities, None if qo is q_offsets else qo,
                None if ko is (q_offsets if k_offsets is None else k_offsets) else ko)

    tensors = (q_offsets,) if k_offsets is None else (q_offsets, k_offsets)
    caps, qo, ko = _passed.get(tensors, key, check)
    if caps is not capabilities:  # id(capabilities) reused by another object: check in full
        caps, qo, ko = check()
    qo = q_offsets if qo is None else qo
    if ko is None:
        ko = qo if k_offsets is None else k_offsets
    return qo, ko


def check_inputs_uncached(q, k, v, q_offsets, k_offsets=None, activation: str = "softmax", *, capabilities=None,
                          kernel=None, causal: bool = True, scale=None, norm=None, max_q_len=None, max_k_len=None,
                          block_size=None, window=None, rope_theta=None, bias=None, relative_bias=None):
    """The one input check of every attention kernel; returns ``(q_offsets, k_offsets)``, contiguous, with
    ``k_offsets`` defaulting to ``q_offsets``.

    Checks shapes, dtypes and devices (k and v may have fewer heads than q, a divisor of its count:
    grouped-query attention, for a kernel that declares ``grouped_kv``); option values (``window`` and
    ``block_size`` are ints >= 1, ``norm``
    only with pointwise activations); the offsets (validated fully the first time a tensor is seen, then
    trusted until it changes); the hints ``max_q_len``/``max_k_len`` against the real longest sequences;
    and, given ``capabilities``, that the call asks for nothing the kernel does not declare. An option outside
    them raises :class:`PluginError` naming the registered kernels that can serve the call. ``kernel`` is the
    kernel (or its name) for messages. Under ``torch.compile``, and while a CUDA graph is captured, the
    data-dependent checks are skipped.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [T, H, D], got {type(t).__name__}")
        if t.dim() != 3:
            raise JaggedShapeError(f"{name} must be [T, H, D], got shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise JaggedShapeError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [Tk, H]")
    if q.shape[2] != k.shape[2]:
        raise JaggedShapeError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on D")
    grouped = _grouped_kv(q.shape[1], k.shape[1], kernel)
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
    compiling = torch.compiler.is_compiling() or graph_capturing(q)  # no device reads: traced, or a CUDA graph
    if capabilities is not None:
        asymmetric = False
        if not capabilities.asymmetric and k_offsets is not q_offsets:
            asymmetric = compiling or k_offsets.shape != q_offsets.shape or not torch.equal(k_offsets, q_offsets)
        req = AttentionRequest(
            activation, bool(causal), asymmetric, window is not None, block_size is not None, q.dtype,
            q.device.type, torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)), q.shape[2],
            rope_theta is not None, bias is not None, relative_bias is not None, grouped,
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
    elif relative_bias is not None:
        raise PluginError(f"attention kernel {_kernel_name(kernel)!r} does not support relative_bias "
                          "(fused relative position/time bias)")
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
    if relative_bias is not None:
        _check_relative_bias(relative_bias, q, k)
    same = k_offsets is q_offsets
    q_offsets = q_offsets if q_offsets.is_contiguous() else q_offsets.contiguous()
    k_offsets = q_offsets if same else (k_offsets if k_offsets.is_contiguous() else k_offsets.contiguous())
    return q_offsets, k_offsets


def _grouped_kv(hq: int, hkv: int, kernel) -> bool:
    """Whether k/v have fewer heads than q (grouped-query or multi-query attention); head counts where Hkv does
    not divide Hq raise PluginError, whatever the kernel."""
    if hkv == hq:
        return False
    if hkv == 0 or hkv > hq or hq % hkv:
        raise PluginError(
            f"attention kernel {_kernel_name(kernel)!r} got q with {hq} heads and k/v with {hkv}: k and v need as "
            f"many heads as q, or (grouped-query attention) a divisor of that count "
            f"({', '.join(str(d) for d in _divisors(hq)) or 'none'}); give k and v such a head count (a model: "
            f"num_kv_heads dividing num_heads)")
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kernels_that_serve(req: AttentionRequest, exclude: str | None = None) -> list[str]:
    """Registered attention kernels whose capabilities cover ``req`` (for error messages)."""
    return [n for n in registry.names("attention")
            if n != exclude and not registry.get("attention", n).capabilities.missing(req)]


def _kernel_name(kernel) -> str:
    if isinstance(kernel, str) or kernel is None:
        return kernel or "this kernel"
    try:
        return next(e.name for e in registry.entries("attention") if e.obj is kernel)
    except Exception:  # not registered (or the registry cannot load): the function's own name
        return getattr(kernel, "__name__", type(kernel).__name__)
