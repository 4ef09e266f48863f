"""Attention conformance: random jagged batches (zero-length sequences included) against ``reference``.

Each case has a ``check``: ``match`` (forward and gradients against ``reference``), ``hints`` (hints smaller
than a real length raise, exact or larger ones change nothing), ``unsupported`` (every option outside the
declared capabilities raises PluginError; window=0 and block_size=0 raise ValueError), ``nan`` (a NaN in
one sequence's q, k or v reaches the rows that see it, never another sequence; rows with no allowed key
stay exactly 0). Kernels that declare ``relative_bias`` also get ``match`` cases with a
:class:`RelativeAttentionBias` (positions only, and positions + time buckets), whose tables' gradients are
compared too. Kernels that declare ``grouped_kv`` get grouped-query cases (k/v with fewer heads than q: 4 over
2, MQA's 1, 6 over 3) in ``match`` and ``nan`` checks; the others get k/v with one head in their
``unsupported`` check. docs/attention.md is the contract these test.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from gemzoo import registry
from gemzoo.attention import allowed_mask, reference_attention
from gemzoo.errors import JaggedShapeError, PluginError
from gemzoo.interfaces.attention import ACTIVATIONS, AttentionCapabilities, AttentionRequest, RelativeAttentionBias
from gemzoo.jagged import lengths_to_offsets, max_length
from gemzoo.profiling import cuda_graph

# bf16/fp16 kernels land under 1e-2 (docs/benchmarks.md); fp32 kernels may use TF32 dots on GPU under
# torch.set_float32_matmul_precision("high").
TOLERANCE = {torch.float64: 1e-6, torch.float32: 5e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class AttentionCase:
    activation: str = "softmax"
    causal: bool = True
    asymmetric: bool = False
    window: int | None = None
    block_size: int | None = None
    norm: float | None = None
    rope_theta: float | None = None
    heads: int = 2
    head_dim: int = 16
    batch: int = 4
    max_len: int = 24
    seed: int = 0
    check: str = "match"  # match | hints | unsupported | nan
    relative_bias: str | None = None  # None, "position" or "position_time": a RelativeAttentionBias
    kv_heads: int | None = None  # k/v heads (a divisor of ``heads``: grouped-query attention); None: ``heads``

    @property
    def grouped(self) -> bool:
        return self.kv_heads is not None and self.kv_heads != self.heads

    def request(self, dtype=None, device=None, backward=True) -> AttentionRequest:
        return AttentionRequest(self.activation, self.causal, self.asymmetric, self.window is not None,
                                self.block_size is not None, dtype, device, backward, self.head_dim,
                                self.rope_theta is not None, relative_bias=self.relative_bias is not None,
                                grouped_kv=self.grouped)

    def __str__(self) -> str:
        parts = [] if self.check == "match" else [self.check]
        parts += [self.activation, "causal" if self.causal else "full"]
        if self.asymmetric:
            parts.append("asym")
        if self.window is not None:
            parts.append(f"win{self.window}")
        if self.block_size is not None:
            parts.append(f"blk{self.block_size}")
        if self.rope_theta is not None:
            parts.append(f"rope{self.rope_theta:g}")
        if self.relative_bias is not None:
            parts.append({"position": "relpos", "position_time": "reltime"}[self.relative_bias])
        if self.grouped:
            parts.append(f"gqa{self.heads}x{self.kv_heads}")
        parts.append(f"d{self.head_dim}s{self.seed}")
        return "-".join(parts)


def attention_cases(caps: AttentionCapabilities, *, head_dims=(16,), quick: bool = False) -> list[AttentionCase]:
    """Every combination the kernel declares: activations x causal x asymmetric x window/block."""
    cases = []
    causal_opts = [c for c in (True, False) if (c and caps.causal) or (not c and caps.non_causal)]
    for act in sorted(caps.activations):
        norm = None if act == "softmax" else 16.0
        for causal in causal_opts:
            for asym in ([False, True] if caps.asymmetric else [False]):
                for hd in head_dims:
                    cases.append(AttentionCase(act, causal, asym, norm=norm, head_dim=hd, seed=len(cases)))
        if quick:
            break
    if caps.window:
        cases.append(AttentionCase("softmax", True, False, window=5, seed=100))
        if caps.asymmetric:
            cases.append(AttentionCase("softmax", True, True, window=7, seed=101))
    if caps.block:
        cases.append(AttentionCase("softmax", True, False, block_size=8, seed=102))
        cases.append(AttentionCase("softmax", False, False, block_size=4, seed=103))
        # block sizes 1, 7, 64, 128 (longer sequences for the big ones: several blocks and a last partial one),
        # window alone (above) and with blocks, causal and not, Lq != Lk where declared
        cases.append(AttentionCase("softmax", True, False, block_size=1, seed=104))
        cases.append(AttentionCase("softmax", False, caps.asymmetric, block_size=7, seed=105))
        cases.append(AttentionCase("softmax", True, caps.asymmetric, block_size=7, seed=106))
        cases.append(AttentionCase("softmax", True, False, block_size=64, max_len=150, batch=3, seed=107))
        cases.append(AttentionCase("softmax", False, False, block_size=128, max_len=200, batch=3, seed=108))
        if caps.window:
            cases.append(AttentionCase("softmax", True, False, block_size=7, window=3, seed=109))
            cases.append(AttentionCase("softmax", False, caps.asymmetric, block_size=16, window=5, seed=110))
        pointwise = sorted(caps.activations - {"softmax"})
        if pointwise:
            cases.append(AttentionCase(pointwise[0], True, caps.asymmetric, block_size=7, norm=16.0, seed=111))
    if caps.rotary:  # rotary on (off is every other case)
        cases.append(AttentionCase("softmax", True, False, rope_theta=10000.0, seed=120))
        cases.append(AttentionCase("softmax", False, caps.asymmetric, rope_theta=100.0, head_dim=24, seed=121))
        if caps.block:
            cases.append(AttentionCase("softmax", True, caps.asymmetric, block_size=7, rope_theta=500.0, seed=122))
            if caps.window:
                cases.append(AttentionCase("softmax", False, False, block_size=16, window=9, rope_theta=10000.0,
                                           seed=123))
    cases = [c for c in cases if not caps.missing(c.request())]
    if cases:
        from dataclasses import replace

        first = cases[-1] if caps.asymmetric else cases[0]
        cases.append(replace(first, check="hints", asymmetric=caps.asymmetric, seed=200))
        cases.append(replace(cases[0], check="unsupported", seed=201))
        plain = [c for c in cases if c.check == "match" and c.window is None and c.block_size is None
                 and c.asymmetric == caps.asymmetric]
        picks = {(c.causal, c.activation == "softmax"): c for c in reversed(plain)}  # first of each kind
        for c in [picks[key] for key in sorted(picks, key=lambda kv: (not kv[0], not kv[1]))][:3]:
            cases.append(replace(c, check="nan", seed=210 + len(cases)))
        masked = next((c for c in cases if c.window is not None or c.block_size is not None), None)
        if masked is not None:
            cases.append(replace(masked, check="nan", seed=230))
    return cases + relative_bias_cases(caps) + grouped_kv_cases(caps)


def grouped_kv_cases(caps: AttentionCapabilities) -> list[AttentionCase]:
    """Grouped-query cases for a kernel that declares ``grouped_kv``: 4 query heads over 2 k/v heads, MQA
    (one k/v head), 6 over 3 with a window, blocks, rotary and the relative bias where declared; ``match``,
    and one ``nan`` check (a NaN in k/v head 0 reaches every query head of its group, no other sequence)."""
    if not caps.grouped_kv:
        return []
    from dataclasses import replace

    pointwise = sorted(caps.activations - {"softmax"})
    act = "softmax" if "softmax" in caps.activations else pointwise[0]
    other = pointwise[0] if pointwise else act
    norm = None if act == "softmax" else 16.0
    cases = [AttentionCase(act, caps.causal, False, norm=norm, heads=4, kv_heads=2, seed=400),
             AttentionCase(other, not caps.non_causal, caps.asymmetric, norm=None if other == "softmax" else 16.0,
                           heads=4, kv_heads=1, seed=401)]
    if caps.window:
        cases.append(AttentionCase(act, True, caps.asymmetric, window=5, norm=norm, heads=6, kv_heads=3, seed=402))
    if caps.block:
        cases.append(AttentionCase(act, True, False, block_size=7, norm=norm, heads=4, kv_heads=2,
                                   rope_theta=500.0 if caps.rotary else None, seed=403))
    if caps.relative_bias:
        cases.append(AttentionCase(act, True, False, norm=norm, relative_bias="position_time", heads=4, kv_heads=2,
                                   seed=404))
    cases = [c for c in cases if not caps.missing(c.request())]
    if cases:
        cases.append(replace(cases[0], check="nan", seed=405))
    return cases


def relative_bias_cases(caps: AttentionCapabilities) -> list[AttentionCase]:
    """``match`` cases with a relative bias, for a kernel that declares it: positions only and with time
    buckets, softmax and pointwise, causal and not, Lq != Lk and a window where declared; sequences longer
    than the position table, so its clamp is exercised."""
    if not caps.relative_bias:
        return []
    pointwise = sorted(caps.activations - {"softmax"})
    act = "silu" if "silu" in caps.activations else (pointwise[0] if pointwise else "softmax")
    norm = None if act == "softmax" else 16.0
    cases = [AttentionCase("softmax", True, False, relative_bias="position", seed=300),
             AttentionCase(act, True, False, norm=norm, relative_bias="position_time", seed=301),
             AttentionCase("softmax", True, False, relative_bias="position_time", max_len=90, seed=302),
             AttentionCase(act, True, False, norm=norm, relative_bias="position_time", max_len=150, batch=3,
                           seed=303),
             AttentionCase("softmax", False, caps.asymmetric, relative_bias="position_time", seed=304),
             AttentionCase(act, caps.causal, caps.asymmetric, norm=norm, relative_bias="position", seed=305)]
    if caps.window:
        cases.append(AttentionCase(act, True, False, window=9, norm=norm, relative_bias="position_time", seed=306))
    return [c for c in cases if not caps.missing(c.request())]


def make_relative_bias(case: AttentionCase, q_off: torch.Tensor, k_off: torch.Tensor | None, dtype, device: str,
                       generator: torch.Generator) -> RelativeAttentionBias | None:
    """A random :class:`RelativeAttentionBias` for ``case`` (None without one): a position table shorter than
    the longest sequences (the clamp), 17 time buckets, and per-sequence increasing timestamps whose gaps
    (repeats included: a gap of 0 is bucket 0) cover every bucket and beyond (the last one's clamp)."""
    if case.relative_bias is None:
        return None
    positions = torch.randn(max(case.max_len // 2, 1), generator=generator).to(device=device, dtype=dtype)
    if case.relative_bias == "position":
        return RelativeAttentionBias(positions)
    time_weights = torch.randn(17, generator=generator).to(device=device, dtype=dtype)

    def times(offsets: torch.Tensor) -> torch.Tensor:
        rows = int(offsets[-1])
        steps = torch.randint(0, 40, (rows,), generator=generator) * torch.randint(0, 2, (rows,), generator=generator)
        return (1_600_000_000 + steps.cumsum(0)).to(device)

    q_times = times(q_off.cpu())
    k_times = q_times.clone() if k_off is None else times(k_off.cpu())
    # the item after each query is seen later than the query's own key (HSTU's next_times)
    if k_off is None:
        q_times = q_times + torch.randint(0, 200, q_times.shape, generator=generator).to(device)
    return RelativeAttentionBias(positions, time_weights, q_times, k_times)


def unsupported_options(caps: AttentionCapabilities) -> list[tuple[str, dict]]:
    """(what, call options) for each option outside ``caps``; ``dtype``/``asymmetric``/``kv_heads`` keys are not
    kernel options but say how to build the inputs."""
    out = [(f"activation={a!r}", {"activation": a, "norm": 8.0}) for a in ACTIVATIONS if a not in caps.activations]
    if not caps.block:
        out.append(("block_size", {"block_size": 4}))
    if not caps.window:
        out.append(("window", {"window": 3}))
    if not caps.non_causal:
        out.append(("causal=False", {"causal": False}))
    if not caps.causal:
        out.append(("causal=True", {"causal": True}))
    if not caps.rotary:
        out.append(("rope_theta", {"rope_theta": 10000.0}))
    if not caps.asymmetric:
        out.append(("asymmetric", {"asymmetric": True}))
    if not caps.relative_bias:
        out.append(("relative_bias", {"relative_bias": "position"}))
    if not caps.grouped_kv:
        out.append(("grouped_kv", {"kv_heads": 1}))
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.float32):
        if dtype not in caps.dtypes:
            out.append((f"dtype {dtype}", {"dtype": dtype}))
            break
    return out


def random_jagged_lengths(batch: int, max_len: int, generator: torch.Generator, zero_frac: float = 0.25):
    """Random lengths in [1, max_len] with about ``zero_frac`` of them forced to zero (never all)."""
    lengths = torch.randint(1, max_len + 1, (batch,), generator=generator)
    zeros = torch.rand(batch, generator=generator) < zero_frac
    zeros[torch.randint(0, batch, (1,), generator=generator)] = False
    lengths[zeros] = 0
    if batch >= 3:
        lengths[1] = 0  # always at least one empty sequence in the middle
    return lengths


def make_inputs(case: AttentionCase, dtype: torch.dtype, device: str, generator: torch.Generator):
    q_lens = random_jagged_lengths(case.batch, case.max_len, generator)
    if case.asymmetric:
        k_lens = random_jagged_lengths(case.batch, case.max_len + 9, generator) + q_lens // 2
        k_lens[1] = 5  # a query-less sequence whose keys must be ignored
        q_lens[1] = 0
    else:
        k_lens = q_lens
    q_off, k_off = lengths_to_offsets(q_lens).to(device), lengths_to_offsets(k_lens).to(device)
    tq, tk = int(q_lens.sum()), int(k_lens.sum())
    h, d = case.heads, case.head_dim
    hkv = h if case.kv_heads is None else case.kv_heads

    def rnd(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = rnd(tq, h, d), rnd(tk, hkv, d), rnd(tk, hkv, d)
    return q, k, v, q_off, (k_off if case.asymmetric else None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, with a floor on ||b|| so an all-zero reference (e.g. dq of one-key rows) is fair."""
    a, b = a.double(), b.double()
    floor = 1e-3 * max(b.numel(), 1) ** 0.5
    return float((a - b).norm() / b.norm().clamp_min(floor))


def check_attention(kernel, case: AttentionCase, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                    backward: bool = True, reference=None, tol: float | None = None) -> dict[str, float]:
    """Forward and dq/dk/dv of ``kernel`` against ``reference`` (fp64 on CPU). Returns the errors."""
    reference = reference or reference_attention
    tol = TOLERANCE[dtype] if tol is None else tol
    if case.check == "hints":
        return _check_hints(kernel, case, device, dtype, reference, tol)
    if case.check == "unsupported":
        return _check_unsupported(kernel, case, device, dtype)
    if case.check == "nan":
        return _check_nan(kernel, case, device, dtype, backward, tol)
    gen = torch.Generator().manual_seed(1234 + case.seed)
    q, k, v, q_off, k_off = make_inputs(case, dtype, device, gen)
    kw = _case_kw(case)
    # the tables as a model keeps them: fp32 (fp64 with fp64 inputs, whose table gradients are fp64 then)
    rb = make_relative_bias(case, q_off, k_off, torch.float64 if dtype == torch.float64 else torch.float32,
                            device, gen)
    tables = [] if rb is None else [("positions", rb.positions)] + (
        [("time_weights", rb.time_weights)] if rb.time_weights is not None else [])

    def with_bias(kwargs, leaves, times_device):
        if rb is None:
            return kwargs
        pos, tw = leaves[0], (leaves[1] if len(leaves) > 1 else None)
        qt, kt = ((rb.q_times.to(times_device), rb.k_times.to(times_device)) if tw is not None else (None, None))
        return {**kwargs, "relative_bias": RelativeAttentionBias(pos, tw, qt, kt, rb.bucket_divisor)}

    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    table_leaves = [t.detach().clone().requires_grad_(backward) for _, t in tables]
    out = kernel(*leaves, q_off, k_off, **with_bias(kw, table_leaves, device))
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]), f"output shape {tuple(out.shape)}"
    assert out.dtype == q.dtype, f"output dtype {out.dtype} != input dtype {q.dtype}"
    assert torch.isfinite(out).all(), "output has NaN/Inf (rows with no allowed key must be 0)"

    ref_leaves = [t.detach().cpu().double().requires_grad_(backward) for t in (q, k, v)]
    ref_tables = [t.detach().cpu().double().requires_grad_(backward) for _, t in tables]
    ref = reference(*ref_leaves, q_off.cpu(), None if k_off is None else k_off.cpu(),
                    **with_bias(kw, ref_tables, "cpu"))
    errors = {"out": _rel(out.detach().cpu(), ref.detach())}
    if backward:
        grad = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
        out.backward(grad)
        ref.backward(grad.cpu().double())
        for name, mine, theirs in zip("qkv", leaves, ref_leaves, strict=True):
            assert mine.grad is not None, f"d{name} was not computed"
            errors[f"d{name}"] = _rel(mine.grad.cpu(), theirs.grad)
        for (name, _), mine, theirs in zip(tables, table_leaves, ref_tables, strict=True):
            assert mine.grad is not None, f"the gradient of relative_bias.{name} was not computed"
            errors[f"d{name}"] = _rel(mine.grad.cpu(), theirs.grad)
    bad = {n: e for n, e in errors.items() if not e <= tol}  # `not <=` also catches NaN
    assert not bad, f"{case}: relative error over {tol:g} in {bad} (all: {errors})"
    return errors


def _raises(fn, exc_type, what: str) -> str:
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the wrong error type is the failure being reported
        raise AssertionError(f"{what}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{what}: expected {exc_type.__name__}, nothing was raised")


def _case_kw(case: AttentionCase) -> dict:
    kw = dict(causal=case.causal, activation=case.activation, norm=case.norm, window=case.window,
              block_size=case.block_size)
    if case.rope_theta is not None:
        kw["rope_theta"] = case.rope_theta
    return kw


def _check_hints(kernel, case, device, dtype, reference, tol) -> dict[str, float]:
    """max_q_len / max_k_len below a real length raise JaggedShapeError; exact and larger ones match."""
    gen = torch.Generator().manual_seed(1234 + case.seed)
    q, k, v, q_off, k_off = make_inputs(case, dtype, device, gen)
    lq, lk = max_length(q_off), max_length(q_off if k_off is None else k_off)
    kw = _case_kw(case)
    for hints in ({"max_q_len": lq - 1}, {"max_k_len": lk - 1}, {"max_q_len": lq - 1, "max_k_len": lk}):
        msg = _raises(partial(kernel, q, k, v, q_off, k_off, **kw, **hints), JaggedShapeError,
                      f"{case}: hints {hints} below the longest sequences ({lq}, {lk})")
        assert "smaller than the longest" in msg, msg
    ref = reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), q_off.cpu(),
                    None if k_off is None else k_off.cpu(), **kw)
    errors = {}
    for name, hints in (("exact", {"max_q_len": lq, "max_k_len": lk}), ("larger", {"max_q_len": lq + 5,
                                                                                  "max_k_len": lk + 7})):
        with torch.no_grad():
            errors[name] = _rel(kernel(q, k, v, q_off, k_off, **kw, **hints).cpu(), ref)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"{case}: valid hints changed the output: {bad}"
    return errors


def _check_unsupported(kernel, case, device, dtype) -> dict[str, float]:
    """Every option outside the kernel's capabilities raises PluginError naming registered kernels that can
    serve it; window=0 and block_size=0 are ValueErrors for every kernel."""
    from dataclasses import replace

    caps = kernel.capabilities
    tried = 0
    for what, options in unsupported_options(caps):
        options = dict(options)
        in_dtype = options.pop("dtype", dtype)
        c = replace(case, asymmetric=options.pop("asymmetric", case.asymmetric),
                    relative_bias=options.pop("relative_bias", case.relative_bias),
                    kv_heads=options.pop("kv_heads", case.kv_heads))
        gen = torch.Generator().manual_seed(1234 + case.seed)
        q, k, v, q_off, k_off = make_inputs(c, in_dtype, device, gen)
        kw = {**_case_kw(c), **options}
        if c.relative_bias is not None:
            kw["relative_bias"] = make_relative_bias(c, q_off, k_off, torch.float32, device, gen)
        if kw["activation"] == "softmax":
            kw["norm"] = None
        msg = _raises(partial(kernel, q, k, v, q_off, k_off, **kw), PluginError,
                      f"{case}: {what} is outside the declared capabilities")
        if "can serve this call: " in msg:
            named = [n.strip(" .") for n in msg.split("can serve this call: ", 1)[1].split(",")]
            unknown = set(named) - set(registry.names("attention")) - {"(none)"}
            assert not unknown, f"{what}: the error names kernels that are not registered: {unknown} ({msg})"
        tried += 1
    gen = torch.Generator().manual_seed(1234 + case.seed)
    q, k, v, q_off, k_off = make_inputs(case, dtype, device, gen)
    for bad in ({"window": 0}, {"block_size": 0}, {"window": -1}, {"block_size": -3}, {"rope_theta": 0.0},
                {"rope_theta": -1.0}):
        _raises(partial(kernel, q, k, v, q_off, k_off, **{**_case_kw(case), **bad}), ValueError,
                f"{case}: {bad} is not a valid option")
    return {"unsupported_options": float(tried)}


def _check_nan(kernel, case, device, dtype, backward, tol) -> dict[str, float]:
    """A NaN put into one sequence's q, k or v (head 0) makes NaN the rows that see it (in every query head that
    reads k/v head 0, with grouped k/v); rows of that sequence
    with no allowed key stay exactly 0; every other sequence's output (and gradients) is what it was."""
    gen = torch.Generator().manual_seed(1234 + case.seed)
    q, k, v, q_off, k_off = make_inputs(case, dtype, device, gen)
    ko = q_off if k_off is None else k_off
    kw = _case_kw(case)
    qs, ks = q_off.cpu().tolist(), ko.cpu().tolist()
    b = max(range(len(qs) - 1), key=lambda i: (qs[i + 1] - qs[i]) * (ks[i + 1] - ks[i]))
    lq, lk = qs[b + 1] - qs[b], ks[b + 1] - ks[b]
    assert lq and lk, f"{case}: no sequence with queries and keys to put a NaN in"
    mask = allowed_mask(lq, lk, causal=case.causal, window=case.window, block_size=case.block_size)
    own = torch.zeros(q.shape[0], dtype=torch.bool)
    own[qs[b]:qs[b + 1]] = True
    own_k = torch.zeros(k.shape[0], dtype=torch.bool)
    own_k[ks[b]:ks[b + 1]] = True
    grad = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=gen).to(device=device, dtype=dtype)

    def run(tensors):
        leaves = [t.detach().clone().requires_grad_(backward) for t in tensors]
        out = kernel(*leaves, q_off, k_off, **kw)
        if backward:
            out.backward(grad)
        return out.detach().cpu(), [t.grad.cpu() if backward else None for t in leaves]

    clean_out, clean_grads = run((q, k, v))
    errors = {}
    for which in "qkv":
        if which == "q":
            row = int(mask.any(1).nonzero()[-1])  # a query that has keys
            sees = torch.zeros(lq, dtype=torch.bool)
            sees[row] = True
            at = qs[b] + row
        else:
            col = int(mask.sum(0).argmax())  # the key most queries see
            sees, at = mask[:, col], ks[b] + col
        poisoned = [t.detach().clone() for t in (q, k, v)]
        poisoned["qkv".index(which)][at, 0, 0] = float("nan")
        out, grads = run(poisoned)
        where = f"{case}: NaN in {which}[{at}] (sequence {b})"
        heads = 1 if which == "q" else q.shape[1] // k.shape[1]  # k/v head 0 is read by query heads [0, group)
        assert torch.isnan(out[qs[b]:qs[b + 1]][sees][:, :heads]).any(-1).all(), \
            f"{where}: a row that sees it is not NaN (query heads 0..{heads - 1})"
        empty = ~mask.any(1)
        assert (out[qs[b]:qs[b + 1]][empty] == 0).all(), f"{where}: a row with no allowed key is not 0"
        others = out[~own]
        assert torch.isfinite(others).all(), f"{where}: NaN reached another sequence"
        errors[f"nan-{which}"] = _rel(others, clean_out[~own])
        if backward:
            for name, g, g0, rows in zip("qkv", grads, clean_grads, (~own, ~own_k, ~own_k), strict=True):
                assert torch.isfinite(g[rows]).all(), f"{where}: NaN reached another sequence's d{name}"
                errors[f"nan-{which}-d{name}"] = _rel(g[rows], g0[rows])
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"{case}: a NaN changed other sequences: {bad}"
    return errors


def grouped_query_errors(fn, q_lens, k_lens=None, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                         dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                         relative_bias: bool = False, options=None, **kw) -> dict[str, float]:
    """Relative errors of ``fn`` (a kernel function: q, k, v, q_offsets, k_offsets, **kw; also ``options=`` when
    ``options`` is given, e.g. a jfa KernelOptions, which the reference does not take) against the fp64
    reference on grouped k/v (``kv_heads`` dividing ``heads``), forward and dq/dk/dv (and the bias tables'
    gradients with ``relative_bias``: positions and time buckets), each with ``{name}_finite``. For the Triton
    interpreter scripts and GPU tests of the kernels that declare ``grouped_kv`` (jfa, gdpa, block-attention)."""
    gen = torch.Generator().manual_seed(seed)
    ql = torch.tensor(q_lens)
    kl = ql if k_lens is None else torch.tensor(k_lens)
    q_off, k_off = lengths_to_offsets(ql), lengths_to_offsets(kl)
    tq, tk = int(ql.sum()), int(kl.sum())
    qkv = (torch.randn(tq, heads, head_dim, generator=gen), torch.randn(tk, kv_heads, head_dim, generator=gen),
           torch.randn(tk, kv_heads, head_dim, generator=gen))
    rb = None
    if relative_bias:
        case = AttentionCase(max_len=max([*q_lens, *(k_lens or [])]), relative_bias="position_time")
        rb = make_relative_bias(case, q_off, None if k_lens is None else k_off, torch.float32, "cpu", gen)
    grad = torch.randn(tq, heads, head_dim, generator=gen)

    def run(kernel, dt, dev, own=None):
        leaves = [t.detach().to(device=dev, dtype=dt, copy=True).requires_grad_() for t in qkv]
        table_dtype = torch.float64 if dt == torch.float64 else torch.float32
        tables = [] if rb is None else [t.detach().to(device=dev, dtype=table_dtype, copy=True).requires_grad_()
                                        for t in (rb.positions, rb.time_weights)]
        extra = dict(kw, **(own or {}))
        if rb is not None:
            extra["relative_bias"] = RelativeAttentionBias(tables[0], tables[1], rb.q_times.to(dev),
                                                           rb.k_times.to(dev), rb.bucket_divisor)
        out = kernel(*leaves, q_off.to(dev), None if k_lens is None else k_off.to(dev), **extra)
        out.backward(grad.to(device=dev, dtype=dt))
        return [out.detach()] + [t.grad for t in leaves + tables]

    mine = run(fn, dtype, device, None if options is None else {"options": options})
    ref = run(reference_attention, torch.float64, "cpu")
    errors = {}
    for name, a, b in zip(["out", "dq", "dk", "dv", "dpositions", "dtime_weights"], mine, ref, strict=False):
        errors[name] = _rel(a.cpu(), b)
        errors[f"{name}_finite"] = bool(torch.isfinite(a).all())
    return errors


def assert_errors_within(errors: dict[str, float], tol: float, what: str) -> None:
    """Fail unless every output and gradient of ``errors`` (as :func:`grouped_query_errors` returns them) is
    finite and within ``tol`` relative error, naming ``what`` and the first one that is not."""
    for key in [k for k in errors if not k.endswith("_finite")]:
        assert errors[f"{key}_finite"], f"{what}: {key} has NaN/Inf"
        assert errors[key] <= tol, f"{what}: {key} relative error {errors[key]:.2e} > {tol:.0e}"


def cuda_graph_errors(fn, *, batch: int = 6, max_len: int = 96, heads: int = 2, kv_heads: int | None = None,
                      head_dim: int = 64, dtype: torch.dtype = torch.bfloat16, cross: bool = False, seed: int = 0,
                      replays: int = 2, **kw) -> dict[str, float]:
    """``fn(q, k, v, q_offsets, k_offsets, **kw)`` forward and backward recorded into one CUDA graph, then
    replayed on new values *and new lengths* copied into the same buffers (the same batch and totals, as a
    training loop that pads its batches to fixed totals does), each replay against an eager call on those
    inputs. Returns the largest relative error of out, dq, dk and dv over ``replays`` replays (and
    ``{name}_finite``).

    What it checks: nothing in the call reads the device from the host (a sync during capture is an error),
    and nothing derived from the offsets (work schedules, split plans) is reused from before the capture,
    where it would be replayed unchanged whatever the offsets then hold. ``cross``: queries of their own
    (candidates, a few per sequence) over the sequences as keys; else self-attention, k_offsets = q_offsets."""
    gen = torch.Generator().manual_seed(seed)
    hkv = heads if kv_heads is None else kv_heads

    def lengths():  # random, zero-length sequences included, then moved to the same total as the first draw
        return random_jagged_lengths(batch, max_len, gen)

    k_lens = [lengths() for _ in range(replays + 1)]
    for lens in k_lens[1:]:  # same total: add or remove tokens on the non-empty sequences
        diff = int(k_lens[0].sum() - lens.sum())
        while diff:
            i = int(torch.randint(0, batch, (1,), generator=gen))
            step = max(-int(lens[i]), min(diff, max_len))
            lens[i] += step
            diff -= step
    q_lens = [torch.full((batch,), 3) if cross else lens for lens in k_lens]
    tq, tk = int(q_lens[0].sum()), int(k_lens[0].sum())

    def draw():
        return [torch.randn(t, h, head_dim, generator=gen).to("cuda", dtype)
                for t, h in ((tq, heads), (tk, hkv), (tk, hkv), (tq, heads))]

    # the static buffers the graph reads; each replay copies new values into them
    leaves = [t.requires_grad_() for t in draw()[:3]]
    grad = torch.zeros(tq, heads, head_dim, device="cuda", dtype=dtype)
    q_off = lengths_to_offsets(q_lens[0]).cuda()
    k_off = q_off if not cross else lengths_to_offsets(k_lens[0]).cuda()

    def step():
        for t in leaves:
            t.grad = None  # the recorded backward then writes fresh buffers, which every replay rewrites
        out = fn(*leaves, q_off, k_off, **kw)
        out.backward(grad)
        return out

    graph, static_out = cuda_graph(step, warmup=2)
    static = [static_out] + [t.grad for t in leaves]
    errors: dict[str, float] = {}
    for r in range(1, replays + 1):
        values = draw()
        with torch.no_grad():
            for buf, new in zip([*leaves, grad], values, strict=True):
                buf.copy_(new)
            q_off.copy_(lengths_to_offsets(q_lens[r]))
            if cross:
                k_off.copy_(lengths_to_offsets(k_lens[r]))
        graph.replay()
        torch.cuda.synchronize()
        fresh = [t.detach().clone().requires_grad_() for t in values[:3]]
        q_new = lengths_to_offsets(q_lens[r]).cuda()
        out = fn(*fresh, q_new, q_new if not cross else lengths_to_offsets(k_lens[r]).cuda(), **kw)
        out.backward(values[3])
        for name, got, want in zip(("out", "dq", "dk", "dv"), static, [out] + [t.grad for t in fresh], strict=True):
            errors[name] = max(errors.get(name, 0.0), _rel(got.detach().float(), want.detach().float()))
            errors[f"{name}_finite"] = errors.get(f"{name}_finite", True) and bool(torch.isfinite(got).all())
    return errors
