"""The jfa kernel family's public launch interface, shared by gemzoo-jfa, gemzoo-gdpa and gemzoo-block-attention.

One tile loop (``kernels.py``) serves softmax (jfa), the pointwise activations (gdpa) and block masks with fused
RoPE (block-attention). A family member builds its custom ops over these functions::

    from gemzoo_jfa.family import KernelOptions, backward, launch_fwd, run_attention

    launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, lse, activation, inv_norm, block,
               rope_theta, options=KernelOptions(order="natural", tma=False))

k and v may have fewer heads than q (a divisor of its count: grouped-query / multi-query attention; query head
h reads k/v head h // (H / Hkv)). ``activation`` is a code of ``ACTIVATION_CODES`` (gemzoo's one table: 0
softmax, the others pointwise),
``window`` and ``block`` are -1 for "off", ``rope_theta`` 0.0. How the kernels run (tiles, schedule order,
TMA, key split, length buckets, fused dQ) travels as a frozen ``KernelOptions`` passed through the call;
``options_index`` / ``options_at`` pass it across a custom op's schema. ``GEMZOO_JFA_BUCKETS=0`` turns the
default length buckets off for a process.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import is_fake

from gemzoo.api import ACTIVATION_CODES, AttentionCapabilities, JaggedShapeError, TensorCache, check_inputs
from gemzoo_jfa.schedule import ORDERS

MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634

# What every kernel of the family serves (jfa itself; gdpa and block-attention widen it with
# dataclasses.replace): causal, full and sliding-window masks, Lq != Lk, fp32/bf16/fp16, forward and backward
# on CUDA (Triton) and CPU (the fallback), head dims up to 256, grouped k/v (GQA/MQA).
FAMILY_CAPABILITIES = AttentionCapabilities(
    activations=frozenset({"softmax"}),
    causal=True,
    non_causal=True,
    asymmetric=True,
    window=True,
    block=False,
    dtypes=frozenset(DTYPES),
    devices=frozenset({"cpu", "cuda"}),
    backward_devices=frozenset({"cpu", "cuda"}),
    head_dims=tuple(range(1, MAX_HEAD_DIM + 1)),
    grouped_kv=True,
)


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # queries per block
    block_n: int  # keys per block
    num_warps: int
    num_stages: int
    tma: bool | None = None  # False: pointer loads for this config's launches; None: where _tma_ok allows TMA


@dataclass(frozen=True)
class Configs:
    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig
    dkdv_fused: KernelConfig | None = None  # dk/dv with dQ fused in (using(fused_dq=True)); None: ``dkdv``

    def of(self, kind: str) -> KernelConfig:
        """The config of kernel ``kind``: fwd, dkdv, dq or dkdv_fused (``dkdv`` where that one is unset)."""
        c = getattr(self, kind)
        return self.dkdv if c is None else c


def default_configs(head_dim: int, device_type: str, elem_bytes: int = 2, ieee: bool = False,
                    tma: bool = False) -> Configs:
    """Block shapes per head dim and element size. H100/H200 picks from the sweeps in bench/ (bf16, D=128);
    fp32 tiles are halved so shared memory fits (checked with ptxas for sm_90); tiny ones for the interpreter.
    ``ieee``: fp32 dots in full fp32 (``_dot_precision``), which run on the FMA units and hold their products in
    registers: 32 x 32 tiles (dk/dv 16 x 16 above D = 64), the shapes that compile for sm_90 with (almost) no
    spills (compile_sm90.py "fp32 ieee"; 64 x 64 spilled 2 to 90 KB a thread). ``tma``: whether the launch loads
    its tiles through TMA (``_tma_ok``), which at D = 256 takes wider tiles than pointer loads."""
    if device_type != "cuda":
        c = KernelConfig(16, 16, 1, 1)
        return Configs(c, c, c)
    if ieee and head_dim <= 128:
        small = KernelConfig(32, 32, 4, 2, tma=False)
        dkdv = KernelConfig(32, 32, 8, 2, tma=False) if head_dim <= 64 else KernelConfig(16, 16, 4, 2, tma=False)
        return Configs(small, dkdv, small)
    if elem_bytes >= 4:
        if head_dim <= 128:
            return Configs(KernelConfig(64, 64, 8, 2), KernelConfig(32, 64, 8, 2), KernelConfig(64, 32, 4, 2))
        return Configs(KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 2))
    if head_dim <= 64:
        return Configs(KernelConfig(128, 64, 4, 3), KernelConfig(64, 128, 8, 2), KernelConfig(128, 64, 4, 3))
    if head_dim <= 128:  # dkdv_fused: 32 x 128, the fused variant with the fewest spills offline (compile_sm90.py)
        return Configs(KernelConfig(128, 128, 8, 3), KernelConfig(64, 128, 8, 3), KernelConfig(128, 64, 8, 3),
                       KernelConfig(32, 128, 8, 3))
    # D = 256, from bench_jfa.py --head-dim 256 --sweep configs (gem_lognormal, causal, H=4; one H100, 2026-12-05):
    # fwd 128 x 64 on TMA 1.74 ms against 3.34 on the earlier 64 x 64 pointer tiles, dk/dv 64 x 64 on TMA 7.35
    # against 9.72, dQ 128 x 32 on pointers 2.79 against 6.56 (its TMA tiles were slower: 64 x 32, 3.27). Without
    # TMA the forward takes 128 x 32 (2.39 ms); dk/dv keeps 32 x 64, the fastest pointer tile swept.
    if tma:
        return Configs(KernelConfig(128, 64, 8, 2), KernelConfig(64, 64, 8, 2), KernelConfig(128, 32, 8, 2, tma=False))
    return Configs(KernelConfig(128, 32, 8, 2), KernelConfig(32, 64, 8, 2), KernelConfig(128, 32, 8, 2))


@dataclass(frozen=True)
class Bucket:
    """A length bucket: sequences whose longer side, max(Lq, Lk), is at most ``max_len`` (and above the
    previous bucket's) run with ``configs``' tiles, in launches of their own."""
    max_len: int
    configs: Configs


# Buckets apply (on by default) where the average sequence is at most this long, decided from shapes alone (no
# host sync): gem_lognormal (average 1,529) and uniform_8k keep one launch per kernel, many short histories not.
SHORT_AVERAGE = 256
# On since 2026-12-02: on the H200 the family's GPU tests (jfa, gdpa, block attention, RoPE; 63) passed with the
# buckets on for every short test batch (GEMZOO_JFA_BUCKETS=1), and the short workload went from fwd 1.26 /
# fwd+bwd 4.31 ms to 0.68 / 2.67 (bench_jfa.py --sweep short). GEMZOO_JFA_BUCKETS=0 turns them off for a process.
BUCKETS_BY_DEFAULT = os.environ.get("GEMZOO_JFA_BUCKETS", "1").strip().lower() in ("1", "true", "on", "yes")


def short_buckets(head_dim: int, device_type: str, elem_bytes: int = 2) -> tuple[Bucket, ...]:
    """The short-sequence buckets for a head dim and element size (2-byte dtypes, D <= 128 on CUDA): sequences of
    at most 64 tokens, and of 65 to 128, on small tiles with pointer loads instead of 128 x 128 (forward) or
    64 x 128 (dk/dv) with TMA. From the H200 sweep on the short workload (bench_jfa.py --sweep short, 2026-12-02:
    one kernel at a time, the others fixed, each candidate checked against the unbucketed launch). <= 64:
    forward 64 x 32, 4 warps, 1 stage (0.77 ms against 1.09 on the earlier 64 x 64, 8 warps, 3 stages, TMA);
    dk/dv 16 q x 32 k, 2 warps (fwd+bwd 3.27 against 4.09); dq 64 x 64, 4 warps. 65..128: the same forward and
    dk/dv tiles won, and dq 64 x 32. Short programs are latency-bound: small tiles and one stage keep more of
    them resident per SM, and pointer loads fetch only the rows a sequence has (a TMA box its full height)."""
    if device_type != "cuda" or elem_bytes != 2 or head_dim > 128:
        return ()
    fwd, dkdv = KernelConfig(64, 32, 4, 1, tma=False), KernelConfig(16, 32, 2, 1, tma=False)
    return (Bucket(64, Configs(fwd, dkdv, KernelConfig(64, 64, 4, 1, tma=False))),
            Bucket(128, Configs(fwd, dkdv, KernelConfig(64, 32, 4, 1, tma=False))))


def default_buckets(head_dim: int, device_type: str, elem_bytes: int = 2) -> tuple[Bucket, ...]:
    """The buckets a short batch gets when KernelOptions.buckets is None: ``short_buckets`` while
    BUCKETS_BY_DEFAULT."""
    return short_buckets(head_dim, device_type, elem_bytes) if BUCKETS_BY_DEFAULT else ()


# The fp8 forward's modes (KernelOptions.fp8): off, Q and K in e4m3, or Q, K, V and P in e4m3.
FP8_MODES = ("off", "qk", "qkv")
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value


@dataclass(frozen=True)
class KernelOptions:
    """How the family's kernels run a call; the numerics are the same under every setting but ``fp8``.

    ``configs``: tile shapes for every launch (None: ``default_configs`` for the head dim and dtype).
    ``order``: the work schedule's order, one of ``ORDERS`` (see ``schedule.py``).
    ``tma``: None loads tiles through TMA where GPU-validated (see ``_tma_ok``), True wherever shapes allow
    (the interpreter included), False never.
    ``split``: the pointwise short-Q/long-K key split: None the heuristic (``split_plan``), 0 never, n that
    many splits per sequence.
    ``buckets``: None applies ``default_buckets`` to short batches; a tuple of Bucket applies to every batch
    (``()``: no buckets).
    ``fused_dq``: dQ inside the dk/dv kernel (fp32 atomics) instead of its own kernel (see ``launch_bwd``).
    ``fp8``: the forward on float8 e4m3 operands with per-block amax scales (``FP8_MODES``): "off"; "qk" Q and K
    (QK^T as an fp8 matmul, P V in the inputs' dtype); "qkv" V and P too (softmax only). The one option that
    changes the numerics: the forward's output is within about 2e-2 (normalised) of the exact one. The backward
    always runs on the saved inputs in their own dtype (softmax recomputes out and lse there first): gradients
    are those of the unquantised attention (straight-through). See ``quantize_fp8``.
    """

    configs: Configs | None = None
    order: str = "lpt"
    tma: bool | None = None
    split: int | None = None
    buckets: tuple[Bucket, ...] | None = None
    fused_dq: bool = False
    fp8: str = "off"

    def __post_init__(self):
        if self.fp8 not in FP8_MODES:
            raise ValueError(f"KernelOptions.fp8={self.fp8!r} is not an fp8 forward mode; choose one of "
                             f"{', '.join(FP8_MODES)}")
        if self.order not in ORDERS:
            raise ValueError(f"KernelOptions.order={self.order!r} is not a schedule order; choose one of "
                             f"{', '.join(ORDERS)}")
        if self.configs is not None and not isinstance(self.configs, Configs):
            raise TypeError(f"KernelOptions.configs must be a Configs (or None), got {type(self.configs).__name__}")
        if self.split is not None and (isinstance(self.split, bool) or not isinstance(self.split, int)
                                       or self.split < 0):
            raise ValueError(f"KernelOptions.split must be None (heuristic), 0 (never) or a positive number of "
                             f"splits, got {self.split!r}")
        if self.buckets is not None:
            buckets = tuple(self.buckets)
            if not all(isinstance(b, Bucket) for b in buckets):
                raise TypeError("KernelOptions.buckets must be None or a tuple of Bucket")
            if [b.max_len for b in buckets] != sorted({b.max_len for b in buckets}):
                raise ValueError("KernelOptions.buckets must have strictly increasing max_len, got "
                                 f"{[b.max_len for b in buckets]}")
            object.__setattr__(self, "buckets", buckets)


DEFAULT_OPTIONS = KernelOptions()

# A custom op's schema takes no dataclass: the ops take an index into this append-only table of the options
# seen so far (index 0 the defaults), so compiled and eager calls run with the same KernelOptions.
_INTERNED: list[KernelOptions] = [DEFAULT_OPTIONS]
_INDEX: dict[KernelOptions, int] = {DEFAULT_OPTIONS: 0}


def options_index(options: KernelOptions | None) -> int:
    """The index of ``options`` (None: the defaults) that the family's custom ops take."""
    if options is None:
        return 0
    if not isinstance(options, KernelOptions):
        raise TypeError(f"options must be a gemzoo_jfa.family.KernelOptions, got {type(options).__name__}")
    index = _INDEX.get(options)
    if index is None:
        index = _INDEX[options] = len(_INTERNED)
        _INTERNED.append(options)
    return index


def options_at(index: int) -> KernelOptions:
    """The KernelOptions of an index from ``options_index``."""
    return _INTERNED[index]


def _tma_ok(*tensors, tma: bool | None, causal: bool = True, pointwise: bool = False) -> bool:
    """Whether to load tiles through TMA tensor descriptors instead of pointers.

    Needs Hopper+ (or the interpreter when asked), power-of-two head dims and 16-byte strides. By default
    (``tma`` None) only the GPU-validated set: causal (or any pointwise activation), 2-byte dtypes, head
    dim 64 or 128, and causal softmax at head dim 256 (its TMA tiles compiled and ran in the 2026-12-05 sweep).
    With triton 3.6 ptxas crashed on the softmax non-causal dk/dv and, in an early run, on D=256 variants, and
    fp32 tiles do not fit. The pointer path spills heavily at 128-wide tiles (ptxas -v: 2-4 KB per thread),
    so the pointwise non-causal kernels (GEM's cross attention) use TMA: they compile with ptxas 3.6.
    """
    if tma is False:
        return False
    t0 = tensors[0]
    if t0.device.type == "cuda":
        if _major(torch.cuda.current_device() if t0.device.index is None else t0.device.index) < 9:
            return False
        d = t0.shape[-1]
        checked = ((causal or pointwise) and d in (64, 128)) or (causal and not pointwise and d == 256)
        if tma is None and not (t0.element_size() == 2 and checked):
            return False
    elif tma is not True:  # interpreter: only when asked for
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    for t in tensors:
        d = t.shape[-1]
        if d != _pow2(d) or t.shape[0] == 0 or t.data_ptr() % 16 or any(
                (st * t.element_size()) % 16 for st in t.stride()[:2]):
            return False
    return True


@functools.cache
def _major(index: int) -> int:
    """The compute capability's major version of CUDA device ``index``, read once per device: ``_tma_ok`` runs
    on every launch."""
    return torch.cuda.get_device_capability(index)[0]


def _desc(t: torch.Tensor, rows: int):
    """[T, H, D] tensor descriptor with [rows, 1, D] boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), [t.stride(0), t.stride(1), 1], [rows, 1, t.shape[2]])


def _configs(q: torch.Tensor, options: KernelOptions, tma: bool = False) -> Configs:
    if options.configs is not None:
        return options.configs
    return default_configs(q.shape[-1], q.device.type, q.element_size(), ieee=_dot_precision(q) == "ieee", tma=tma)


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _offsets(off: torch.Tensor) -> torch.Tensor:
    """The kernels index offsets with unit stride: a strided view (``t[::2]``) is copied first."""
    return off if off.is_contiguous() else off.contiguous()


def split_plan(q: torch.Tensor, k: torch.Tensor, batch: int, activation: int, block_m: int, block_n: int,
               split: int | None = None) -> tuple[int, int] | None:
    """(key splits per sequence, query block) for the short-Q/long-K path, or None to run unsplit.

    Pointwise only (softmax would need a logsumexp merge). Chosen from shapes alone (no host sync): on
    average at most 64 queries per sequence and at least 4 keys per query, i.e. GEM's candidates-over-history
    cross attention with few candidates. With more queries the unsplit grid already has enough programs: on the
    H200 (2026-12-05, gem-lognormal histories, H=4, D=128) 256 candidates ran the forward in 0.177 ms unsplit
    against 0.267 split, while 16 candidates took 0.111 split against 0.178. The query block shrinks to 64
    rows when the average sequence has at most 64 queries. Each sequence's keys are cut into the same number
    of splits (a power of two, about one per 256 keys of the average sequence, at most 16), so the longest
    history spreads over that many programs. ``split`` is KernelOptions.split: None the heuristic above, 0
    never, n that many splits.
    """
    if activation == 0 or split == 0 or batch == 0:
        return None
    tq, tk = q.shape[0], k.shape[0]
    if split is None and not (tq <= 64 * batch and tk >= 4 * tq):
        return None
    bm = min(block_m, 64) if tq <= 64 * batch else block_m
    if split is not None:
        return split, bm
    per_seq = -(-tk // (256 * batch))
    return min(1 << (per_seq - 1).bit_length(), 16), bm


def length_buckets(q: torch.Tensor, k: torch.Tensor, batch: int, kind: str, activation: int = 0, block: int = -1,
                   options: KernelOptions = DEFAULT_OPTIONS, tma: bool = False
                   ) -> list[tuple[KernelConfig, tuple[int, int | None] | None]]:
    """The launches of kernel ``kind`` (fwd, dkdv, dq, dkdv_fused): (tile config, length range (lo, hi] of max(Lq, Lk),
    or None for every sequence). One launch on the main tiles unless buckets apply (see default_buckets and
    SHORT_AVERAGE); never with the pointwise split-K path, which has its own short-query tiles. ``tma``: whether
    the launches load through TMA (the default tiles depend on it at D = 256)."""
    main = _configs(q, options, tma).of(kind)
    fixed = options.buckets
    buckets = fixed if fixed is not None else default_buckets(q.shape[-1], q.device.type, q.element_size())
    if not buckets or batch == 0 or (fixed is None and max(q.shape[0], k.shape[0]) > SHORT_AVERAGE * batch):
        return [(main, None)]
    if block <= 0 and split_plan(q, k, batch, activation, main.block_m, main.block_n, options.split):
        return [(main, None)]
    launches, lo = [], 0
    for b in buckets:
        launches.append((b.configs.of(kind), (lo, b.max_len)))
        lo = b.max_len
    if activation == 0 and block <= 0 and fixed is None and main.tma is None:
        # a short softmax batch's longer sequences load through pointers too: on the H200's short workload
        # (2026-12-02, one run) 2.633 ms fwd+bwd against 2.694 with TMA there; long batches keep TMA (uniform_8k
        # 15.52 against 14.95 with pointers). Pointwise activations keep TMA (their non-causal pointer path
        # spills at 128-wide tiles), and so do block masks (that variant's main tiles untried on pointers).
        main = replace(main, tma=False)
    return launches + [(main, (lo, None))]


def _act_scale(activation: int, scale: float) -> float:
    return scale * LOG2E if activation == 0 else scale  # softmax runs in base 2


def _q_items(q, k, q_offsets, k_offsets, c: KernelConfig, causal, window, activation, block, lengths,
             options: KernelOptions, kind: str = "fwd"):
    """Schedule of a query-block kernel (``kind`` fwd or dq): (items, block_m, key splits or 0). With a split the
    programs add into a zeroed fp32 buffer (``_split_target``). ``lengths`` is a length bucket (see
    length_buckets), never split. The heuristic split (KernelOptions.split None) applies to the forward only: on
    the H200 (2026-12-04, 64 candidates over gem-lognormal histories) the split forward took 0.130 ms against
    0.203 unsplit, but the split dQ made fwd+bwd 1.194 ms against 0.864 unsplit (its fp32 buffer is zeroed,
    added into and copied back for a backward whose unsplit dQ already spreads over the key blocks)."""
    from gemzoo_jfa.schedule import build_schedule

    win = None if window < 0 else window
    order = options.order
    heuristic_dq = kind == "dq" and options.split is None
    plan = None if block > 0 or lengths is not None or heuristic_dq else split_plan(
        q, k, q_offsets.numel() - 1, activation, c.block_m, c.block_n, options.split)
    if plan is None:
        items = build_schedule(q_offsets, k_offsets, q.shape[0], c.block_m, over="q", causal=causal, window=win,
                               order=order, block_size=block if block > 0 else None, lengths=lengths)
        return items, c.block_m, 0
    n_splits, bm = plan
    items = build_schedule(q_offsets, k_offsets, q.shape[0], bm, over="q", causal=causal, window=win, order=order,
                           splits=n_splits)
    return items, bm, n_splits


def _split_target(dest: torch.Tensor) -> torch.Tensor:
    """The zeroed fp32 buffer a split launch's programs add into: ``dest`` itself when fp32 (then nothing is
    copied after), else a new one copied into ``dest`` after the launch."""
    if dest.dtype == torch.float32:
        return dest.zero_()
    return torch.zeros(dest.shape, device=dest.device, dtype=torch.float32)


def _q_launches(q, k, dest, q_offsets, k_offsets, kind, causal, window, activation, block, tma, options):
    """Per launch of a query-block kernel (``kind`` fwd or dq), one per length bucket with items: (config,
    items, block_m, key splits or 0, the launch's target as its strides are known now (``dest``, or for a
    split of a non-fp32 ``dest`` a contiguous fp32 stand-in of its shape), the TMA box rows for K and V or 0
    for pointer loads, use_tma, item capacity)."""
    for cfg, lengths in length_buckets(q, k, q_offsets.numel() - 1, kind, activation, block, options, tma):
        items, bm, split_n = _q_items(q, k, q_offsets, k_offsets, cfg, causal, window, activation, block, lengths,
                                      options, kind)
        if items.shape[1]:
            use_tma = bool(tma and cfg.tma is not False)
            target = dest if not split_n or dest.dtype == torch.float32 else _Strides(dest.shape)
            yield cfg, items, bm, split_n, target, cfg.block_n if use_tma else 0, use_tma, items.shape[1]


class _Strides:
    """What a launch plan reads of a contiguous tensor not allocated yet: its strides."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def stride(self, dim=None):
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        strides = tuple(reversed(strides))
        return strides if dim is None else strides[dim]


