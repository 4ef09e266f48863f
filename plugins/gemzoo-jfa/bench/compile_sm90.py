#!/usr/bin/env python3
"""Compile kernel variants of the jfa family for Hopper (sm_90a) on a machine without a GPU, and report what
ptxas says: shared memory, registers, spills, or the crash. The cheap first check of a new tile shape or
constexpr before a GPU run (triton 3.6's ptxas has crashed on some variants; see the README).

    .venv/bin/python plugins/gemzoo-jfa/bench/compile_sm90.py [--only NAME,...] [--out results.json]

Each variant is (kernel, constexprs, num_warps, num_stages, tensor-descriptor boxes); the non-constexpr
arguments get their types from their names (bf16 tensors, int64 offsets, int32 schedules and scalars).
A triton other than the GPU machine's may compile differently, so a pass on another version is evidence, not proof.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from gemzoo_jfa import family, kernels  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

FLOAT_ARGS = {"qk_scale", "inv_norm", "rope_c", "dk_scale", "dv_scale", "dq_scale"}
FP32_PTRS = {"LSE", "DELTA", "DQACC"}
INT_PTRS = {"QOFF": "*i64", "KOFF": "*i64", "ITEMS": "*i32"}
DESCRIPTORS = ("KD", "VD", "QD", "DOD")


def _constexprs(fn, const: dict, types: dict | None = None) -> dict:
    """``const`` plus the defaults of the kernel's other constexpr parameters (and of None-default pointers,
    which a launch leaves out, unless ``types`` gives them a type), as a launch would pass them."""
    out = dict(const)
    for name, p in inspect.signature(fn.fn).parameters.items():
        if (name == "DQACC" and out.get("FUSED_DQ")) or (types and name in types):
            continue  # a pointer then
        if name not in out and p.default is not inspect.Parameter.empty and (
                p.default is None or "constexpr" in str(p.annotation)):
            out[name] = p.default
    return out


def _signature(fn, const: dict, dtype: str, boxes: dict, types: dict | None = None) -> dict:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if types and name in types:
            sig[name] = types[name]
        elif name in const:
            sig[name] = "constexpr"
        elif name in DESCRIPTORS:
            sig[name] = f"tensordesc<{dtype}[{boxes[name]}]>" if name in boxes else f"*{dtype}"
        elif name in INT_PTRS:
            sig[name] = INT_PTRS[name]
        elif name in FP32_PTRS:
            sig[name] = "*fp32"
        elif name.isupper() or name.endswith("_"):
            sig[name] = f"*{dtype}"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _ptxas(ptx: str) -> dict:
    """ptxas -v on the PTX: registers and spill bytes (or the error); Triton's metadata has the shared memory."""
    import os
    import tempfile

    ptxas = os.environ.get("TRITON_PTXAS_PATH") or str(Path(triton.__file__).parent / "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        run = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(path), "-o", str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True)
    info = run.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.findall(r"(\d+) bytes spill (stores|loads)", info)
    return {"ok": run.returncode == 0, "regs": int(regs.group(1)) if regs else None,
            "spill_bytes": sum(int(b) for b, _ in spill),
            "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.\S*?(m64n\d+k\d+\.f32\.\w+\.\w+)", ptx))),
            **({} if run.returncode == 0 else {"error": info[-400:]})}


