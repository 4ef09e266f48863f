"""Casts: bit-exact against the plain-torch MX rule (gemzoo.mx) on the CPU path and the Triton kernels."""

import pytest
import torch
from gemzoo_mxfp8 import dequantize_mx, quantize_mx
from mxfp8_cases import ELEMS, edge_tensor

from gemzoo.api import dequantize_mx_torch, quantize_mx_torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def bits(t):
    return t.contiguous().view(torch.uint8)


def assert_same_mx(got, want):
    (gd, gs), (wd, ws) = got, want
    assert gd.shape == wd.shape and gs.shape == ws.shape, (gd.shape, wd.shape, gs.shape, ws.shape)
    assert gs.dtype == torch.float8_e8m0fnu
    bad_s = (bits(gs) != bits(ws)).sum().item()
    both_nan = gd.float().isnan() & wd.float().isnan()  # any NaN encoding is the NaN element
    bad_d = ((bits(gd) != bits(wd)) & ~both_nan).sum().item()
    assert bad_s == 0 and bad_d == 0, f"{bad_s} scales and {bad_d} elements differ"


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(24, 96), (40, 70)])  # 70: a trailing partial block
def test_cpu_cast_bit_exact(elem, axis, dtype, shape):
    x = edge_tensor(*shape, seed=shape[1], elem=elem).to(dtype)
    if axis == 0:
        x = x.t().contiguous()
    got = quantize_mx(x, axis=axis, elem=elem)
    want = quantize_mx_torch(x, axis=axis, elem=elem)
    assert_same_mx(got, want)
    back = dequantize_mx(*got, axis=axis)
    assert torch.equal(back.nan_to_num(7.0), dequantize_mx_torch(*want, axis=axis).nan_to_num(7.0))


def test_cpu_cast_3d_middle_axis():
    x = torch.randn(3, 50, 8)
    assert_same_mx(quantize_mx(x, axis=1), quantize_mx_torch(x, axis=1))


def test_rejects_bad_element_type():
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        quantize_mx(torch.randn(4, 32), elem=torch.float16)


# ----------------------------------------------------------------------------- Triton (interpreter on CPU)
def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


# the interpreter needs hand rounding (ROUND 0); the GPU uses the hardware cast (checked exact on the H200)
VARIANTS = [{"ROUND": 2 if torch.cuda.is_available() else 0, "ROW_SPLIT": split, "COL_MMA": mma, "COL_T": col_t}
            for split in (0, 1) for mma, col_t in ((0, 0), (1, 0), (0, 1))]


@pytest.mark.parametrize("variant", VARIANTS,
                         ids=lambda v: f"round{v['ROUND']}-split{v['ROW_SPLIT']}-mma{v['COL_MMA']}-colt{v['COL_T']}")
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 64), pytest.param((37, 70), marks=pytest.mark.slow)])
def test_triton_cast_bit_exact(elem, dtype, shape, variant):
    from gemzoo_mxfp8.triton_kernels import mx_cast, mx_dequant

    x = edge_tensor(*shape, seed=7 + shape[0], elem=elem).to(dtype)
    out = mx_cast(x.to(_dev()), row_q=True, col_q=True, row_dq=True, col_dq=True, elem=elem, dq_dtype=torch.float32,
                  variant=variant)
    rd, rs = out["row"]
    assert_same_mx((rd.cpu(), rs.cpu().view(torch.float8_e8m0fnu)), quantize_mx_torch(x, axis=-1, elem=elem))
    cd, cs = out["col"]  # transposed: [C, R padded to 32]
    r = shape[0]
    want_d, want_s = quantize_mx_torch(x, axis=0, elem=elem)
    assert_same_mx((cd[:, :r].t().cpu(), cs.t().cpu().view(torch.float8_e8m0fnu)), (want_d, want_s))
    assert torch.all(cd[:, r:].float() == 0), "padded rows must quantize to zero"
    rdq = dequantize_mx_torch(*quantize_mx_torch(x, axis=-1, elem=elem))
    assert torch.equal(out["row_dq"].cpu().nan_to_num(3.0), rdq.nan_to_num(3.0))
    cdq = dequantize_mx_torch(want_d, want_s, axis=0)
    assert torch.equal(out["col_dq"][:, :r].t().cpu().nan_to_num(3.0), cdq.nan_to_num(3.0))
    # the same columnwise outputs written in x's own layout
    nat = mx_cast(x.to(_dev()), col_q=True, col_dq=True, elem=elem, dq_dtype=torch.float32, col_layout="n",
                  variant=variant)
    nd, ns = nat["col"]  # [R padded to 32, C], [R/32, C]
    assert_same_mx((nd[:r].cpu(), ns.cpu().view(torch.float8_e8m0fnu)), (want_d, want_s))
    assert torch.all(nd[r:].float() == 0), "padded rows must quantize to zero"
    assert torch.equal(nat["col_dq"][:r].cpu().nan_to_num(3.0), cdq.nan_to_num(3.0))
    back = mx_dequant(nd, ns, torch.float32, axis=0)[:r]
    assert torch.equal(back.cpu().nan_to_num(3.0), cdq.nan_to_num(3.0))