def _rows(*tensors) -> tuple:
    """(stride(0), stride(1)) of each tensor, flattened: the kernels' row and head strides."""
    return tuple(st for t in tensors for st in t.stride()[:2])


class _Launch:
    """One planned launch: grid, schedule, key splits (0: none), TMA box rows for the descriptors built per call
    (0: pointer loads), the positional arguments after the per-call tensors, and the keyword arguments."""

    __slots__ = ("grid", "items", "split", "desc_rows", "args", "kw")

    def __init__(self, grid, items, split, desc_rows, args, kw):
        self.grid, self.items, self.split, self.desc_rows, self.args, self.kw = grid, items, split, desc_rows, args, kw


# Launch plans by offsets tensors (identity and version) and call signature: a model's layers share one batch's
# offsets and shapes, so the work between the input check and the launches (length buckets, split plan,
# schedule look-ups, tile configs, the ~30 launch arguments) runs once per batch and kernel, not per call.
_plans = TensorCache(64)


def _plan(q_offsets, k_offsets, key: tuple, options: KernelOptions, build) -> list[_Launch]:
    """``build()`` (a list of _Launch), or the list built for an earlier call with the same offsets tensors
    (unchanged), ``key`` and ``options`` object (the entry holds it, so its id is not reused while cached)."""
    options_held, launches = _plans.get((q_offsets, k_offsets), (*key, id(options)), lambda: (options, build()))
    return launches if options_held is options else build()