def variants() -> dict:
    base = dict(H=4, D=128, DV=128, BD=128, BDV=128, CAUSAL=True, WINDOWED=False, UPCAST=False, ACT=0,
                BLOCKED=False, ROPE=False)
    fwd, dkdv, dq = kernels.attn_fwd_kernel, kernels.attn_bwd_dkdv_kernel, kernels.attn_bwd_dq_kernel
    out = {}
    for tma, warps in ((True, 4), (False, 4), (True, 8), (False, 8)):
        t = ("tma" if tma else "ptr") + f" w{warps}"
        # the first short-sequence bucket tried (64 x 64 tiles, 3 stages, all three kernels; family.short_buckets now
        # takes the smaller tiles of the H200 sweep, README "Length buckets")
        out[f"bucket64 fwd {t}"] = (fwd, {**base, "BM": 64, "BN": 64, "USE_TMA": tma, "SPLIT": False}, warps, 3,
                                    {"KD": "64,1,128", "VD": "64,1,128"} if tma else {})
        out[f"bucket64 dkdv {t}"] = (dkdv, {**base, "BM": 64, "BN": 64, "USE_TMA": tma}, warps, 3,
                                     {"QD": "64,1,128", "DOD": "64,1,128"} if tma else {})
        out[f"bucket64 dq {t}"] = (dq, {**base, "BM": 64, "BN": 64, "USE_TMA": tma, "SPLIT": False}, warps, 3,
                                   {"KD": "64,1,128", "VD": "64,1,128"} if tma else {})
    for tma in (True, False):
        t = "tma" if tma else "ptr"
        # fused dQ: the default dk/dv tiles (64 q x 128 k, 8 warps, 3 stages), then smaller ones
        for bm, bn, warps, stages in ((64, 128, 8, 3), (64, 64, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3),
                                      (64, 128, 8, 2)):
            box = f"{bm},1,128"
            out[f"fused-dq dkdv {t} BM{bm} BN{bn} w{warps} s{stages}"] = (
                dkdv, {**base, "BM": bm, "BN": bn, "USE_TMA": tma, "FUSED_DQ": True}, warps, stages,
                {"QD": box, "DOD": box} if tma else {})
    out["fused-dq dkdv silu tma"] = (dkdv, {**base, "ACT": 1, "BM": 64, "BN": 128, "USE_TMA": True,
                                            "FUSED_DQ": True}, 8, 3, {"QD": "64,1,128", "DOD": "64,1,128"})
    out["fused-dq dkdv rope ptr"] = (dkdv, {**base, "ROPE": True, "BM": 64, "BN": 128, "USE_TMA": False,
                                            "FUSED_DQ": True}, 8, 3, {})
    out["default dkdv tma (reference)"] = (dkdv, {**base, "BM": 64, "BN": 128, "USE_TMA": True}, 8, 3,
                                           {"QD": "64,1,128", "DOD": "64,1,128"})
    out["default fwd tma (reference)"] = (fwd, {**base, "BM": 128, "BN": 128, "USE_TMA": True, "SPLIT": False}, 8, 3,
                                          {"KD": "128,1,128", "VD": "128,1,128"})
    out["default dq tma (reference)"] = (dq, {**base, "BM": 128, "BN": 64, "USE_TMA": True, "SPLIT": False}, 8, 3,
                                         {"KD": "64,1,128", "VD": "64,1,128"})
    # the fp8 forward (KernelOptions.fp8): e4m3 Q, K (and V, stored [H, DV, T]) with fp32 per-row scales; its
    # "wgmma" entry shows whether QK^T (and P V) compile to e4m3 wgmma
    f8 = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "QS": "*fp32", "KS": "*fp32", "VS": "*fp32"}
    for mode, bm, bn, warps, stages in ((1, 128, 128, 8, 3), (2, 128, 128, 8, 3), (2, 128, 128, 8, 2),
                                        (2, 128, 64, 8, 3), (2, 64, 128, 4, 3)):
        types = {**f8, "V": "*fp8e4nv"} if mode == 2 else f8
        out[f"fp8 {'qkv' if mode == 2 else 'qk'} fwd ptr BM{bm} BN{bn} w{warps} s{stages}"] = (
            fwd, {**base, "BM": bm, "BN": bn, "USE_TMA": False, "SPLIT": False, "FP8": mode}, warps, stages, {},
            types)
    for mode, bm, bn, warps, stages in ((1, 128, 128, 8, 3), (2, 128, 128, 8, 3), (2, 128, 128, 8, 2),
                                        (2, 128, 64, 8, 3), (2, 128, 128, 4, 3)):
        types = {**f8, "KD": f"tensordesc<fp8e4nv[{bn},1,128]>"}
        types.update({"V": "*fp8e4nv", "VD": "*fp8e4nv"} if mode == 2 else
                     {"VD": f"tensordesc<bf16[{bn},1,128]>"})
        out[f"fp8 {'qkv' if mode == 2 else 'qk'} fwd tma BM{bm} BN{bn} w{warps} s{stages}"] = (
            fwd, {**base, "BM": bm, "BN": bn, "USE_TMA": True, "SPLIT": False, "FP8": mode}, warps, stages, {},
            types)
    # D = 16: an e4m3 dot contracts over at least 32, so the fp8 launch pads the head dim's tile to 32 (BD)
    small = {**base, "D": 16, "DV": 16, "BD": 32, "BDV": 16, "BM": 64, "BN": 64, "USE_TMA": False, "SPLIT": False}
    out["fp8 qkv fwd ptr D16 BM64 BN64 w4 s1"] = (fwd, {**small, "FP8": 2}, 4, 1, {}, {**f8, "V": "*fp8e4nv"})
    out["fp8 quantize G128"] = (kernels.quant_fp8_kernel, {"H": 4, "D": 128, "BD": 128, "G": 128, "EXACT": False},
                                8, 1, {}, {"X": "*bf16", "Y": "*fp8e4nv", "S": "*fp32", "OFF": "*i64",
                                           "ITEMS": "*i32", "T": "i32"})
    # fp32 operands with each dot precision (DOT) on family.default_configs' tiles: "ieee" compiles the dots to
    # FMA (HSTU's head dim 50 in 64-wide tiles, and D = 128; SiLU), "tf32" to tf32 wgmma (the fp32 defaults)
    f32 = {name: "*fp32" for name in ("Q", "K", "V", "O", "DO", "DK", "DV_", "DQ", "KD", "VD", "QD", "DOD")}
    for d, bd in ((50, 64), (128, 128)):
        c = {**base, "D": d, "DV": d, "BD": bd, "BDV": bd, "ACT": 1, "USE_TMA": False, "DOT": "ieee"}
        tiles = family.default_configs(d, "cuda", 4, ieee=True)
        for kind, fn, extra in (("fwd", fwd, {"SPLIT": False}), ("dkdv", dkdv, {}), ("dq", dq, {"SPLIT": False})):
            t = tiles.of(kind)
            out[f"fp32 ieee D{d} {kind} ptr"] = (fn, {**c, **extra, "BM": t.block_m, "BN": t.block_n}, t.num_warps,
                                                 t.num_stages, {}, f32)
    c = {**base, "D": 50, "DV": 50, "BD": 64, "BDV": 64, "ACT": 1, "USE_TMA": False, "DOT": "tf32"}
    tiles = family.default_configs(50, "cuda", 4)
    for kind, fn, extra in (("fwd", fwd, {"SPLIT": False}), ("dkdv", dkdv, {}), ("dq", dq, {"SPLIT": False})):
        t = tiles.of(kind)
        out[f"fp32 tf32 D50 {kind} ptr"] = (fn, {**c, **extra, "BM": t.block_m, "BN": t.block_n}, t.num_warps,
                                            t.num_stages, {}, f32)
    out.update(d256_variants())
    return out


