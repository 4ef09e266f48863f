"""Core ops: tolerant loader for the ``gemzoo._C`` extension, with plain-torch fallbacks.

Every op here works on every machine. When ``gemzoo._C`` is built for the running torch, the op runs
the C++ (CPU) or CUDA kernel registered under ``torch.ops.gemzoo.*``; otherwise gemzoo warns once and
runs the torch code below. ``GEMZOO_NO_EXTENSION=1`` skips the extension on purpose (no warning).

Ops (see csrc/README.md): jagged_to_padded / padded_to_jagged, quantize_mx / dequantize_mx,
hadamard_transform, jagged_attention (the ``cpu`` attention kernel, gemzoo/builtin/cpu_attention.py).
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch

from gemzoo import mx
from gemzoo.attention.checks import check_inputs
from gemzoo.attention.semantics import ACTIVATION_CODES, REFERENCE_CAPABILITIES, reference_attention
from gemzoo.errors import JaggedShapeError
from gemzoo.interfaces.attention import TIME_BUCKET_DIVISOR
from gemzoo.jagged import max_length, positions, seq_ids

__all__ = [
    "extension_available",
    "extension_info",
    "jagged_to_padded",
    "padded_to_jagged",
    "ACTIVATION_CODES",
    "quantize_mx",
    "dequantize_mx",
    "hadamard_transform",
    "jagged_attention",
    "OPS",
]

# op name -> schema-level description, the list `gemzoo info` reports devices for
OPS = (
    "jagged_to_padded",
    "padded_to_jagged",
    "quantize_mx",
    "dequantize_mx",
    "hadamard_transform",
    "jagged_attention_fwd",
    "jagged_attention_bwd",
)


def _torch_version_key(version: str) -> str:
    return version.split("+")[0]


@functools.cache
def _load_extension():
    if os.environ.get("GEMZOO_NO_EXTENSION", "0") not in ("", "0"):
        return None
    try:
        from gemzoo import _C  # registers torch.ops.gemzoo.*
    except (ImportError, OSError) as exc:
        warnings.warn(
            f"gemzoo._C is unavailable ({exc}); using torch fallbacks. Build it with "
            "`pip install --no-deps --no-build-isolation -e .` to get the C++ ops.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    built = getattr(_C, "TORCH_VERSION", "unknown")
    if _torch_version_key(built) != _torch_version_key(torch.__version__):
        warnings.warn(
            f"gemzoo._C was built for torch {built} but torch {torch.__version__} is running; using torch "
            "fallbacks. Rebuild with `pip install --no-deps --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    _register_fakes_and_autograd()
    return _C


def extension_available() -> bool:
    return _load_extension() is not None


def _op_devices(name: str) -> list[str]:
    devices = []
    for key, device in (("CPU", "cpu"), ("CUDA", "cuda")):
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"gemzoo::{name}", key):
            devices.append(device)
    return devices


def extension_info() -> dict:
    """JSON-serialisable: whether gemzoo._C loaded, the torch it was built with, and each op's devices."""
    ext = _load_extension()
    info = {
        "loaded": ext is not None,
        "torch": torch.__version__,
        "built_with_torch": getattr(ext, "TORCH_VERSION", None) if ext is not None else None,
        "with_cuda": bool(getattr(ext, "WITH_CUDA", False)) if ext is not None else False,
        "ops": {},
    }
    for name in OPS:
        devices = _op_devices(name) if ext is not None else []
        info["ops"][name] = {"extension": devices, "fallback": "torch (any device)"}
    return info


@torch.compiler.assume_constant_result
def _extension_serves(name: str, device_type: str) -> bool:
    """Whether gemzoo._C has op ``name`` for ``device_type``. Under torch.compile it is called once while tracing
    and its answer kept as a constant, so loading the extension never happens inside a graph."""
    if _load_extension() is None:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"gemzoo::{name}", key)


def _use_extension(name: str, *tensors: torch.Tensor) -> bool:
    return _extension_serves(name, tensors[0].device.type)


# --------------------------------------------------------------------------------------------- jagged