def _warps(c: KernelConfig, bm: int) -> int:
    return c.num_warps  # also for the 64-row split blocks: 4 warps spill there (ptxas -v), 8 do not


def _rope_c(rope_theta: float, head_dim: int) -> float:
    """The kernels' RoPE constant -2 log2(theta) / D (0.0: no rotary)."""
    return -2.0 * math.log2(rope_theta) / head_dim if rope_theta > 0 else 0.0


def launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, lse, activation=0, inv_norm=1.0,
               block=-1, rope_theta=0.0, options: KernelOptions = DEFAULT_OPTIONS, rel: dict | None = None):
    """out (and, for softmax, the base-2 lse [H, Tq]) of the forward pass; ``activation`` is a code of
    ACTIVATION_CODES. Pointwise short-Q/long-K batches take the split-K path (see split_plan). ``block``
    > 0 is block_size, ``rope_theta`` > 0 fuses RoPE (-1 and 0: off); ``options`` the tiles, order, TMA,
    split and buckets (KernelOptions); ``rel`` a relative bias's kernel arguments (``relative_bias_args``).
    The launches (schedules, tiles, argument lists) are planned once per offsets tensors and call signature
    (see ``_plan``)."""
    kernels = _kernels()

    q_offsets, k_offsets = _offsets(q_offsets), _offsets(k_offsets)
    tma = rope_theta <= 0 and _tma_ok(k, v, tma=options.tma, causal=causal, pointwise=activation != 0)
    qx, kx, vx, fp8 = q, k, v, {}
    if options.fp8 != "off":  # the e4m3 operands and their scales are per call; the plan sees their layouts
        options = fp8_options(q, options)
        qx, kx, vx, fp8 = _fp8_operands(q, k, v, q_offsets, k_offsets, activation, rope_theta, options)
        tma = tma and _fp8_tma_ok(kx, vx)
    v_strides = (vx.stride(0), vx.stride(1)) if vx is v else (1, vx.stride(0))  # an e4m3 V is [H, DV, T]
    bd = max(_pow2(q.shape[2]), 32) if fp8 else _pow2(q.shape[2])  # an e4m3 dot contracts over >= 32
    key = ("fwd", qx.shape, qx.stride(), kx.shape, kx.stride(), vx.shape, vx.stride(), qx.dtype, vx.dtype, out.shape,
           out.stride(), out.dtype, q.dtype, q.device, causal, scale, window, activation, inv_norm, block, rope_theta,
           tma, _dot_precision(q))
    launches = _plan(q_offsets, k_offsets, key, options, lambda: [
        _Launch((cap * q.shape[1],), items, split_n, rows, (
            cap, q.shape[0], _act_scale(activation, scale), inv_norm, max(window, 0), split_n, qx.stride(0),
            qx.stride(1), kx.stride(0), kx.stride(1), *v_strides, target.stride(0), target.stride(1)), dict(
            H=q.shape[1], GROUP=_group(q, k), D=q.shape[2], DV=v.shape[2], BD=bd, BDV=_pow2(v.shape[2]),
            BM=bm, BN=cfg.block_n, CAUSAL=causal, WINDOWED=window >= 0, UPCAST=q.device.type != "cuda",
            USE_TMA=use_tma, ACT=activation, SPLIT=split_n > 0, DOT=_dot_precision(q), num_warps=_warps(cfg, bm),
            num_stages=cfg.num_stages, **_block_rope(block, rope_theta, q.shape[2])))
        for cfg, items, bm, split_n, target, rows, use_tma, cap in _q_launches(q, k, out, q_offsets, k_offsets,
                                                                              "fwd", causal, window, activation,
                                                                              block, tma, options)])
    for launch in launches:
        target = _split_target(out) if launch.split else out
        if not launch.desc_rows:
            kd, vd = kx, vx
        elif fp8:
            kd, vd = _fp8_descs(kx, vx, launch.desc_rows)
        else:
            kd, vd = _desc(k, launch.desc_rows), _desc(v, launch.desc_rows)
        kernels.attn_fwd_kernel[launch.grid](
            qx, kx, vx, target, lse if activation == 0 else target, q_offsets, k_offsets, launch.items, kd, vd,
            *launch.args, **launch.kw, **(rel or {}), **fp8,
        )
        if target is not out:
            out.copy_(target)