@pytest.mark.parametrize("block", [16, 32])
def test_triton_rht_cast_matches_cpu(block):
    import torch.nn.functional as F
    from gemzoo_mxfp8.rht import hadamard_transform_torch, rht_signs
    from gemzoo_mxfp8.triton_kernels import hadamard_sign_matrix, mx_cast

    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(block))
    signs = rht_signs(block, seed=11)
    out = mx_cast(x.to(_dev()), col_q=True, rht=hadamard_sign_matrix(signs, block, _dev()))
    xt = hadamard_transform_torch(F.pad(x, (0, 0, 0, 19)).t().contiguous(), block, signs)  # [C, 64]
    want_d, want_s = quantize_mx_torch(xt)
    got_d, got_s = out["col"]
    assert torch.equal(bits(got_s.cpu()), bits(want_s))
    # the GPU sums in another order: allow a rare 1-ulp difference, never more
    got_f, want_f = got_d.cpu().float(), want_d.float()  # e4m3 values before scaling
    one_ulp = (want_f.abs() * 2**-3).clamp_min(2**-9)
    assert ((got_f - want_f).abs() <= one_ulp).all()
    assert (got_f != want_f).float().mean() < 0.01


def test_triton_dequant():
    from gemzoo_mxfp8.triton_kernels import mx_dequant

    x = edge_tensor(16, 80, seed=3)
    d, s = quantize_mx_torch(x)
    got = mx_dequant(d.to(_dev()), s.view(torch.uint8).to(_dev()), torch.float32).cpu()
    assert torch.equal(got.nan_to_num(1.0), dequantize_mx_torch(d, s).nan_to_num(1.0))


@pytest.mark.parametrize("sub", [0, 1])
@pytest.mark.parametrize("m,n,k,bias", [(48, 40, 96, True), (33, 17, 80, False)])  # 80: partial K block
def test_triton_gemm_exact_mx(m, n, k, bias, sub):
    from gemzoo_mxfp8.triton_kernels import mx_gemm

    gen = torch.Generator().manual_seed(m)
    a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 1e-3
    bvec = torch.randn(n, generator=gen) if bias else None
    (ad, as_), (bd, bs) = quantize_mx_torch(a), quantize_mx_torch(b)
    dev = _dev()
    c = mx_gemm(ad.to(dev), as_.view(torch.uint8).to(dev), bd.to(dev), bs.view(torch.uint8).to(dev),
                bias=None if bvec is None else bvec.to(dev), out_dtype=torch.float32,
                config=dict(BM=32, BN=32, BK=64, GROUP_M=2, SUB=sub, num_warps=4, num_stages=2)).cpu()
    want = dequantize_mx_torch(ad, as_).double() @ dequantize_mx_torch(bd, bs).double().t()
    if bias:
        want = want + bvec.double()
    assert torch.isfinite(c).all()
    assert ((c.double() - want).norm() / want.norm()).item() < 1e-6  # only the fp32 summation order differs
    # B given as its exact bf16 dequantization (how the linear passes weights): the same product
    b16 = dequantize_mx_torch(bd, bs).bfloat16()
    c2 = mx_gemm(ad.to(dev), as_.view(torch.uint8).to(dev), b16.to(dev), None,
                 bias=None if bvec is None else bvec.to(dev), out_dtype=torch.float32,
                 config=dict(BM=32, BN=32, BK=64, GROUP_M=2, SUB=sub, num_warps=4, num_stages=2)).cpu()
    assert ((c2.double() - want).norm() / want.norm()).item() < 1e-6


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_cuda_quantize_mx_bit_exact(elem, axis):
    x = edge_tensor(96, 160, seed=5, elem=elem).view(96, 4, 40).bfloat16()
    got = quantize_mx(x.cuda(), axis=axis, elem=elem)
    want = quantize_mx_torch(x, axis=axis, elem=elem)
    assert_same_mx((got[0].cpu(), got[1].cpu()), want)
    back = dequantize_mx(*got, axis=axis).cpu()
    assert torch.equal(back.nan_to_num(2.0), dequantize_mx_torch(*want, axis=axis).nan_to_num(2.0))