def _lengths_fit(offsets: torch.Tensor, max_len: int, what: str) -> None:
    if offsets.numel() > 1:
        longest = int((offsets[1:] - offsets[:-1]).max())
        if longest > max_len:
            raise JaggedShapeError(
                f"{what}: the longest sequence has {longest} rows but the padded length is {max_len}; "
                f"pad to at least {longest} (gemzoo.jagged.max_length(offsets))"
            )


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None,
                     pad: float = 0.0) -> torch.Tensor:
    """[T, *F] -> [B, max_len, *F]; rows past a sequence's end hold ``pad``; longer sequences are cut.
    ``max_len`` defaults to the longest sequence (a read of the offsets). Differentiable."""
    if max_len is None:
        max_len = max_length(offsets)
    if _use_extension("jagged_to_padded", values):
        return torch.ops.gemzoo.jagged_to_padded(values, offsets, max_len, float(pad))
    batch = offsets.numel() - 1
    if values.shape[0] == 0 or max_len == 0:
        return values.new_full((batch, max_len, *values.shape[1:]), pad)
    ids = seq_ids(offsets, values.shape[0])
    pos = positions(offsets, values.shape[0])
    # rows past max_len go to a spare sequence row that is cut off after: no boolean mask, whose size would be
    # read back from the device (a host sync on a GPU); the result is a contiguous view of the first B rows
    keep = pos < max_len
    out = values.new_full((batch + 1, max_len, *values.shape[1:]), pad)
    out = out.index_put((torch.where(keep, ids, batch), torch.where(keep, pos, 0)), values)
    return out[:batch]


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, L, *F] -> [T, *F], keeping the first length_b rows of each sequence. Differentiable."""
    if padded.dim() < 2 or padded.shape[0] != offsets.numel() - 1:
        raise JaggedShapeError(
            f"padded must be [B, L, ...] with B = len(offsets) - 1 = {offsets.numel() - 1}, "
            f"got shape {tuple(padded.shape)}"
        )
    _lengths_fit(offsets, padded.shape[1], "padded_to_jagged")
    total = int(offsets[-1])
    if _use_extension("padded_to_jagged", padded):
        return torch.ops.gemzoo.padded_to_jagged(padded, offsets, total)
    ids = seq_ids(offsets, total)
    pos = positions(offsets, total)
    return padded[ids, pos]


# ------------------------------------------------------------------------------------------------- MX


def quantize_mx(x: torch.Tensor, axis: int = -1, block: int = 32, elem: torch.dtype = torch.float8_e4m3fn):
    """OCP MX cast along ``axis`` (RCEIL scales): (data like x in ``elem``, scale float8_e8m0fnu).

    Bit-exact with :func:`gemzoo.mx.quantize_mx_torch` (the rule is stated there).
    """
    mx._check(axis, block, elem)
    if x.dim() == 0:
        raise ValueError("quantize_mx needs a tensor with at least one dimension, got a scalar")
    axis = axis % x.dim()
    if _use_extension("quantize_mx", x):
        return torch.ops.gemzoo.quantize_mx(x, axis, block, elem)
    return mx.quantize_mx_torch(x, axis, block, elem)


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor, axis: int = -1, block: int = 32,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_mx`: data * 2^(e-127) per block, in ``dtype``."""
    if data.dim() == 0:
        raise ValueError("dequantize_mx needs a tensor with at least one dimension, got a scalar")
    axis = axis % data.dim()
    n = data.shape[axis]
    want = list(data.shape)
    want[axis] = -(-n // block)
    if list(scale.shape) != want:
        raise ValueError(f"scale must have shape {tuple(want)} for data {tuple(data.shape)} with block={block} "
                         f"along axis {axis}, got {tuple(scale.shape)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"scale must be float8_e8m0fnu (or its uint8 bytes), got {scale.dtype}")
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    if _use_extension("dequantize_mx", data):
        return torch.ops.gemzoo.dequantize_mx(data, scale, axis, block, dtype)
    return mx.dequantize_mx_torch(data, scale, axis, block, dtype)


# ------------------------------------------------------------------------------------------- Hadamard

HADAMARD_BLOCKS = (16, 32)


@functools.cache
def hadamard_matrix(block: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size ``block`` (symmetric: H = Hᵀ = H⁻¹)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(block)).to(dtype=dtype, device=device)


def _check_hadamard(x: torch.Tensor, block: int, signs: torch.Tensor | None) -> None:
    if block not in HADAMARD_BLOCKS:
        raise ValueError(f"hadamard_transform block must be one of {HADAMARD_BLOCKS}, got {block}")
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"hadamard_transform needs the last dim to be a multiple of block={block}, "
                         f"got shape {tuple(x.shape)}; pad the last dim first")
    if not x.is_floating_point():
        raise ValueError(f"hadamard_transform needs a floating-point tensor, got {x.dtype}")
    if signs is not None:
        if signs.shape != (block,):
            raise ValueError(f"signs must be a 1-D tensor of {block} values ±1, got shape {tuple(signs.shape)}")
        if signs.device != x.device:
            raise ValueError(f"signs is on {signs.device} but x is on {x.device}; move it with signs.to(x.device)")


def hadamard_transform_torch(x: torch.Tensor, block: int = 32, signs: torch.Tensor | None = None,
                             inverse: bool = False) -> torch.Tensor:
    """Plain-torch definition: y_blk = H·diag(signs)·x_blk; inverse x_blk = diag(signs)·Hᵀ·y_blk."""
    _check_hadamard(x, block, signs)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xb = x.to(compute).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    h = hadamard_matrix(block, compute, str(x.device))
    s = None if signs is None else signs.to(compute)
    if not inverse:
        yb = (xb if s is None else xb * s) @ h  # row form of H·(s∘x), H symmetric
    else:
        yb = xb @ h
        yb = yb if s is None else yb * s
    return yb.reshape(x.shape).to(x.dtype)


def hadamard_transform(x: torch.Tensor, block: int = 32, signs: torch.Tensor | None = None,
                       inverse: bool = False) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over consecutive blocks of ``block`` (16 or 32) of the last dim.

    With ``signs`` (±1, length ``block``) it is the randomized transform H·diag(signs); ``inverse=True``
    undoes it exactly (diag(signs)·Hᵀ). Differentiable in x; computed in fp32 (fp64 for fp64 input).
    """
    _check_hadamard(x, block, signs)
    if _use_extension("hadamard_transform", x):
        s = None if signs is None else signs.to(torch.float32).contiguous()
        return torch.ops.gemzoo.hadamard_transform(x, block, s, inverse)
    return hadamard_transform_torch(x, block, signs, inverse)


# ------------------------------------------------------------------------------------------ attention


@torch.compiler.disable
def _reference_eager(*args, **kwargs):
    """The fallback without the C++ op runs eager under torch.compile: traced, its per-sequence loop over
    data-dependent lengths makes a graph whose symbolic shapes took the compiler over 10 minutes for gem-tiny
    (a graph break instead; the op itself, when built, is one opaque node)."""
    return reference_attention(*args, **kwargs)


def jagged_attention(q, k, v, q_offsets, k_offsets=None, *, causal=True, activation="softmax", scale=None,
                     norm=None, max_q_len=None, max_k_len=None, block_size=None, window=None, relative_bias=None):
    """Jagged attention (the semantics of gemzoo.attention) with the C++ CPU kernel; other devices use ``reference``.
    ``relative_bias`` (a RelativeAttentionBias) is computed per (query, key) pair inside the kernel's tiles."""
    # the reference's capabilities: what the op does not compute itself (fp64, other devices) runs the reference
    q_offsets, k_offsets = check_inputs(q, k, v, q_offsets, k_offsets, activation, causal=causal, scale=scale,
                                        norm=norm, max_q_len=max_q_len, max_k_len=max_k_len,
                                        block_size=block_size, window=window, relative_bias=relative_bias,
                                        capabilities=REFERENCE_CAPABILITIES, kernel="cpu")
    if not _use_extension("jagged_attention_fwd", q) or q.dtype == torch.float64:
        return _reference_eager(q, k, v, q_offsets, k_offsets, causal=causal, activation=activation,
                                scale=scale, norm=norm, block_size=block_size, window=window,
                                max_q_len=max_q_len, max_k_len=max_k_len, relative_bias=relative_bias)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    rb = relative_bias
    bias_args = () if rb is None else (rb.positions, rb.time_weights, rb.q_times, rb.k_times,
                                       float(rb.bucket_divisor))
    out, _ = torch.ops.gemzoo.jagged_attention_fwd(
        q, k, v, q_offsets, k_offsets, causal, ACTIVATION_CODES[activation], scale,
        1.0 if norm is None else float(norm), -1 if window is None else int(window),
        -1 if block_size is None else int(block_size), *bias_args)
    return out.to(q.dtype)  # the op returns fp32, which its backward keeps for rowsum(dO * O)


# ------------------------------------------------------------------- fake kernels and autograd (Python)


def _register_fakes_and_autograd() -> None:
    """Meta/fake shapes and autograd formulas for the C++ ops, so torch.compile and opcheck work."""
    lib = "gemzoo::"

    @torch.library.register_fake(lib + "jagged_to_padded")
    def _(values, offsets, max_len, pad):
        return values.new_empty((offsets.shape[0] - 1, max_len, *values.shape[1:]))

    @torch.library.register_fake(lib + "padded_to_jagged")
    def _(padded, offsets, total):
        return padded.new_empty((total, *padded.shape[2:]))

    def j2p_setup(ctx, inputs, output):
        values, offsets, _, _ = inputs
        ctx.save_for_backward(offsets)
        ctx.total = values.shape[0]

    def j2p_backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return torch.ops.gemzoo.padded_to_jagged(grad.contiguous(), offsets, ctx.total), None, None, None

    torch.library.register_autograd(lib + "jagged_to_padded", j2p_backward, setup_context=j2p_setup)

    def p2j_setup(ctx, inputs, output):
        padded, offsets, _ = inputs
        ctx.save_for_backward(offsets)
        ctx.max_len = padded.shape[1]

    def p2j_backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return torch.ops.gemzoo.jagged_to_padded(grad.contiguous(), offsets, ctx.max_len, 0.0), None, None

    torch.library.register_autograd(lib + "padded_to_jagged", p2j_backward, setup_context=p2j_setup)

    @torch.library.register_fake(lib + "quantize_mx")
    def _(x, axis, block, elem):
        shape = list(x.shape)
        shape[axis] = -(-shape[axis] // block)
        return x.new_empty(x.shape, dtype=elem), x.new_empty(shape, dtype=torch.float8_e8m0fnu)

    @torch.library.register_fake(lib + "dequantize_mx")
    def _(data, scale, axis, block, dtype):
        return data.new_empty(data.shape, dtype=dtype)

    @torch.library.register_fake(lib + "hadamard_transform")
    def _(x, block, signs, inverse):
        return torch.empty_like(x)

    def had_setup(ctx, inputs, output):
        _, ctx.block, signs, ctx.inverse = inputs
        ctx.save_for_backward(signs)

    def had_backward(ctx, grad):
        (signs,) = ctx.saved_tensors
        # orthogonal: the adjoint of the transform is its inverse
        return torch.ops.gemzoo.hadamard_transform(grad, ctx.block, signs, not ctx.inverse), None, None, None

    torch.library.register_autograd(lib + "hadamard_transform", had_backward, setup_context=had_setup)

    @torch.library.register_fake(lib + "jagged_attention_fwd")
    def _(q, k, v, q_offsets, k_offsets, causal, activation, scale, norm, window, block_size, rel_positions=None,
          rel_time_weights=None, q_times=None, k_times=None, bucket_divisor=0.301):
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)  # fp32 whatever q is
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    @torch.library.register_fake(lib + "jagged_attention_bwd")
    def _(grad_out, q, k, v, out, lse, q_offsets, k_offsets, causal, activation, scale, norm, window, block_size,
          rel_positions=None, rel_time_weights=None, q_times=None, k_times=None, bucket_divisor=0.301):
        def table(t):
            return q.new_empty((0,)) if t is None else torch.empty_like(t)

        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), table(rel_positions),
                table(rel_time_weights))

    def attn_setup(ctx, inputs, output):
        # inputs: q, k, v, q_offsets, k_offsets, 6 options, then the bias tables, timestamps and divisor
        q, k, v, q_offsets, k_offsets, *rest = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.options, bias = rest[:6], (rest[6:] + [None] * 5)[:5]
        ctx.divisor = TIME_BUCKET_DIVISOR if bias[4] is None else bias[4]
        ctx.has_bias = [t is not None for t in bias[:4]]
        ctx.save_for_backward(q, k, v, out, lse, q_offsets, k_offsets, *(t for t in bias[:4] if t is not None))

    def attn_backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, q_offsets, k_offsets, *saved = ctx.saved_tensors
        it = iter(saved)
        bias = [next(it) if has else None for has in ctx.has_bias]
        dq, dk, dv, dpos, dtime = torch.ops.gemzoo.jagged_attention_bwd(
            grad_out.contiguous(), q, k, v, out, lse, q_offsets, k_offsets, *ctx.options, *bias, ctx.divisor)
        return ((dq, dk, dv) + (None,) * 8 + (dpos if bias[0] is not None else None,
                                               dtime if bias[1] is not None else None, None, None, None))

    torch.library.register_autograd(lib + "jagged_attention_fwd", attn_backward, setup_context=attn_setup)
