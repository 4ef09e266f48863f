"""MXFP8 benchmark: correctness first, then the mxfp8 / fp8-rowwise / MX-cast rows of docs/benchmarks.md.

    PYTHONUNBUFFERED=1 PYTHONPATH=.:plugins/gemzoo-mxfp8 python3 plugins/gemzoo-mxfp8/bench/bench_mxfp8.py

Baselines in the same run: bf16 nn.Linear MLP (torch.compile'd, cuBLAS) and eager torch casts (gemzoo.mx).
Times are medians of triton.testing.do_bench(warmup=25, rep=100). JSON goes to --out (default ./bench_out).
On a machine without CUDA it runs a tiny dry run (Triton interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from gemzoo_mxfp8 import dequantize_mx, quantize_mx  # noqa: E402
from gemzoo_mxfp8 import triton_kernels as tk  # noqa: E402
from gemzoo_mxfp8.linear import MXLinear, MXLinearConfig  # noqa: E402
from gemzoo_mxfp8.rowwise import FP8RowwiseLinear  # noqa: E402

from gemzoo.api import dequantize_mx_torch, quantize_mx_torch  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
OUT = os.path.join(os.getcwd(), "bench_out")  # results go here; --out DIR changes it
T0 = time.time()
RESULTS: dict = {"device": torch.cuda.get_device_name() if CUDA else "cpu (dry run)", "torch": torch.__version__,
                 "checks": {}, "cast": {}, "gemm": {}, "mlp": {}, "notes": []}
TOKENS = 65536 if CUDA else 256
SIZES = [(1024, 4096), (2048, 8192)] if CUDA else [(64, 128)]
CAST_SHAPE = (65536, 4096) if CUDA else (64, 128)
# fp8-tensorwise activations of gem-1b: about 107K tokens a batch, d_model 2560 and FFN 10240
TENSORWISE_SHAPES = [(107520, 2560), (107520, 10240)] if CUDA else [(50, 96)]
TENSORWISE_CONFIGS = ([{"BR": 64, "BC": 128, "num_warps": 8}, {"BR": 64, "BC": 64, "num_warps": 4},
                       {"BR": 128, "BC": 64, "num_warps": 8}, {"BR": 32, "BC": 128, "num_warps": 4},
                       {"BR": 128, "BC": 128, "num_warps": 8}] if CUDA else [None])


BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", "1e9"))  # skip what is left once this is spent
SKIP = set(os.environ.get("BENCH_SKIP", "").split(","))  # gemm_check, gemm_bench


def over_budget(what):
    if time.time() - T0 > BUDGET_S:
        log(f"SKIPPED {what}: over the {BUDGET_S:.0f} s budget")
        RESULTS["notes"].append(f"skipped {what} (time budget)")
        return True
    return False


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save():
    with open(os.path.join(OUT, "bench_mxfp8.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def bench(fn, grad_to_none=None):
    """Median ms."""
    if CUDA:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def guarded(name):
    def deco(f):
        def run(*a, **k):
            try:
                return f(*a, **k)
            except Exception as exc:  # keep going: one broken variant must not hide the others
                log(f"FAILED {name}: {type(exc).__name__}: {exc}")
                traceback.print_exc(limit=4)
                RESULTS["notes"].append(f"{name} failed: {type(exc).__name__}: {str(exc)[:300]}")
                save()
                return None
        return run
    return deco


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bits(t):
    return t.contiguous().view(torch.uint8).cpu()


def same_mx(got, want):
    (gd, gs), (wd, ws) = got, want
    nan = gd.float().cpu().isnan() & wd.float().cpu().isnan()
    return int(((bits(gd) != bits(wd)) & ~nan).sum()) + int((bits(gs) != bits(ws)).sum())


# ------------------------------------------------------------------------------------------ correctness
@guarded("cast variants")
def choose_cast_variant():
    """Check each cast-kernel variant against the reference, per output; keep the first exact one."""
    from mxfp8_cases import edge_tensor

    order = [(2, 0), (2, 1), (0, 1), (0, 0)]  # (ROUND, ROW_SPLIT); the first exact one is used
    table = {}
    chosen = None
    for rnd, split in order:
        variant = {"ROUND": rnd, "ROW_SPLIT": split, "COL_MMA": 0, "COL_T": 0}
        bad = {"row": 0, "row_scale": 0, "col": 0, "col_scale": 0, "row_dq": 0, "col_dq": 0}
        for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
            for dtype in (torch.bfloat16, torch.float32):
                for x in (edge_tensor(64, 256, seed=1, elem=elem), torch.randn(96, 384) * 3):
                    x = x.to(dtype)
                    o = tk.mx_cast(x.to(DEV), row_q=True, col_q=True, row_dq=True, col_dq=True, elem=elem,
                                   dq_dtype=torch.float32, variant=variant)
                    for name, axis in (("row", -1), ("col", 0)):
                        d, sc = o[name]
                        if name == "col":
                            d, sc = d[:, : x.shape[0]].t(), sc.t()
                        wd, ws = quantize_mx_torch(x, axis=axis, elem=elem)
                        nan = d.float().cpu().isnan() & wd.float().isnan()
                        bad[name] += int(((bits(d) != bits(wd)) & ~nan).sum())
                        bad[name + "_scale"] += int((bits(sc) != bits(ws)).sum())
                        dq = o[name + "_dq"]
                        dq = dq[:, : x.shape[0]].t() if name == "col" else dq
                        want = dequantize_mx_torch(wd, ws, axis=axis)
                        bad[name + "_dq"] += int((dq.cpu().nan_to_num(5.0) != want.nan_to_num(5.0)).sum())
        table[str(variant)] = bad
        log(f"cast variant {variant}: mismatches {bad}")
        if not any(bad.values()):
            chosen = variant
            break
    if chosen is not None:
        tk.CAST_VARIANT.update(chosen)
    RESULTS["checks"]["cast_variants"] = {"table": table, "chosen": chosen}
    log(f"cast variant in use: {tk.CAST_VARIANT} (exact: {chosen is not None})")
    save()


@guarded("cast checks")
def check_casts():
    from mxfp8_cases import ELEMS, edge_tensor

    bad = 0
    n = 0
    for elem in ELEMS:
        for dtype in (torch.bfloat16, torch.float32):
            for seed, shape in enumerate([(96, 160), (37, 70), (256, 512)]):
                x = edge_tensor(*shape, seed=seed, elem=elem).to(dtype)
                if shape == (256, 512):
                    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
                for axis in (-1, 0):
                    got = quantize_mx(x.to(DEV), axis=axis, elem=elem)
                    want = quantize_mx_torch(x, axis=axis, elem=elem)
                    bad += same_mx(got, want)
                    back = dequantize_mx(*got, axis=axis).cpu()
                    bad += int((back.nan_to_num(9.0) != dequantize_mx_torch(*want, axis=axis).nan_to_num(9.0)).sum())
                    n += 1
    # fused multi-output cast on a bf16 activation, against the reference on the same bytes
    x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(5)).bfloat16()
    o = tk.mx_cast(x.to(DEV), row_q=True, col_q=True, row_dq=True, col_dq=True)
    bad += same_mx((o["row"][0], o["row"][1].view(torch.float8_e8m0fnu)), quantize_mx_torch(x, -1))
    wd, ws = quantize_mx_torch(x, 0)
    bad += same_mx((o["col"][0].t(), o["col"][1].t().view(torch.float8_e8m0fnu)), (wd, ws))
    bad += int((o["row_dq"].cpu() != dequantize_mx_torch(*quantize_mx_torch(x, -1)).bfloat16()).sum())
    bad += int((o["col_dq"].t().cpu() != dequantize_mx_torch(wd, ws, axis=0).bfloat16()).sum())
    # RHT columnwise vs the CPU transform: same scales, data within one e4m3 step (summation order)
    from gemzoo_mxfp8.rht import hadamard_transform_torch, rht_signs

    rht_diff = {}
    for blk in (16, 32):
        signs = rht_signs(blk, 1)
        o = tk.mx_cast(x.to(DEV), col_q=True, rht=tk.hadamard_sign_matrix(signs, blk, DEV))
        d, s = quantize_mx_torch(hadamard_transform_torch(x.float().t().contiguous(), blk, signs))
        same_scale = int((bits(o["col"][1]) != bits(s)).sum())
        rht_diff[blk] = {"scale_mismatches": same_scale,
                         "elem_diff_frac": float((o["col"][0].float().cpu() != d.float()).float().mean())}
    RESULTS["checks"]["cast"] = {"cases": n, "mismatches": bad, "rht": rht_diff}
    log(f"casts: {n} cases, {bad} mismatching bytes; RHT {rht_diff}")


@guarded("gemm checks")
def check_gemm_configs():
    errs = tk.prune_gemm_configs(torch.device(DEV)) if CUDA else []
    gen = torch.Generator().manual_seed(3)
    m, n, k = (512, 384, 1024) if CUDA else (64, 32, 96)
    a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    (ad, as_), (bd, bs) = quantize_mx_torch(a), quantize_mx_torch(b)
    want = dequantize_mx_torch(ad, as_).double() @ dequantize_mx_torch(bd, bs).double().t()
    out = {"compile_errors": errs, "configs": {}}
    good = []
    cfgs = tk._mx_gemm_autotuned.configs if CUDA else [tk._gemm_configs()[0]]
    for cfg in cfgs:
        meta = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        c = tk.mx_gemm(ad.to(DEV), as_.view(torch.uint8).to(DEV), bd.to(DEV), bs.view(torch.uint8).to(DEV),
                       out_dtype=torch.float32, config=meta)
        b16 = dequantize_mx_torch(bd, bs).bfloat16().to(DEV)  # the weight path: B as exact bf16
        c2 = tk.mx_gemm(ad.to(DEV), as_.view(torch.uint8).to(DEV), b16, None, out_dtype=torch.float32, config=meta)
        e = max(rel(c, want), rel(c2, want))
        out["configs"][str(meta)] = e
        if e < 1e-5:
            good.append(cfg)
    if CUDA:
        tk._mx_gemm_autotuned.configs = good or tk._mx_gemm_autotuned.configs
    RESULTS["checks"]["gemm"] = out
    log(f"MX GEMM vs fp64 of the dequantized operands: {out}")


@guarded("linear checks")
def check_linears():
    gen = torch.Generator().manual_seed(4)
    m, k, n = (2048, 1024, 768) if CUDA else (96, 64, 48)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen)
    g = torch.randn(m, n, generator=gen)

    def run(make, dev, dtype):
        lin = torch.nn.Linear(k, n).to(dev)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(bias)
        mod = make(lin) if make else lin
        mod = mod.to(dtype)
        xx = x.to(dev, dtype).detach().clone().requires_grad_()
        y = mod(xx)
        y.float().backward(g.to(dev))
        return y.float().cpu(), xx.grad.float().cpu(), mod.weight.grad.float().cpu()

    fp32 = run(None, "cpu", torch.float32)
    out = {}
    for rht in (False, True):
        cpu_path = run(lambda lin, rht=rht: MXLinear.from_linear(lin, MXLinearConfig(rht=rht)), "cpu", torch.float32)
        for backend in ((("triton", "cublas", "hybrid") if not rht else ("cublas",)) if CUDA else ()):
            def mx(lin, rht=rht, backend=backend):
                return MXLinear.from_linear(lin, MXLinearConfig(rht=rht, backend=backend))

            got = run(mx, DEV, torch.bfloat16)
            out[f"mx-{backend}{'-rht' if rht else ''}"] = {
                "vs_cpu_mx_path": [rel(a, b) for a, b in zip(got, cpu_path, strict=True)],
                "vs_fp32": [rel(a, b) for a, b in zip(got, fp32, strict=True)]}
        out[f"mx-cpu{'-rht' if rht else ''}"] = {"vs_fp32": [rel(a, b) for a, b in zip(cpu_path, fp32, strict=True)]}
    got = run(FP8RowwiseLinear.from_linear, DEV, torch.bfloat16)
    out["fp8-rowwise"] = {"vs_fp32": [rel(a, b) for a, b in zip(got, fp32, strict=True)]}
    RESULTS["checks"]["linear"] = out
    for name, v in out.items():
        log(f"linear {name} (y, dx, dw): " + ", ".join(f"{kk}={[round(e, 5) for e in vv]}" for kk, vv in v.items()))


# -------------------------------------------------------------------------------------------- benchmarks
@guarded("copy ceiling")
def bench_copy():
    x = torch.empty(1 << 29, dtype=torch.uint8, device=DEV).random_() if CUDA else torch.ones(1 << 16)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    RESULTS["copy_tbs"] = 2 * x.numel() * x.element_size() / ms / 1e9
    log(f"copy: {RESULTS['copy_tbs']:.2f} TB/s")


@guarded("cast bench")
def bench_casts():
    r, c = CAST_SHAPE
    x = torch.randn(r, c, device=DEV, dtype=torch.bfloat16)
    n = r * c
    read = 2 * n
    one = n + n // 32  # one fp8 copy + its scales
    res = {}
    sweep, configs = {}, {}
    for cfg in ([{"BC": 64, "num_warps": 4}, {"BC": 128, "num_warps": 4}, {"BC": 256, "num_warps": 4}]
                if CUDA else [tk.CAST_CONFIG]):
        configs[str(cfg)] = dict(cfg)
        try:
            ms = bench(lambda cfg=cfg: tk.mx_cast(x, row_q=True, col_q=True, config=cfg))
            sweep[str(cfg)] = (read + 2 * one) / ms / 1e9
        except Exception as exc:
            sweep[str(cfg)] = f"{type(exc).__name__}: {str(exc)[:100]}"
    best = max((k for k, v in sweep.items() if isinstance(v, float)), key=lambda k: sweep[k])
    best_cfg = configs[best]
    tk.CAST_CONFIG.update(best_cfg)
    res["sweep_row+col_TBs"] = sweep
    res["config"] = best_cfg
    signs = tk.hadamard_sign_matrix(torch.tensor([1.0, -1.0] * 16), 32, DEV)
    cases = {
        "rowwise": (dict(row_q=True), read + one),
        "columnwise, x's layout (quantize_mx axis=0)": (dict(col_q=True, col_layout="n"), read + one),
        "columnwise, transposed": (dict(col_q=True), read + one),
        "row+col fused, x's layout": (dict(row_q=True, col_q=True, col_layout="n"), read + 2 * one),
        "columnwise + RHT32, x's layout": (dict(col_q=True, rht=signs, col_layout="n"), read + one),
        "linear fwd: row dq bf16 + col, x's layout": (dict(row_dq=True, col_q=True, col_layout="n"),
                                                      read + 2 * n + one),
        "linear bwd: row dq + col dq bf16, x's layout": (dict(row_dq=True, col_dq=True, col_layout="n"),
                                                          read + 4 * n),
    }
    # columnwise variants (identity MMA, explicit transpose) in both layouts: check exactness and time them;
    # the fastest exact one in x's layout (what quantize_mx and the cublas linear use) is kept
    from mxfp8_cases import edge_tensor

    xs = [torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16), edge_tensor(64, 256, seed=3).bfloat16().to(DEV)]
    x32 = x.float()
    col_best = None
    for mma, col_t, lay in ((0, 0, "n"), (1, 0, "n"), (0, 0, "t"), (1, 0, "t"), (0, 1, "t"), (1, 1, "t")):
        v = {**tk.CAST_VARIANT, "COL_MMA": mma, "COL_T": col_t}
        name = f"columnwise {'transposed' if lay == 't' else 'x layout'} COL_MMA={mma} COL_T={col_t}"
        try:
            exact = True
            for xe in xs + [xe.float() for xe in xs]:
                d, sc = tk.mx_cast(xe, col_q=True, variant=v, col_layout=lay)["col"]
                d, sc = (d[:, : xe.shape[0]].t(), sc.t()) if lay == "t" else (d[: xe.shape[0]], sc)
                exact &= same_mx((d, sc.view(torch.float8_e8m0fnu)), quantize_mx_torch(xe.cpu(), axis=0)) == 0
            ms = bench(lambda v=v, lay=lay: tk.mx_cast(x, col_q=True, variant=v, col_layout=lay))
            ms32 = bench(lambda v=v, lay=lay: tk.mx_cast(x32, col_q=True, variant=v, col_layout=lay))
        except Exception as exc:  # one variant failing to compile must not hide the others
            res[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            log(f"{name} failed: {res[name]['error']}")
            continue
        res[name] = {"ms": ms, "TBs": (read + one) / ms / 1e9, "exact": exact,
                     "fp32 input TBs": (2 * read + one) / ms32 / 1e9}
        if exact and lay == "n" and (col_best is None or ms < col_best[0]):
            col_best = (ms, {"COL_MMA": mma, "COL_T": col_t})
    if col_best is not None:
        tk.CAST_VARIANT.update(col_best[1])
        res["columnwise variant in use"] = col_best[1]
    for name, (kw, nbytes) in cases.items():
        ms = bench(lambda kw=kw: tk.mx_cast(x, **kw))
        res[name] = {"ms": ms, "TBs": nbytes / ms / 1e9}
    for name, axis in (("eager torch rowwise", -1), ("eager torch columnwise", 0)):
        ms = bench(lambda axis=axis: quantize_mx_torch(x, axis=axis))
        res[name] = {"ms": ms, "TBs": (read + one) / ms / 1e9}
    RESULTS["cast"] = res
    log("cast: " + json.dumps(res, default=str))
    save()


@guarded("tensorwise cast bench")
def bench_tensorwise_casts():
    """fp8-tensorwise: one activation cast as its linear casts it (amax, scale, e4m3 row-major and transposed along
    the tokens padded to 16). The Triton cast (the amax compiled by Inductor, then one pass writing both layouts)
    against the whole cast compiled by Inductor, checked bit-identical first. TB/s counts 6 bytes an element: the
    amax's read, the cast's read and the two fp8 writes."""
    from gemzoo_mxfp8.tensorwise import E4M3, quantize_tensorwise, tensor_scale

    inductor = torch.compile(quantize_tensorwise, dynamic=True)
    scale_of = torch.compile(tensor_scale, dynamic=True)
    res = {}
    for r, c in TENSORWISE_SHAPES:
        x = torch.randn(r, c, device=DEV, dtype=torch.bfloat16)
        x[7, 3] = 3000.0  # an outlier sets the scale, as activations have
        nbytes = 6 * r * c
        row, col, inv = inductor(x, E4M3, True, True, 16, False)
        entry = {"inductor": {"ms": bench(lambda x=x: inductor(x, E4M3, True, True, 16, False))},
                 "amax only": {"ms": bench(lambda x=x: scale_of(x))}}
        for cfg in TENSORWISE_CONFIGS:
            try:
                q, qt = tk.tensorwise_cast(x, scale_of(x), row=True, col=True, pad_to=16, config=cfg)
                exact = bool(torch.equal(bits(q), bits(row)) and torch.equal(bits(qt), bits(col)))
                ms = bench(lambda x=x, cfg=cfg: tk.tensorwise_cast(x, scale_of(x), row=True, col=True, pad_to=16,
                                                                   config=cfg))
                entry[f"triton {cfg or tk.TENSORWISE_CONFIG}"] = {"ms": ms, "exact": exact}
            except Exception as exc:  # one config failing to compile must not hide the others
                entry[f"triton {cfg}"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        for v in entry.values():
            if "ms" in v:
                v["TBs"] = nbytes / v["ms"] / 1e9
        res[f"{r}x{c}"] = entry
        log(f"tensorwise cast {r}x{c}: " + json.dumps(entry, default=str))
    RESULTS["tensorwise_cast"] = res
    save()


@guarded("gemm bench")
def bench_gemms():
    for d, h in SIZES:
        for m, n, k in ((TOKENS, h, d), (TOKENS, d, h), (h, d, TOKENS)):
            if over_budget(f"gemm {m}x{n}x{k}"):
                continue
            a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
            flops = 2 * m * n * k
            ms_bf16 = bench(lambda a=a, b=b: a @ b.t())
            qa, qb = tk.mx_cast(a, row_q=True)["row"], tk.mx_cast(b, row_q=True)["row"]
            ms_mx = bench(lambda qa=qa, qb=qb: tk.mx_gemm(*qa, *qb))
            best = str(getattr(tk._mx_gemm_autotuned, "best_config", None))
            bdq = tk.mx_cast(b, row_dq=True)["row_dq"]
            ms_mxb = bench(lambda qa=qa, bdq=bdq: tk.mx_gemm(*qa, bdq, None))
            best_b = str(getattr(tk._mx_gemm_autotuned, "best_config", None))
            RESULTS["gemm"][f"{m}x{n}x{k}"] = {"bf16_cublas_tflops": flops / ms_bf16 / 1e9,
                                                "mx_triton_tflops": flops / ms_mx / 1e9, "mx_config": best,
                                                "mx_x_bf16w_tflops": flops / ms_mxb / 1e9, "mx_x_bf16w_config": best_b}
            log(f"gemm {m}x{n}x{k}: cuBLAS bf16 {flops / ms_bf16 / 1e9:.0f} TFLOP/s, "
                f"MX x MX Triton {flops / ms_mx / 1e9:.0f} ({best}), MX x bf16(exact MX) {flops / ms_mxb / 1e9:.0f} "
                f"({best_b})")
            del a, b, qa, qb
    save()


def make_mlp(d, h, kind):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Linear(h, d)).to(DEV, torch.bfloat16)
    if kind.startswith("mx-"):
        cfg = MXLinearConfig(backend=kind.split("-")[1], rht=kind.endswith("rht"))
        mlp = torch.nn.Sequential(*[MXLinear.from_linear(lin, cfg) for lin in mlp])
    elif kind.startswith("fp8-rowwise"):
        import gemzoo_mxfp8.rowwise as rw

        rw.CAST_BACKEND = "triton" if kind == "fp8-rowwise-triton" else "torch"
        mlp = torch.nn.Sequential(*[FP8RowwiseLinear.from_linear(lin) for lin in mlp])
    return mlp


@guarded("mlp bench")
def bench_mlp(d, h, kinds):
    kinds = list(kinds)
    x = torch.randn(TOKENS, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(TOKENS, d, device=DEV, dtype=torch.bfloat16)
    flops = 3 * 2 * (2 * TOKENS * d * h)  # two linears, fwd + dgrad + wgrad
    res = RESULTS["mlp"].setdefault(f"{d}->{h}->{d}", {})
    for kind in kinds:
        if over_budget(f"mlp {d}->{h} {kind}"):
            continue
        try:
            mlp = make_mlp(d, h, kind)
            compiled = kind in ("bf16", "fp8-rowwise")  # MX runs eagerly: its kernels are already fused
            fn = torch.compile(mlp) if compiled else mlp
            params = list(mlp.parameters())

            def step(fn=fn):
                fn(x).backward(g)

            def fwd(fn=fn):
                with torch.no_grad():
                    fn(x)

            step()
            if CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            ms = bench(step, grad_to_none=[x, *params])
            peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0
            ms_f = bench(fwd) if kind in ("bf16", "mx-cublas", "mx-triton", "fp8-rowwise", "fp8-rowwise-triton") else None
            res[kind] = {"ms": ms, "tflops": flops / ms / 1e9, "fwd_ms": ms_f, "peak_gib": peak,
                         "compiled": compiled}
            log(f"mlp {d}->{h}->{d} {kind}: {ms:.3f} ms fwd+bwd ({flops / ms / 1e9:.0f} TFLOP/s), fwd {ms_f}, "
                f"peak {peak:.1f} GiB")
        except Exception as exc:
            log(f"FAILED mlp {kind}: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
            res[kind] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if kind == "fp8-rowwise" and "fp8-rowwise-eager" not in kinds:  # compile failed: eager numbers
                import gemzoo_mxfp8.rowwise as rw

                rw.COMPILE_CASTS = False
                kinds.append("fp8-rowwise-eager")
        save()
        if CUDA:
            torch.cuda.empty_cache()
    base = res.get("bf16", {}).get("ms")
    for v in res.values():
        if base and "ms" in v:
            v["speedup_vs_bf16"] = base / v["ms"]


def table():
    lines = ["", f"device: {RESULTS['device']}  torch {RESULTS['torch']}  copy {RESULTS.get('copy_tbs', 0):.2f} TB/s",
             f"{'MLP fwd+bwd, tokens ' + str(TOKENS):<44}{'ms':>9}{'TFLOP/s':>9}{'x bf16':>8}{'GiB':>7}"]
    for size, rows in RESULTS["mlp"].items():
        for kind, v in rows.items():
            if "ms" in v:
                lines.append(f"  {size + ' ' + kind:<42}{v['ms']:>9.3f}{v['tflops']:>9.0f}"
                             f"{v.get('speedup_vs_bf16', 0):>8.2f}{v['peak_gib']:>7.1f}")
            else:
                lines.append(f"  {size + ' ' + kind:<42} {v.get('error', '?')[:60]}")
    lines.append(f"{'GEMM (M x N x K), TFLOP/s':<44}{'bf16':>9}{'MXxMX':>9}{'MXxW':>7}")
    for shape, v in RESULTS["gemm"].items():
        lines.append(f"  {shape:<42}{v['bf16_cublas_tflops']:>9.0f}{v['mx_triton_tflops']:>9.0f}"
                     f"{v['mx_x_bf16w_tflops']:>7.0f}")
    lines.append(f"{'MX cast ' + 'x'.join(map(str, CAST_SHAPE)) + ' bf16':<44}{'ms':>9}{'TB/s':>9}")
    for name, v in RESULTS["cast"].items():
        if isinstance(v, dict) and "ms" in v:
            lines.append(f"  {name:<42}{v['ms']:>9.3f}{v['TBs']:>9.2f}")
    c = RESULTS["checks"]
    lines.append(f"checks: casts {c.get('cast', {}).get('mismatches', '?')} mismatches over "
                 f"{c.get('cast', {}).get('cases', '?')} cases; notes: {len(RESULTS['notes'])}")
    print("\n".join(lines), flush=True)
    with open(os.path.join(OUT, "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    global OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="folder for bench_mxfp8.json and table.txt (default ./bench_out)")
    ap.add_argument("--only", choices=("all", "tensorwise"), default="all",
                    help="tensorwise: only the fp8-tensorwise cast rows (and the copy bandwidth)")
    args = ap.parse_args()
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    log(f"device {RESULTS['device']}, torch {torch.__version__}")
    if args.only == "tensorwise":
        bench_copy()
        bench_tensorwise_casts()
        return
    if CUDA:
        choose_cast_variant()
    check_casts()
    if "gemm_check" not in SKIP:
        check_gemm_configs()
    check_linears()
    save()
    bench_copy()
    bench_casts()
    bench_tensorwise_casts()
    kinds = os.environ.get("BENCH_KINDS", "bf16,mx-cublas,fp8-rowwise,mx-hybrid,mx-triton,mx-cublas-rht,"
                           "fp8-rowwise-triton").split(",")
    for d, h in SIZES:
        bench_mlp(d, h, kinds)
    table()
    if "gemm_bench" not in SKIP:
        bench_gemms()
        save()
        table()


if __name__ == "__main__":
    main()