def fp8_options(q: torch.Tensor, options: KernelOptions, device_type: str | None = None) -> KernelOptions:
    """``options`` with the fp8 forward's main tiles where they differ from bf16's: for "qkv" on CUDA with D <=
    128 and no configs of the caller's, forward tiles of 128 x 64 (8 warps, 3 stages). Chosen offline
    (bench/compile_sm90.py, ptxas for sm_90a): the e4m3 V, loaded through pointers, spills 3.1 KB per thread at
    128 x 128 and 0.7 KB at 128 x 64 (bf16's 128 x 128 TMA forward: 0.4 KB); not yet timed on a GPU.
    ``device_type`` (default q's) the device whose tiles to take (the CPU emulation takes CUDA's)."""
    dev = device_type or q.device.type
    if options.fp8 != "qkv" or options.configs is not None or dev != "cuda" or q.shape[-1] > 128:
        return options
    return _fp8_qkv_options(options, q.shape[-1], q.element_size())


@functools.lru_cache(maxsize=64)
def _fp8_qkv_options(options: KernelOptions, head_dim: int, elem_bytes: int) -> KernelOptions:
    """fp8_options' "qkv" tiles, one object per (options, head dim, element size), so that the launch plans
    (keyed by the options object) are reused from call to call."""
    c = default_configs(head_dim, "cuda", elem_bytes)
    return replace(options, configs=replace(c, fwd=KernelConfig(128, 64, 8, 3)))