# D = 256 tiles (BM, BN, warps, stages) per kernel, each with pointer loads and TMA: the current defaults
# (family.default_configs: fwd 64 x 64, dk/dv 32 q x 64 k, dq 64 q x 32 k, 8 warps, 2 stages) first, then more
# rows per program (the forward's and dq's queries, dk/dv's keys) and the other orientation of each tile.
# ``--only 'd256 '`` compiles these alone (2026-12-04: all 110 compile with triton 3.7.1 and 3.6.0, none crashes
# ptxas; TMA spills far less than pointer loads, and dk/dv with 128 keys spills 10 KB or more per thread).
D256_TILES = {
    "fwd": [(64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3), (64, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 3),
            (128, 64, 8, 1), (128, 32, 8, 2), (128, 32, 4, 2), (64, 128, 8, 2), (64, 128, 4, 2), (128, 128, 8, 2),
            (128, 64, 16, 2), (128, 64, 16, 1), (128, 128, 16, 2)],
    "dkdv": [(32, 64, 8, 2), (32, 64, 4, 2), (32, 64, 8, 3), (32, 64, 8, 1), (64, 64, 8, 2), (64, 64, 8, 1),
             (64, 32, 8, 2), (64, 32, 4, 2), (64, 32, 8, 3), (64, 32, 8, 1), (64, 32, 4, 1), (128, 32, 8, 2),
             (32, 32, 8, 2), (32, 32, 4, 2), (16, 64, 8, 2), (16, 64, 4, 2), (16, 128, 8, 2), (32, 128, 8, 2),
             (64, 128, 8, 2), (32, 64, 16, 2), (64, 64, 16, 2), (32, 128, 16, 2), (64, 128, 16, 2)],
    "dq": [(64, 32, 8, 2), (64, 32, 4, 2), (64, 32, 8, 3), (64, 32, 8, 1), (64, 32, 4, 1), (64, 64, 8, 2),
           (64, 64, 4, 2), (32, 64, 8, 2), (32, 64, 8, 1), (32, 64, 4, 2), (128, 32, 8, 2), (128, 32, 8, 1),
           (128, 64, 8, 2), (64, 32, 16, 2), (64, 64, 16, 2), (128, 32, 16, 2), (128, 64, 16, 2)],
}


