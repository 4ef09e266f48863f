"""gemzoo.ops: the extension loader, jagged <-> padded conversions and MX casts against torch definitions."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gemzoo import mx, ops
from gemzoo.errors import JaggedShapeError
from gemzoo.jagged import lengths_to_offsets
from gemzoo.testing.timeouts import hang_guard

needs_ext = pytest.mark.skipif(not ops.extension_available(), reason="gemzoo._C is not built")


def test_activation_codes_are_the_cpp_kernels_numbering():
    """gemzoo.attention's one table of activation codes is the numbering the C++ kernels are compiled with
    (enum Activation), and covers every activation."""
    from gemzoo.attention import ACTIVATION_CODES
    from gemzoo.interfaces.attention import ACTIVATIONS

    assert ops.ACTIVATION_CODES is ACTIVATION_CODES and set(ACTIVATION_CODES) == set(ACTIVATIONS)
    source = (Path(__file__).resolve().parents[1] / "csrc/attention/jagged_attention.cpp").read_text()
    enum = re.search(r"enum Activation \{([^}]*)\}", source).group(1)
    cpp = {name.lower(): int(code) for name, code in re.findall(r"(\w+)\s*=\s*(\d+)", enum)}
    assert cpp == ACTIVATION_CODES


def test_extension_info_is_json_and_lists_every_op():
    info = ops.extension_info()
    json.dumps(info)
    assert set(info["ops"]) == set(ops.OPS)
    if info["loaded"]:
        assert info["built_with_torch"].split("+")[0] == torch.__version__.split("+")[0]
        assert all("cpu" in op["extension"] for op in info["ops"].values())


@pytest.mark.multiprocess
def test_fallback_without_extension_runs_every_op():
    """GEMZOO_NO_EXTENSION=1: every op still works, in torch, and info says so."""
    code = (
        "import json, torch, gemzoo.ops as o\n"
        "x = torch.randn(4, 64)\n"
        "d, s = o.quantize_mx(x); o.dequantize_mx(d, s)\n"
        "o.hadamard_transform(x, 16)\n"
        "off = torch.tensor([0, 1, 4]); o.padded_to_jagged(o.jagged_to_padded(x, off, 3), off)\n"
        "q = torch.randn(4, 2, 8); o.jagged_attention(q, q, q, off)\n"
        "print(json.dumps(o.extension_info()))\n"
    )
    env = dict(os.environ, GEMZOO_NO_EXTENSION="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=hang_guard(300))
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["loaded"] is False and all(not op["extension"] for op in info["ops"].values())


def test_extension_built_for_another_torch_warns_and_falls_back(monkeypatch):
    import types

    import gemzoo

    fake = types.ModuleType("gemzoo._C")
    fake.TORCH_VERSION = "1.0.0+cpu"
    monkeypatch.delenv("GEMZOO_NO_EXTENSION", raising=False)  # set where the extension is not built (GPU image)
    monkeypatch.setattr(gemzoo, "_C", fake, raising=False)
    monkeypatch.setitem(sys.modules, "gemzoo._C", fake)
    with pytest.warns(RuntimeWarning, match=r"built for torch 1\.0\.0\+cpu but torch .* is running"):
        assert ops._load_extension.__wrapped__() is None


def test_ops_trace_into_one_graph_whether_or_not_the_extension_loads():
    """Whether gemzoo._C serves an op is decided once while tracing and kept as a constant: loading the extension
    never happens inside a graph, so a compiled caller traces in one piece (fullgraph) on either path."""
    values, off = torch.randn(10, 4), torch.tensor([0, 3, 10])

    def fn(v, o):
        return ops.jagged_to_padded(v, o, 8) * 2

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="eager")(values, off)
    assert torch.equal(got, fn(values, off))


# ------------------------------------------------------------------------------------ jagged <-> padded


def _jagged(lengths, *feat, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    off = lengths_to_offsets(torch.tensor(lengths))
    return torch.randn(int(off[-1]), *feat, generator=g).to(dtype), off


def _j2p_ref(values, off, max_len, pad):
    out = values.new_full((off.numel() - 1, max_len, *values.shape[1:]), pad)
    for b in range(off.numel() - 1):
        n = min(int(off[b + 1] - off[b]), max_len)
        out[b, :n] = values[off[b]: off[b] + n]
    return out


@pytest.mark.parametrize("lengths,feat,max_len", [
    ([3, 0, 5, 1, 0], (4,), 5),
    ([3, 0, 5, 1, 0], (2, 3), 7),
    ([3, 0, 5, 1, 0], (), 2),  # truncation
    ([0, 0], (3,), 4),
    ([6], (1,), 6),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("path", ["default", "torch"])
def test_jagged_to_padded_matches_loop(lengths, feat, max_len, dtype, path, monkeypatch):
    if path == "torch":  # the path a GPU takes (the extension's jagged ops are CPU-only)
        monkeypatch.setattr(ops, "_use_extension", lambda *a: False)
    values, off = _jagged(lengths, *feat, dtype=torch.float32)
    values = (values * 10).to(dtype)
    out = ops.jagged_to_padded(values, off, max_len, pad=-7)
    torch.testing.assert_close(out, _j2p_ref(values, off, max_len, -7), rtol=0, atol=0)


@pytest.mark.parametrize("lengths,feat", [([3, 0, 5, 1, 0], (4,)), ([2, 2], (2, 3)), ([0, 0], (3,)), ([4], ())])
def test_padded_to_jagged_roundtrip(lengths, feat):
    values, off = _jagged(lengths, *feat, seed=1)
    padded = ops.jagged_to_padded(values, off, max(max(lengths), 1) + 2, pad=3.0)
    assert torch.equal(ops.padded_to_jagged(padded, off), values)


def test_the_torch_path_pads_on_meta():
    """No boolean mask in the torch path (its size would be a device read, a host sync on a GPU): it runs on
    the meta device, where any read of a value raises, and gives a contiguous [B, L, *F]."""
    off = torch.tensor([0, 3, 3, 8], device="meta")
    out = ops.jagged_to_padded(torch.empty(8, 2, 4, device="meta"), off, 4)
    assert out.shape == (3, 4, 2, 4) and out.is_contiguous()


@pytest.mark.parametrize("path", ["default", "torch"])
def test_jagged_conversions_gradients(path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(ops, "_use_extension", lambda *a: False)
    values, off = _jagged([3, 0, 5, 1], 4, seed=2)
    values = values.double().requires_grad_()
    torch.autograd.gradcheck(lambda v: ops.jagged_to_padded(v, off, 4, 0.5), (values,))  # truncates 5 -> 4
    padded = torch.randn(4, 6, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda p: ops.padded_to_jagged(p, off), (padded,))


def test_padded_to_jagged_too_short_is_named():
    values, off = _jagged([3, 5], 2)
    with pytest.raises(JaggedShapeError, match="longest sequence has 5 rows but the padded length is 4"):
        ops.padded_to_jagged(torch.zeros(2, 4, 2), off)
    with pytest.raises(JaggedShapeError, match="B = len\\(offsets\\) - 1 = 2"):
        ops.padded_to_jagged(torch.zeros(3, 5, 2), off)


@needs_ext
def test_opcheck_jagged_ops():
    values, off = _jagged([3, 0, 5, 1, 0], 4, seed=3)
    values.requires_grad_()
    torch.library.opcheck(torch.ops.gemzoo.jagged_to_padded.default, (values, off, 5, 0.0))
    padded = torch.randn(5, 6, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.gemzoo.padded_to_jagged.default, (padded, off, int(off[-1])))


# ------------------------------------------------------------------------------------------------- MX


def _mx_inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 8)
    flat = x.view(-1)
    n = flat.numel()
    flat[torch.randint(0, n, (3,), generator=g)] = 0.0
    flat[int(torch.randint(0, n, (1,), generator=g))] = float("nan")
    flat[int(torch.randint(0, n, (1,), generator=g))] = float("inf")
    flat[int(torch.randint(0, n, (1,), generator=g))] = 3e-39  # fp32 subnormal
    if shape[0] > 1:
        x[0] = 0.0  # an all-zero block
    return x.to(dtype)


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _same_values(a, b):
    """Bit-identical except NaN payloads (torch's own fp32 -> bf16 casts differ there)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))


@pytest.mark.parametrize("shape,axis", [((6, 96), -1), ((6, 70), 1), ((96, 5), 0), ((3, 40, 7), 1), ((2, 3, 33), 2),
                                         ((1, 0), -1), ((0, 64), -1)])  # no elements along the axis; no rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_mx_bit_exact(shape, axis, dtype, elem):
    x = _mx_inputs(shape, dtype, seed=len(shape) + axis) if 0 not in shape else torch.zeros(shape, dtype=dtype)
    data, scale = ops.quantize_mx(x, axis=axis, elem=elem)
    ref_data, ref_scale = mx.quantize_mx_torch(x, axis=axis, elem=elem)
    assert data.dtype == elem and scale.dtype == torch.float8_e8m0fnu
    assert data.shape == ref_data.shape and scale.shape == ref_scale.shape
    assert _same_bits(data, ref_data) and _same_bits(scale, ref_scale)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = ops.dequantize_mx(data, scale, axis=axis, dtype=out_dtype)
        want = mx.dequantize_mx_torch(ref_data, ref_scale, axis=axis, dtype=out_dtype)
        assert got.dtype == out_dtype and _same_values(got, want)


@pytest.mark.parametrize("block", [16, 32, 8])
def test_quantize_mx_blocks_and_roundtrip_error(block):
    x = torch.randn(8, 128)
    data, scale = ops.quantize_mx(x, block=block)
    assert scale.shape == (8, 128 // block)
    back = ops.dequantize_mx(data, scale, block=block)
    assert ((back - x).norm() / x.norm()) < 0.05  # e4m3 keeps ~3 mantissa bits


def test_mx_bad_arguments_are_named():
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        ops.quantize_mx(torch.randn(4, 32), elem=torch.bfloat16)
    data, scale = ops.quantize_mx(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"scale must have shape \(4, 2\)"):
        ops.dequantize_mx(data, scale[:, :1])


@needs_ext
def test_opcheck_mx_ops():
    x = torch.randn(4, 70)
    for axis in (0, 1):
        torch.library.opcheck(torch.ops.gemzoo.quantize_mx.default, (x, axis, 32, torch.float8_e4m3fn))
        data, scale = torch.ops.gemzoo.quantize_mx(x, axis, 32, torch.float8_e4m3fn)
        # test_schema multiplies the inputs to detect mutation, which torch lacks for float8 tensors
        torch.library.opcheck(torch.ops.gemzoo.dequantize_mx.default, (data, scale, axis, 32, torch.float32),
                              test_utils=("test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))