def fp8_blocks(q: torch.Tensor, options: KernelOptions, device_type: str | None = None) -> tuple[int, int]:
    """(rows of Q, rows of K and V) per fp8 scale block: the forward's main tile (block_m, block_n) on
    ``device_type`` (default q's), so a scale covers one tile of the long sequences and a whole short sequence
    (blocks start at each sequence's start and never straddle two). Any block size is exact in the kernel,
    whose scales are per row (see quantize_fp8)."""
    dev = device_type or q.device.type
    options = fp8_options(q, options, dev)
    c = (options.configs or default_configs(q.shape[-1], dev, q.element_size())).fwd
    return c.block_m, c.block_n


def quantize_fp8(x: torch.Tensor, offsets: torch.Tensor, block: int, transpose: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 copy of the jagged ``x`` [T, H, D], fp32 scales [H, T]) on x's device, without a host sync.

    Each head's rows are cut into blocks of ``block`` rows from every sequence's start; a block's scale is its
    amax / 448 and its e4m3 values are clamp(x * (448 / amax), +-448) rounded to nearest even (an all-zero
    block: scale 0, values 0). The amax ignores NaN: a NaN stays NaN in its element, and its row's scale is NaN. Every row of a block holds the block's scale in the [H, T] array, so a kernel
    reads a row's scale without knowing the blocks. ``transpose``: the copy is laid out [H, D, T] (the keys
    contiguous, the K-major B operand Hopper's fp8 wgmma takes for P V). ``quantize_fp8_reference`` is the same
    rule in torch."""
    from gemzoo_jfa import kernels
    from gemzoo_jfa.schedule import build_schedule

    if block < 1 or block & (block - 1):
        raise ValueError(f"quantize_fp8: block must be a power of two, got {block}")
    t, h, d = x.shape
    x = last_dim_contiguous(x)
    offsets = _offsets(offsets)
    if transpose:  # T padded to 16 in the strides (16-byte aligned rows for the kernel's vector loads)
        y = torch.empty(h, d, -(-t // 16) * 16, device=x.device, dtype=torch.float8_e4m3fn)[:, :, :t]
        ys = (1, y.stride(0), y.stride(1))
    else:
        y = torch.empty(t, h, d, device=x.device, dtype=torch.float8_e4m3fn)
        ys = (y.stride(0), y.stride(1), 1)
    s = torch.empty(h, t, device=x.device, dtype=torch.float32)
    if t == 0 or h == 0 or d == 0:
        return y, s
    items = build_schedule(offsets, offsets, t, block, over="q", causal=False, window=None, order="natural")
    cap = items.shape[1]
    if cap:
        upcast = x.device.type != "cuda"
        kernels.quant_fp8_kernel[(cap * h,)](x, y, s, offsets, items, cap, t, x.stride(0), x.stride(1), *ys, H=h, D=d,
                                             BD=_pow2(d), G=block, EXACT=upcast,
                                             num_warps=1 if upcast else 8)  # 4 warps spill 15 KB (ptxas, G=D=128)
    return y, s


def quantize_fp8_reference(x: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8's rule in torch (any device; the CPU emulation of the fp8 forward and the kernel's test):
    (e4m3 [T, H, D], fp32 scales [H, T])."""
    t, h, d = x.shape
    lengths = offsets[1:] - offsets[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths, output_size=t)
    pos = torch.arange(t, device=x.device) - offsets[:-1][seq]
    first = torch.cumsum((lengths + block - 1) // block, 0) - (lengths + block - 1) // block
    blk = first[seq] + pos // block  # [T] global block id
    xf = x.float()
    row_amax = xf.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(-1) if d else xf.new_zeros(t, h)  # NaN: kept
    # in its element (as the kernel), not spread over its block
    n_blocks = t // block + lengths.numel()  # at least the real count, known without a host sync
    amax = torch.zeros(n_blocks, h, device=x.device).scatter_reduce_(
        0, blk[:, None].expand(t, h), row_amax, "amax")[blk]  # [T, H]
    inv = torch.where(amax > 0, 448.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    y = (xf * inv[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scales = torch.where(torch.isnan(xf).any(-1) if d else row_amax.bool(), float("nan"), amax / 448.0)
    return y, scales.t().contiguous()


def dequantize_fp8(y: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values an e4m3 tensor [T, H, D] with scales [H, T] stands for, in ``dtype``."""
    return (y.float() * scales.t()[..., None]).to(dtype)


def _fp8_tma_ok(k8: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fp8 forward's K (and V, when in the inputs' dtype [T, H, DV]) can be TMA loaded: power-of-two
    head dims of at least 32 (an e4m3 dot contracts over 32 or more: smaller D pads its tile to 32 columns, wider
    than a TMA box of D), 16-byte aligned base and strides, and at most 128 (the D = 256 TMA tiles were swept in
    bf16 only). An e4m3 V ([H, DV, T]) always loads through pointers."""
    if not 32 <= k8.shape[-1] <= 128:
        return False
    for t in (k8,) if v.dtype == torch.float8_e4m3fn else (k8, v):
        d = t.shape[-1]
        if d != _pow2(d) or t.numel() == 0 or t.data_ptr() % 16 or any(
                (st * t.element_size()) % 16 for st in t.stride()[:2]):
            return False
    return True


def _fp8_descs(k8: torch.Tensor, v: torch.Tensor, block_n: int):
    """(K, V) of the fp8 forward's TMA launches for key tiles of ``block_n`` rows: [T, H, D] descriptors with
    [rows, 1, D] boxes, except an e4m3 V, passed as itself (the kernel loads it through pointers, see _load_vt)."""
    return _desc(k8, block_n), v if v.dtype == torch.float8_e4m3fn else _desc(v, block_n)


def _fp8_operands(q, k, v, q_offsets, k_offsets, activation, rope_theta, options):
    """(q, k, v as the fp8 forward reads them, the kernel's FP8 arguments) for KernelOptions.fp8 qk / qkv."""
    if rope_theta > 0:
        raise ValueError("KernelOptions.fp8 does not combine with the fused RoPE (the kernel rotates tiles it "
                         "loads in the inputs' dtype); rotate q and k first or use fp8='off'")
    if options.fp8 == "qkv" and activation != 0:
        raise ValueError("KernelOptions.fp8='qkv' needs softmax: a pointwise activation's P is unbounded, so it "
                         "cannot be cast to e4m3 with a fixed scale; use fp8='qk' (P V stays in the inputs' dtype)")
    gq, gk = fp8_blocks(q, options)
    q8, qs = quantize_fp8(q, q_offsets, gq)
    k8, ks = quantize_fp8(k, k_offsets, gk)
    kw = dict(FP8=1, QS=qs, KS=ks, Tk=k.shape[0])
    if options.fp8 == "qkv":
        v, vs = quantize_fp8(v, k_offsets, gk, transpose=True)
        kw.update(FP8=2, VS=vs, stride_vd=v.stride(1))
    return q8, k8, v, kw


def _block_rope(block, rope_theta, head_dim) -> dict:
    """The kernels' block and rotary arguments (defaults when off, so those variants compile as before)."""
    kw = {}
    if block > 0:
        kw.update(block=block, BLOCKED=True)
    if rope_theta > 0:
        kw.update(rope_c=_rope_c(rope_theta, head_dim), ROPE=True)
    return kw


def launch_bwd(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, dq, dk, dv_, activation=0,
               inv_norm=1.0, block=-1, rope_theta=0.0, options: KernelOptions = DEFAULT_OPTIONS,
               rel: dict | None = None):
    """dq, dk, dv. Softmax needs out and lse (delta preprocess); pointwise ignores both. With ``rel`` (a
    relative bias's kernel arguments, ``relative_bias_args``) returns the gradients of its tables
    (positions, time_weights or None), from the dk/dv kernel's per-program partial sums (``REL_SLOTS`` rows).

    With ``KernelOptions(fused_dq=True)`` the dk/dv kernel also adds each (key block, query block) pair's share of dQ to
    an fp32 buffer with atomics, FA2-style: 5 matmuls a pair instead of the 7 of a separate dq kernel (which
    recomputes QK^T and dO V^T), for fp32 atomic traffic and one scaling pass. Off by default until measured on
    the H200 (bench_jfa.py --sweep fused_dq)."""
    q_offsets, k_offsets = _offsets(q_offsets), _offsets(k_offsets)
    delta = _launch_preprocess(out, do) if activation == 0 else None
    acc = torch.zeros(dq.shape, device=dq.device, dtype=torch.float32) if options.fused_dq else None
    rel_grad = None
    if rel is not None:
        rel_grad = torch.zeros(REL_SLOTS, rel["n_pos"] + (rel["n_tw"] if rel["REL"] == 2 else 0), device=q.device,
                               dtype=torch.float32)
        rel = dict(rel, RB_GRAD=rel_grad, rb_slots=REL_SLOTS, rb_width=rel_grad.shape[1])
    _launch_dkdv(do, q, k, v, lse, delta, q_offsets, k_offsets, causal, scale, window, dk, dv_, activation, inv_norm,
                 block, rope_theta, options, dq_acc=acc, rel=rel)
    if acc is not None:
        dq.copy_(acc.mul_(scale * (1.0 if activation == 0 else inv_norm)))
    else:
        dq_rel = None if rel is None else {n: a for n, a in rel.items() if n not in ("RB_GRAD", "rb_slots", "rb_width")}
        _launch_dq(do, q, k, v, lse, delta, q_offsets, k_offsets, causal, scale, window, dq, activation, inv_norm,
                   block, rope_theta, options, rel=dq_rel)
    if rel_grad is None:
        return None
    return _rel_table_grads(rel_grad, rel, 1.0 if activation == 0 else inv_norm)


# Rows of the relative bias's table-gradient buffer: dk/dv program p adds into row p % REL_SLOTS (no atomics
# shared by every program), and one sum over rows reduces it.
REL_SLOTS = 512


def relative_bias_args(positions, time_weights=None, q_times=None, k_times=None, bucket_divisor=1.0) -> dict:
    """The kernels' arguments for a relative bias (``gemzoo.api.RelativeAttentionBias``'s fields): REL 1
    (positions) or 2 (positions + time buckets), the contiguous tables and timestamps, their sizes."""
    kw = dict(RB_POS=positions.contiguous(), n_pos=positions.numel(), REL=1)
    if time_weights is not None:
        kw.update(RB_TW=time_weights.contiguous(), RB_QT=q_times.contiguous(), RB_KT=k_times.contiguous(),
                  n_tw=time_weights.numel(), rb_div=float(bucket_divisor), REL=2)
    return kw


def _rel_table_grads(buf, rel, grad_scale):
    """(d positions, d time_weights or None) in the tables' dtypes from the [REL_SLOTS, width] partial sums."""
    n_pos = rel["n_pos"]  # one sum per table: two fresh tensors, no views of one buffer

    def table(cols, like):
        return buf[:, cols].sum(0).mul_(grad_scale).to(like.dtype)

    return table(slice(0, n_pos), rel["RB_POS"]), table(slice(n_pos, None), rel["RB_TW"]) if rel["REL"] == 2 else None


def _kernels():
    """gemzoo_jfa.kernels, imported on first use (importing the family does not import Triton). Its kernels are
    read from the module at each launch, so a replaced attribute (a test's stub) takes effect."""
    global _KERNELS
    if _KERNELS is None:
        from gemzoo_jfa import kernels

        _KERNELS = kernels
    return _KERNELS


_KERNELS = None
_PREPROCESS: dict = {}  # (shape, strides, device type) -> (grid, arguments after the tensors, keyword arguments)


def _launch_preprocess(out, do):
    """delta [H, Tq] = rowsum(out * do) in fp32."""
    kernels = _kernels()
    tq, h, dv = out.shape
    delta = torch.empty(h, tq, device=out.device, dtype=torch.float32)
    key = (out.shape, out.stride(), do.stride(), out.device.type)
    plan = _PREPROCESS.get(key)
    if plan is None:
        upcast = out.device.type != "cuda"
        bt = 64 if upcast else 128
        plan = ((_cdiv(tq, bt), h), (tq, out.stride(0), out.stride(1), do.stride(0), do.stride(1)),
                dict(DV=dv, BDV=_pow2(dv), BT=bt, num_warps=1 if upcast else 4))
        if len(_PREPROCESS) >= 256:
            _PREPROCESS.clear()
        _PREPROCESS[key] = plan
    grid, args, kw = plan
    kernels.attn_bwd_preprocess[grid](out, do, delta, *args, **kw)
    return delta


def _dot_precision(q: torch.Tensor) -> str:
    """The kernels' dot precision (their ``DOT``) for operands of q's dtype: fp32 operands multiply in full fp32
    ("ieee") under torch's default ``float32_matmul_precision`` ("highest"), and in TF32 under "high" or "medium",
    as torch.matmul and Inductor's templates do. Other dtypes ignore it ("tf32", Triton's default)."""
    return "ieee" if q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"


def _group(q: torch.Tensor, kv: torch.Tensor) -> int:
    """Query heads per k/v head (grouped-query attention; 1 for multi-head): q head h reads k/v head h // group."""
    return q.shape[1] // max(kv.shape[1], 1)


def _common(q, v, causal, window, activation):
    d, dv = q.shape[2], v.shape[2]
    return dict(H=q.shape[1], GROUP=_group(q, v), D=d, DV=dv, BD=_pow2(d), BDV=_pow2(dv), CAUSAL=causal, WINDOWED=window >= 0,
                UPCAST=q.device.type != "cuda", ACT=activation, DOT=_dot_precision(q))


def _launch_dkdv(do, q, k, v, lse, delta, q_offsets, k_offsets, causal, scale, window, dk, dv_, activation, inv_norm,
                 block, rope_theta, options: KernelOptions, dq_acc=None, rel=None):
    kernels = _kernels()
    q_offsets, k_offsets = _offsets(q_offsets), _offsets(k_offsets)
    tma = rope_theta <= 0 and _tma_ok(q, do, tma=options.tma, causal=causal, pointwise=activation != 0)
    if activation != 0:  # no lse/delta: any fp32 tensor stands in (never read)
        lse = delta = dk
    kind = "dkdv" if dq_acc is None else "dkdv_fused"

    def build():
        from gemzoo_jfa.schedule import build_schedule

        launches = []
        for c, lengths in length_buckets(q, k, q_offsets.numel() - 1, kind, activation, block, options, tma):
            items = build_schedule(q_offsets, k_offsets, k.shape[0], c.block_n, over="k", causal=causal,
                                   window=None if window < 0 else window, order=options.order,
                                   block_size=block if block > 0 else None, lengths=lengths)
            cap = items.shape[1]
            if cap == 0:
                continue
            use_tma = bool(tma and c.tma is not False)
            launches.append(_Launch(
                (cap * k.shape[1],), items, 0, c.block_m if use_tma else 0,  # one program per k/v head
                (cap, q.shape[0], _act_scale(activation, scale), scale * inv_norm,
                 1.0 if activation == 0 else inv_norm, max(window, 0), *_rows(q, k, v, do, dk, dv_)),
                dict(BM=c.block_m, BN=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages, USE_TMA=use_tma,
                     **_common(q, v, causal, window, activation), **_block_rope(block, rope_theta, q.shape[2]))))
        return launches

    key = (kind, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), do.stride(), dk.stride(),
           dv_.stride(), q.dtype, q.device, causal, scale, window, activation, inv_norm, block, rope_theta, tma,
           _dot_precision(q))
    fused = {} if dq_acc is None else dict(DQACC=dq_acc, stride_dqt=dq_acc.stride(0), stride_dqh=dq_acc.stride(1),
                                           FUSED_DQ=True)
    for launch in _plan(q_offsets, k_offsets, key, options, build):
        qd, dod = (_desc(q, launch.desc_rows), _desc(do, launch.desc_rows)) if launch.desc_rows else (q, do)
        kernels.attn_bwd_dkdv_kernel[launch.grid](  # a program loops over its k/v head's group of q heads
            q, k, v, do, lse, delta, dk, dv_, q_offsets, k_offsets, launch.items, qd, dod, *launch.args,
            **launch.kw, **fused, **(rel or {}),
        )


def _launch_dq(do, q, k, v, lse, delta, q_offsets, k_offsets, causal, scale, window, dq, activation, inv_norm, block,
               rope_theta, options: KernelOptions, rel=None):
    kernels = _kernels()

    q_offsets, k_offsets = _offsets(q_offsets), _offsets(k_offsets)
    tma = rope_theta <= 0 and _tma_ok(k, v, tma=options.tma, causal=causal, pointwise=activation != 0)
    key = ("dq", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), do.stride(), dq.shape, dq.stride(), dq.dtype,
           q.dtype, q.device, causal, scale, window, activation, inv_norm, block, rope_theta, tma, _dot_precision(q))
    launches = _plan(q_offsets, k_offsets, key, options, lambda: [
        _Launch((cap * q.shape[1],), items, split_n, rows, (
            cap, q.shape[0], _act_scale(activation, scale), scale * (1.0 if activation == 0 else inv_norm),
            max(window, 0), split_n, *_rows(q, k, v, do, target)), dict(
            BM=bm, BN=c.block_n, num_warps=_warps(c, bm), num_stages=c.num_stages, USE_TMA=use_tma,
            SPLIT=split_n > 0, **_common(q, v, causal, window, activation),
            **_block_rope(block, rope_theta, q.shape[2])))
        for c, items, bm, split_n, target, rows, use_tma, cap in _q_launches(q, k, dq, q_offsets, k_offsets, "dq",
                                                                            causal, window, activation, block, tma,
                                                                            options)])
    for launch in launches:
        target = _split_target(dq) if launch.split else dq
        kd, vd = (_desc(k, launch.desc_rows), _desc(v, launch.desc_rows)) if launch.desc_rows else (k, v)
        if activation != 0:
            lse = delta = target
        kernels.attn_bwd_dq_kernel[launch.grid](
            q, k, v, do, lse, delta, target, q_offsets, k_offsets, launch.items, kd, vd, *launch.args,
            **launch.kw, **(rel or {}),
        )
        if target is not dq:
            dq.copy_(target)


def backward(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, activation=0, inv_norm=1.0,
             block=-1, rope_theta=0.0, options: KernelOptions = DEFAULT_OPTIONS, rel: dict | None = None):
    """(dq, dk, dv) in fresh tensors, empty batches included (the body of jfa's, gdpa's and block-attention's
    bwd ops); with ``rel`` (``relative_bias_args``) followed by the gradients of its tables (positions,
    time_weights or None)."""
    do = do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if options.fp8 != "off":  # straight-through: the gradients of the unquantised attention
        options = replace(options, fp8="off")
        if activation == 0 and q.shape[0] and q.shape[1] and k.shape[0]:
            # out and lse of the saved inputs: the fp8 forward's are off by up to ~2e-2, which would bias delta
            # and P; pointwise backward reads neither
            out, lse = torch.empty_like(out), torch.empty_like(lse)
            launch_fwd(q, k, v, q_offsets, k_offsets, causal, scale, window, out, lse, activation, inv_norm, block,
                       rope_theta, options, rel)
    if q.shape[0] == 0 or q.shape[1] == 0 or k.shape[0] == 0:  # no pair: nothing reaches k, v or the tables
        grads = dq.zero_(), dk.zero_(), dv.zero_()
        if rel is None:
            return grads
        return grads + (torch.zeros_like(rel["RB_POS"]), torch.zeros_like(rel["RB_TW"]) if rel["REL"] == 2 else None)
    table_grads = launch_bwd(do, q, k, v, out, lse, q_offsets, k_offsets, causal, scale, window, dq, dk, dv,
                             activation, inv_norm, block, rope_theta, options, rel=rel)
    return (dq, dk, dv) if rel is None else (dq, dk, dv) + table_grads


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b

# -- eager autograd and the custom ops ---------------------------------------------------------------

class _EagerAttention(torch.autograd.Function):
    """Eager autograd for the family's ops (jfa, gdpa, block-attention): the same forward and backward bodies
    as their custom ops, in one autograd.Function. A custom op's Python dispatch (schema parsing, autograd and
    backend redispatch, twice a step) cost about 0.3 ms of host time per call on the H200's host, more than the
    kernels of short sequences take (block 64 at L = 8K: 0.22 ms on the GPU, 1.7 ms of wall time)."""

    @staticmethod
    def forward(ctx, fwd, bwd, q, k, v, q_offsets, k_offsets, *args):
        out, lse = fwd(q, k, v, q_offsets, k_offsets, *args)
        ctx.bwd, ctx.args = bwd, args
        ctx.save_for_backward(q, k, v, out, lse, q_offsets, k_offsets)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_offsets, k_offsets = ctx.saved_tensors
        dq, dk, dv = ctx.bwd(dout, q, k, v, out, lse, q_offsets, k_offsets, *ctx.args)
        return (None, None, dq, dk, dv, None, None) + (None,) * len(ctx.args)


def _traced(q: torch.Tensor) -> bool:
    """Whether ``q`` calls for the custom op (torch.compile, fake or meta tensors) instead of the bodies. A
    plain tensor that is not functionalized is never fake: the costlier ``is_fake`` runs only for the rest."""
    if torch.compiler.is_compiling() or q.device.type == "meta":
        return True
    return (type(q) is not torch.Tensor or torch._is_functional_tensor(q)) and is_fake(q)


def run_attention(op, fwd, bwd, q, k, v, q_offsets, k_offsets, *args) -> torch.Tensor:
    """Attention output through a family member's bodies: ``fwd(q, k, v, q_offsets, k_offsets, *args) ->
    (out, lse or None)`` and ``bwd(do, q, k, v, out, lse, q_offsets, k_offsets, *args) -> (dq, dk, dv)``.

    Under torch.compile (and on fake or meta tensors) ``op(q, k, v, q_offsets, k_offsets, *args) -> out``, the
    custom op, which has a fake implementation; in eager with gradients the bodies through _EagerAttention;
    without gradients the forward body alone."""
    if _traced(q):
        return op(q, k, v, q_offsets, k_offsets, *args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(fwd, bwd, q, k, v, q_offsets, k_offsets, *args)
    return fwd(q, k, v, q_offsets, k_offsets, *args)[0]

class _EagerRelAttention(torch.autograd.Function):
    """_EagerAttention with a relative bias: also differentiable in its tables (positions, time_weights)."""

    @staticmethod
    def forward(ctx, fwd, bwd, q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, *args):
        out, lse = fwd(q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, *args)
        ctx.bwd, ctx.args = bwd, args
        ctx.save_for_backward(q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights, q_times, k_times)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights, q_times, k_times = ctx.saved_tensors
        dq, dk, dv, d_pos, d_tw = ctx.bwd(dout, q, k, v, out, lse, q_offsets, k_offsets, positions, time_weights,
                                          q_times, k_times, *ctx.args)
        return (None, None, dq, dk, dv, None, None, d_pos, None if time_weights is None else d_tw, None,
                None) + (None,) * len(ctx.args)


def run_attention_rel(op, fwd, bwd, q, k, v, q_offsets, k_offsets, rb, *args) -> torch.Tensor:
    """run_attention with a relative bias ``rb`` (a ``gemzoo.api.RelativeAttentionBias``): ``fwd`` and ``op``
    take (q, k, v, q_offsets, k_offsets, positions, time_weights, q_times, k_times, *args), ``bwd`` (do, q, k,
    v, out, lse, q_offsets, k_offsets, positions, time_weights, q_times, k_times, *args) and returns (dq, dk,
    dv, d positions, d time_weights); ``args`` end with ``rb.bucket_divisor`` where the bodies take it."""
    tensors = (rb.positions, rb.time_weights, rb.q_times, rb.k_times)
    if _traced(q):
        return op(q, k, v, q_offsets, k_offsets, *tensors, *args)
    grads = [t is not None and t.requires_grad for t in (q, k, v, rb.positions, rb.time_weights)]
    if torch.is_grad_enabled() and any(grads):
        return _EagerRelAttention.apply(fwd, bwd, q, k, v, q_offsets, k_offsets, *tensors, *args)
    return fwd(q, k, v, q_offsets, k_offsets, *tensors, *args)[0]


def check_triton_inputs(kernel, name: str, q, k, v, q_offsets, k_offsets, **options):
    """The input check of every Triton path on this kernel family (jfa, gdpa, block-attention): the shared
    one (gemzoo.api.check_inputs) against ``kernel``'s declared capabilities, so an option it
    does not declare fails the same way on every device, plus the kernels' own limit on Dv. Returns
    contiguous (q_offsets, k_offsets)."""
    q_offsets, k_offsets = check_inputs(q, k, v, q_offsets, k_offsets, capabilities=kernel.capabilities,
                                        kernel=kernel, **options)
    if v.shape[2] > MAX_HEAD_DIM:
        raise JaggedShapeError(f"{name} supports head dims up to {MAX_HEAD_DIM}, got Dv={v.shape[2]}; "
                               "split heads further or use attention='reference'")
    return q_offsets, k_offsets


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has unit stride (what the kernels index), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


__all__ = ["ACTIVATION_CODES", "Bucket", "Configs", "DEFAULT_OPTIONS", "DTYPES", "FAMILY_CAPABILITIES", "KernelConfig",
           "KernelOptions", "E4M3_MAX", "FP8_MODES", "MAX_HEAD_DIM", "ORDERS", "SHORT_AVERAGE", "BUCKETS_BY_DEFAULT", "backward",
           "check_triton_inputs", "default_buckets", "default_configs", "dequantize_fp8", "fp8_blocks", "fp8_options", "last_dim_contiguous", "launch_bwd",
           "launch_fwd", "length_buckets", "options_at", "options_index", "relative_bias_args", "REL_SLOTS",
           "quantize_fp8", "quantize_fp8_reference", "run_attention", "run_attention_rel", "short_buckets",
           "split_plan"]