def d256_variants() -> dict:
    """The D = 256 grid of D256_TILES, named "d256 KIND ptr|tma BM.. BN.. w.. s.."."""
    base = dict(H=4, D=256, DV=256, BD=256, BDV=256, CAUSAL=True, WINDOWED=False, UPCAST=False, ACT=0,
                BLOCKED=False, ROPE=False)
    fns = {"fwd": kernels.attn_fwd_kernel, "dkdv": kernels.attn_bwd_dkdv_kernel, "dq": kernels.attn_bwd_dq_kernel}
    out = {}
    for kind, tiles in D256_TILES.items():
        for bm, bn, warps, stages in tiles:
            for tma in (False, True):
                const = {**base, "BM": bm, "BN": bn, "USE_TMA": tma, **({} if kind == "dkdv" else {"SPLIT": False})}
                # TMA boxes: the tile's rows of K and V (fwd, dq) or of Q and dO (dk/dv), all 256 columns
                box = f"{bm if kind == 'dkdv' else bn},1,256"
                boxes = ({"QD": box, "DOD": box} if kind == "dkdv" else {"KD": box, "VD": box}) if tma else {}
                name = f"d256 {kind} {'tma' if tma else 'ptr'} BM{bm} BN{bn} w{warps} s{stages}"
                out[name] = (fns[kind], const, warps, stages, boxes)
    return out


def compile_variant(fn, const: dict, warps: int, stages: int, boxes: dict, types: dict | None = None) -> dict:
    """Compile one variant for sm_90a: Triton's shared memory, ptxas's registers and spills (or the error).
    ``types``: signature types by parameter name, over the defaults of _signature."""
    t0 = time.time()
    try:
        const = _constexprs(fn, const, types)
        src = ASTSource(fn=fn, signature=_signature(fn, const, "bf16", boxes, types), constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": warps, "num_stages": stages})
        res = {"triton_shared": k.metadata.shared, **_ptxas(k.asm["ptx"])}
    except Exception as exc:  # a compile failure is the result
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-600:]}
    res["seconds"] = round(time.time() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated variant names (substrings)")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", action="store_true", help="end with one line of JSON of every result")
    args = ap.parse_args()
    results = {"triton": triton.__version__}
    for name, variant in variants().items():
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        results[name] = res = compile_variant(*variant)
        print(f"{name:32} {json.dumps(res)}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.json:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