def test_triton_rowwise_casts():
    """fp8-rowwise Triton casts (row pass with column amax, transposed column pass) vs the torch casts."""
    from gemzoo_mxfp8.rowwise import quantize_rowwise
    from gemzoo_mxfp8.triton_kernels import rowwise_cast

    x = torch.randn(70, 300, generator=torch.Generator().manual_seed(0)) * 3
    out = rowwise_cast(x.to(_dev()), row=True, col=True, pad_to=16)
    q_t, s_t = out["col"]
    assert q_t.shape == (300, 80) and torch.all(q_t[:, 70:].float() == 0), "tokens pad to 16 with zeros"
    for (q, s), (wq, ws) in ((out["row"], quantize_rowwise(x)), ((q_t[:, :70], s_t), quantize_rowwise(x.t()))):
        assert q.shape == wq.shape and s.shape == ws.shape
        assert torch.allclose(s.cpu(), ws, rtol=1e-6, atol=0)
        # the GPU divides with a 2-ulp approximate division: a rare neighbour value is allowed there
        assert (q.cpu().float() != wq.float()).float().mean() <= (1e-3 if torch.cuda.is_available() else 0)
    empty = rowwise_cast(x[:0].to(_dev()), row=True, col=True, pad_to=16)  # no tokens: one zero block
    assert empty["row"][0].shape == (0, 300) and empty["col"][0].shape == (300, 16)
    assert torch.all(empty["col"][0].float() == 0)


@pytest.mark.parametrize("rows,pad_to", [(0, 16), (1, 16), (17, 16), (33, 1), (48, 16)])
def test_rowwise_transposed_cast_pads_after_its_scales(rows, pad_to):
    """quantize_rowwise_t equals quantize_rowwise of the zero-padded transpose bit for bit, but its amax reads
    only the real tokens: a reduction over the padded count beside the row cast's made torch 2.11's Inductor
    assert in its mix-order reduction fusion (compiled gem-bench jfa,fp8-rowwise)."""
    import torch.nn.functional as F
    from gemzoo_mxfp8.rowwise import quantize_rowwise, quantize_rowwise_t
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(rows, 24, generator=torch.Generator().manual_seed(rows)).bfloat16() * 30
    pad = (-rows) % pad_to if rows else pad_to
    want_q, want_s = quantize_rowwise(F.pad(x, (0, 0, 0, pad)).t())
    got_q, got_s = quantize_rowwise_t(x, pad_to)
    assert got_q.shape == want_q.shape == (24, rows + pad) and got_s.shape == (24, 1) and got_s.stride() == (1, 1)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_s, want_s)
    if rows:
        graph = make_fx(quantize_rowwise_t)(x, pad_to).graph
        amax_inputs = [n.args[0].meta["val"].shape for n in graph.nodes if n.target == torch.ops.aten.amax.default]
        assert amax_inputs and all(shape.numel() == rows * 24 for shape in amax_inputs), amax_inputs
