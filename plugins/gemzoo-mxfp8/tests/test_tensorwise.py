"""fp8-tensorwise: the per-tensor cast against a float64 rounding rule, the three GEMMs against float64, the
_scaled_mm path against the emulation, gradients against bf16, selective precision and conformance."""

import re

import pytest
import torch
from gemzoo_mxfp8 import tensorwise
from gemzoo_mxfp8.plugin import (
    DEFAULT_KEEP,
    FP8TensorwiseOptions,
    FP8TensorwisePolicy,
    MXFP8Policy,
    expand_keep,
)
from gemzoo_mxfp8.tensorwise import E4M3, E5M2, FP8TensorwiseLinear, quantize_tensorwise
from torch import nn

from gemzoo.api import BF16Linear, ConfigError, PrecisionConfig, precision_report, registry
from gemzoo.testing import check_precision_linear
from gemzoo.testing.precision import check_precision_apply, precision_linear_cases

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FORMATS = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0)}  # mantissa bits, smallest normal exponent, largest value


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# -- a float64 model of the whole procedure ---------------------------------------------------------------------
def ref_round(v: torch.Tensor, elem) -> torch.Tensor:
    """float64 values rounded to nearest even in ``elem``, saturating: written from the format's definition."""
    mbits, emin, fmax = FORMATS[elem]
    a = v.abs().clamp(max=fmax)
    e = torch.floor(torch.log2(a)).clamp(min=emin)  # subnormals share the smallest normal's quantum
    q = torch.exp2(e - mbits)
    return torch.copysign((torch.round(a / q) * q).clamp(max=fmax), v)


def ref_quant(x: torch.Tensor, elem, pow2=False):
    """(fp8 values as float64, float64 scale): scale = fp8_max / amax in fp32, x * scale rounded to fp32."""
    fmax = FORMATS[elem][2]
    amax = float(x.detach().double().abs().max())
    scale = torch.tensor(fmax / max(amax, tensorwise.EPS), dtype=torch.float64).float().double()  # the fp32 scale
    if pow2:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    scaled = (x.detach().double() * scale).float().double()
    return ref_round(scaled, elem), scale


def cast_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(24, 40, generator=gen) * torch.logspace(-12, 6, 40).view(1, -1)
    edge = torch.tensor([448.0, -448.0, 447.9, 240.0, 232.0, 1e-3, -2.0**-10, 0.0, -0.0, 3.3e-7] * 4).view(4, 10)
    return {"gaussian": torch.randn(33, 64, generator=gen), "wide": wide, "edge": edge,
            "bf16": torch.randn(17, 48, generator=gen).bfloat16(), "zeros": torch.zeros(5, 16)}


@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", list(cast_inputs()))
def test_cast_matches_float64_rule(case, elem, pow2):
    x = cast_inputs()[case]
    row, col, inv = quantize_tensorwise(x, elem, row=True, col=True, pad_to=16, pow2=pow2)
    want, scale = ref_quant(x, elem, pow2)
    assert row.dtype == elem and col.dtype == elem and inv.dtype == torch.float32 and inv.dim() == 0
    assert torch.equal(row.double(), want), (row.double() - want).abs().max()
    rows = x.shape[0]
    assert col.shape == (x.shape[1], rows + (-rows) % 16) and col.is_contiguous()
    assert torch.equal(col[:, :rows].double(), want.t()) and not col[:, rows:].double().any()  # zero padding
    assert float(inv) == pytest.approx(1 / float(scale), rel=2**-23)
    if case != "zeros":
        assert float(row.double().abs().max()) == pytest.approx(FORMATS[elem][2], rel=0.0 if not pow2 else 0.5)
    if pow2:
        assert float(torch.log2(1 / inv)) == int(torch.log2(1 / inv))


def test_cast_never_hides_non_finite():
    for bad in (float("nan"), float("inf")):
        x = torch.randn(8, 16)
        x[3, 5] = bad
        row, _, inv = quantize_tensorwise(x)
        assert torch.isnan(row.float() * inv).all(), bad


# -- the Triton cast (on the GPU, or under the interpreter on CPU tensors) -----------------------------------------
def _triton_device(monkeypatch):
    """"cuda", or "cpu" with the Triton code paths forced on (the pytest process runs the interpreter there)."""
    import gemzoo_mxfp8.cast as cast

    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setattr(cast, "FORCE_TRITON", True)
    return "cpu"


@pytest.mark.parametrize("pad_to", [1, 16])
@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", ["gaussian", "wide", "edge", "bf16", "zeros", "nan", "transposed"])
def test_triton_cast_is_bit_identical_to_torch(case, elem, pad_to, monkeypatch):
    """tensorwise_cast (one pass, both layouts) writes the bits quantize_tensorwise writes, from the same scale:
    saturation, signed zeros, subnormals, bf16 inputs, NaN, a strided input and the zero padding of x^T."""
    from gemzoo_mxfp8.triton_kernels import tensorwise_cast

    dev = _triton_device(monkeypatch)
    inputs = cast_inputs()
    x = {"nan": inputs["gaussian"].index_fill(1, torch.tensor([5]), float("nan")),
         "transposed": inputs["gaussian"].t()}.get(case, inputs.get(case))
    want_row, want_col, want_inv = quantize_tensorwise(x, elem, row=True, col=True, pad_to=pad_to)
    row, col = tensorwise_cast(x.to(dev), tensorwise.tensor_scale(x, elem).to(dev), elem, row=True, col=True,
                               pad_to=pad_to)
    assert row.dtype == col.dtype == elem and col.shape == want_col.shape and col.is_contiguous()
    for got, want in ((row, want_row), (col, want_col)):
        got, want = got.cpu(), want
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan)
        assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])
    only_col = tensorwise_cast(x.to(dev), torch.ones((), device=dev), elem, row=False, col=True, pad_to=pad_to)
    assert only_col[0].numel() == 0 and only_col[1].shape == want_col.shape


def test_triton_cast_without_tokens_writes_the_zero_padding(monkeypatch):
    from gemzoo_mxfp8.triton_kernels import tensorwise_cast

    dev = _triton_device(monkeypatch)
    row, col = tensorwise_cast(torch.empty(0, 32, device=dev), torch.ones((), device=dev), col=True, pad_to=16)
    assert row.shape == (0, 32) and col.shape == (32, 16) and not col.float().any()
    with pytest.raises(ValueError, match="2-D"):
        tensorwise_cast(torch.zeros(2, 3, 4, device=dev), torch.ones((), device=dev))
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        tensorwise_cast(torch.zeros(2, 4, device=dev), torch.ones((), device=dev), torch.float16)


@pytest.mark.parametrize("shape", [(2, 37, 64), (0, 64)], ids=["74-tokens", "no-tokens"])
def test_linear_gives_the_same_numbers_with_either_cast(shape, monkeypatch):
    """The whole linear, forward and both gradients, with casts="triton" against casts="torch": the same fp8
    operands reach the same GEMMs, so the outputs are equal."""
    dev = _triton_device(monkeypatch)
    x, g = torch.randn(shape, device=dev), torch.randn(*shape[:-1], 48, device=dev)
    outs = {}
    for casts in ("torch", "triton"):
        torch.manual_seed(0)
        lin = FP8TensorwiseLinear.from_linear(nn.Linear(64, 48, device=dev), out_dtype=torch.float32, casts=casts)
        outs[casts] = _run(lin, x, g)
    for name, a, b in zip(("y", "dx", "dw", "db"), outs["triton"], outs["torch"], strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="casts must be one of"):
        FP8TensorwiseLinear.from_linear(nn.Linear(4, 4), casts="cuda")


@pytest.mark.slow
def test_triton_cast_custom_op(monkeypatch):
    """The cast as a torch custom op: opcheck (schema, fake tensors, dynamic shapes), and a compiled linear with
    varying token counts traced in one graph through it."""
    from gemzoo_mxfp8 import ops

    dev = _triton_device(monkeypatch)
    x = torch.randn(37, 64, device=dev).bfloat16()
    scale = tensorwise.tensor_scale(x)
    for row, col, pad in ((True, True, 16), (False, True, 1), (True, False, 1)):
        torch.library.opcheck(torch.ops.gemzoo_mxfp8.tensorwise_cast.default, (x, scale, E4M3, row, col, pad))
    assert ops.tensorwise_cast_op(x, scale, col=True, pad_to=16)[1].shape == (64, 48)
    lin = FP8TensorwiseLinear.from_linear(nn.Linear(64, 48, device=dev), out_dtype=torch.float32)
    data = {t: (torch.randn(t, 64, device=dev), torch.randn(t, 48, device=dev)) for t in (45, 70)}
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    want, got = {}, {}
    for t in data:
        for module, out in ((lin, want), (compiled, got)):
            lin.weight.grad = lin.bias.grad = None
            out[t] = _run(module, *data[t])
    for t in want:
        for a, b in zip(got[t], want[t], strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), t


def _linear_pair(k, n, bias, out_dtype, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(k, n, bias=bias)
    twin = nn.Linear(k, n, bias=bias)
    twin.load_state_dict(ref.state_dict())
    return ref, FP8TensorwiseLinear.from_linear(twin, out_dtype=out_dtype)


def _run(module, x, g):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.float().backward(g)
    return [y.detach().float(), x.grad.float(), module.weight.grad.float()] + (
        [module.bias.grad.float()] if module.bias is not None else [])


@pytest.mark.parametrize("shape", [(2, 37, 64), (128, 64), (5, 64)], ids=["3d-74", "128", "5"])
@pytest.mark.parametrize("bias", [True, False])
def test_three_gemms_match_float64(shape, bias):
    """Y, dX, dW from the float64 model of the casts (X, W e4m3; dY e5m2) and float64 GEMMs: only fp32 sums differ."""
    ref_lin, lin = _linear_pair(64, 48, bias, torch.float32)
    x, g = torch.randn(shape), torch.randn(*shape[:-1], 48)
    y, dx, dw, *db = _run(lin, x, g)
    x2, g2 = x.reshape(-1, 64), g.reshape(-1, 48)
    xq, sx = ref_quant(x2, E4M3)
    wq, sw = ref_quant(ref_lin.weight, E4M3)
    gq, sg = ref_quant(g2, E5M2)
    y_ref = xq @ wq.t() / (sx * sw) + (ref_lin.bias.double() if bias else 0)
    assert rel(y.reshape(-1, 48), y_ref) < 1e-6
    assert rel(dx.reshape(-1, 64), gq @ wq / (sg * sw)) < 1e-6
    assert rel(dw, gq.t() @ xq / (sg * sx)) < 1e-6
    if bias:
        assert rel(db[0], g2.double().sum(0)) < 1e-6
    # and against fp32, within the policy's promise
    for name, a, b in zip(("y", "dx", "dw"), (y, dx, dw), _run(ref_lin, x, g), strict=False):
        assert rel(a, b) < FP8TensorwisePolicy.capabilities.linear_rtol, name


def test_scaled_mm_path_matches_emulation(monkeypatch):
    """The CUDA route (torch._scaled_mm, scalar inverse scales, a row-major, b column-major) run on CPU tensors:
    the same numbers as the emulation, for all three GEMMs, with 74 tokens (wgrad pads them to 80)."""
    x, g = torch.randn(2, 37, 64), torch.randn(2, 37, 48)
    _, lin = _linear_pair(64, 48, True, torch.float32)
    want = _run(lin, x, g)
    calls = []
    real = torch._scaled_mm

    def spy(a, b, **kw):
        calls.append((tuple(a.shape), tuple(b.shape), kw["scale_a"].shape, kw["use_fast_accum"]))
        return real(a, b, **kw)

    monkeypatch.setattr(tensorwise, "SCALED_MM_ON_CPU", True)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    for p in lin.parameters():
        p.grad = None
    got = _run(lin, x, g)
    assert calls == [((74, 64), (64, 48), (), True), ((74, 48), (48, 64), (), False), ((48, 80), (80, 64), (), False)]
    for name, a, b in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), name


def test_non_contiguous_input_and_gradient(monkeypatch):
    """A transposed input and a transposed output gradient still reach _scaled_mm in the layouts it reads."""
    monkeypatch.setattr(tensorwise, "SCALED_MM_ON_CPU", True)
    ref, lin = _linear_pair(64, 48, True, torch.float32)
    x = torch.randn(64, 80).t().requires_grad_()  # [80, 64], column-major
    g = torch.randn(48, 80).t()
    y = lin(x)
    y.backward(g)
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).backward(g)
    for name, a, b in (("y", y, ref(x_ref)), ("dx", x.grad, x_ref.grad), ("dw", lin.weight.grad, ref.weight.grad)):
        assert rel(a, b) < FP8TensorwisePolicy.capabilities.linear_rtol, name


def test_scaled_mm_refuses_wrong_layouts(monkeypatch):
    monkeypatch.setattr(tensorwise, "SCALED_MM_ON_CPU", True)
    a = torch.randn(32, 64).to(E4M3)
    one = torch.ones(())
    with pytest.raises(RuntimeError, match="column-major"):
        tensorwise.scaled_mm(a, one, torch.randn(64, 48).to(E4M3), one, torch.float32)


def test_zero_tokens_and_frozen_weight():
    _, lin = _linear_pair(64, 48, True, torch.bfloat16)
    x = torch.randn(0, 64, requires_grad=True)
    y = lin(x)
    y.float().sum().backward()
    assert y.shape == (0, 48) and x.grad.shape == (0, 64) and torch.equal(lin.weight.grad, torch.zeros(48, 64))
    lin.weight.requires_grad_(False)
    x = torch.randn(10, 64, requires_grad=True)
    lin(x).float().sum().backward()
    assert x.grad.shape == (10, 64) and torch.isfinite(x.grad).all()


def test_bf16_inputs_and_weights():
    ref, lin = _linear_pair(64, 48, True, None)
    lin = lin.bfloat16()
    x, g = torch.randn(40, 64), torch.randn(40, 48)
    y = lin(x.bfloat16())
    assert y.dtype == torch.bfloat16
    got = _run(lin, x.bfloat16(), g)
    assert lin.weight.grad.dtype == torch.bfloat16
    for name, a, b in zip(("y", "dx", "dw"), got, _run(ref, x, g), strict=False):
        assert rel(a, b) < FP8TensorwisePolicy.capabilities.linear_rtol + 0.01, name  # + bf16 rounding


def test_shape_error_is_clear():
    with pytest.raises(ValueError, match="last dim 64"):
        FP8TensorwiseLinear.from_linear(nn.Linear(64, 8))(torch.randn(4, 32))


# -- the policy ---------------------------------------------------------------------------------------------------
class Block(nn.Module):
    is_transformer_block = True

    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)).float())).float()


class Toy(nn.Module):
    def __init__(self, d=32, layers=4):
        super().__init__()
        self.embed = nn.EmbeddingBag(50, d)
        self.embed_proj = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, ids, offsets):
        x = self.embed_proj(self.embed(ids, offsets)).float()
        for b in self.blocks:
            x = b(x)
        return self.head(x).float()


def test_registered():
    assert isinstance(registry.get("precision", "fp8-tensorwise"), FP8TensorwisePolicy)


def test_selection_follows_the_mxfp8_rule():
    policy = FP8TensorwisePolicy()
    model = Toy()
    cfg = PrecisionConfig(keep=["blocks.2.fc2"])
    assert policy.keep_patterns(model, cfg) == MXFP8Policy().keep_patterns(model, cfg)  # one rule, shared
    assert set(expand_keep(model, DEFAULT_KEEP)) <= set(policy.keep_patterns(model, cfg))
    before = set(model.state_dict())
    policy.apply(model, cfg)
    rep = precision_report(model)
    assert set(model.state_dict()) == before
    assert rep["embed_proj"] == "bf16" and rep["head"] == "bf16"
    for i, want in enumerate(["bf16", "fp8-tensorwise", "fp8-tensorwise", "bf16"]):  # first and last blocks kept
        assert rep[f"blocks.{i}.fc1"] == want, i
    assert rep["blocks.2.fc2"] == "bf16" and policy.last_plan["blocks.2.fc2"] == "kept"  # precision.keep
    assert type(model.blocks[1].norm) is nn.LayerNorm and type(model.embed) is nn.EmbeddingBag  # never swapped
    assert type(model.blocks[0].fc1) is BF16Linear


def test_default_keep_off():
    model = FP8TensorwisePolicy(FP8TensorwiseOptions(default_keep=False)).apply(Toy(), PrecisionConfig(keep=["head"]))
    rep = precision_report(model)
    assert rep["blocks.0.fc1"] == rep["blocks.3.fc2"] == rep["embed_proj"] == "fp8-tensorwise"
    assert rep["head"] == "bf16"


def test_options():
    policy = registry.get("precision", "fp8-tensorwise").configure(FP8TensorwiseOptions(pow2_scales=True,
                                                                                        fast_accum=False))
    lin = policy.make_linear(nn.Linear(32, 16))
    assert lin.pow2 and not lin.fast_accum and lin.out_dtype == torch.bfloat16 and lin.casts == "triton"
    assert policy.configure(FP8TensorwiseOptions(casts="torch")).make_linear(nn.Linear(32, 16)).casts == "torch"
    with pytest.raises(ConfigError, match="fp8-tensorwise.casts must be one of"):
        FP8TensorwiseOptions(casts="fused")
    for key in ("default_keep", "pow2_scales", "fast_accum"):
        with pytest.raises(ConfigError, match=f"fp8-tensorwise.{key} must be true or false"):
            FP8TensorwiseOptions(**{key: "yes"})


def test_gradients_close_to_bf16():
    """One step of a small model: every parameter's gradient under fp8-tensorwise (all linears in fp8) within
    tolerance of the bf16 policy's, and the loss within 1%."""
    torch.manual_seed(0)
    ids, offsets = torch.randint(0, 50, (300,)), torch.arange(0, 300, 3)
    target = torch.randn(100, 1)
    grads, losses = {}, {}
    for name in ("bf16", "fp8-tensorwise"):
        torch.manual_seed(1)
        model = Toy()
        policy = registry.get("precision", name)
        if name == "fp8-tensorwise":
            policy = policy.configure(FP8TensorwiseOptions(default_keep=False))
        policy.apply(model, PrecisionConfig())
        loss = (model(ids, offsets) - target).pow(2).mean()
        loss.backward()
        losses[name] = float(loss.detach())
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    assert abs(losses["fp8-tensorwise"] - losses["bf16"]) < 0.01 * losses["bf16"]
    tol = 2 * FP8TensorwisePolicy.capabilities.linear_rtol  # errors of several fp8 linears add up
    errors = {n: rel(grads["fp8-tensorwise"][n], g) for n, g in grads["bf16"].items()}
    assert max(errors.values()) < tol, errors


@pytest.mark.parametrize("case", precision_linear_cases(), ids=str)
def test_conformance_linear(case):
    check_precision_linear(FP8TensorwisePolicy(FP8TensorwiseOptions(pow2_scales=True)), **case.kwargs())


def test_conformance_apply():
    check_precision_apply(FP8TensorwisePolicy())


@pytest.mark.slow
def test_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True, dynamic token counts) traces the casts and the autograd Function, forward
    and backward, and computes what eager does."""
    torch.manual_seed(0)
    _, lin = _linear_pair(64, 48, True, torch.bfloat16)
    want = {t: _run(lin, torch.randn(t, 64), torch.randn(t, 48)) for t in (45, 70)}
    torch.manual_seed(0)
    _, lin = _linear_pair(64, 48, True, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True, dynamic=True)
    got = {t: _run(compiled, torch.randn(t, 64), torch.randn(t, 48)) for t in (45, 70)}
    for t in want:
        for a, b in zip(got[t], want[t], strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), t


@pytest.mark.slow
def test_inductor_fuses_the_amax_and_both_casts():
    """Compiled by Inductor (CPU, dynamic shapes), the amax, the scale and both layouts of the cast become at most
    two kernels (one on torch 2.13's CPU backend: a reduction and the writes fused) and match eager bit for bit."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = torch.compile(quantize_tensorwise, dynamic=True)
    x = torch.randn(100, 256).bfloat16()
    out, codes = run_and_get_code(fn, x, E5M2, True, True, 16, False)
    kernels = set(re.findall(r"(?:cpp|triton)_\w*fused_\w+", "\n".join(codes)))
    assert 1 <= len(kernels) <= 2, kernels
    for got, want in zip(out, quantize_tensorwise(x, E5M2, True, True, 16, False), strict=True):
        assert torch.equal(got.float(), want.float())


# -- CUDA (skipped without a GPU) ----------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_matches_cpu_emulation(compiled):
    """torch._scaled_mm on the GPU against the CPU emulation of the same casts: the same fp8 operands, so only
    fp32 summation order, fast accumulation in the forward and the bf16 output differ."""
    x, g = torch.randn(3, 100, 256), torch.randn(3, 100, 128)
    _, cpu_lin = _linear_pair(256, 128, True, torch.bfloat16)
    _, gpu_lin = _linear_pair(256, 128, True, torch.bfloat16)
    gpu_lin = gpu_lin.cuda()
    if compiled:
        torch._dynamo.reset()
        gpu_lin = torch.compile(gpu_lin, dynamic=True)
    want = _run(cpu_lin, x, g)
    got = [t.cpu() for t in _run(gpu_lin, x.cuda(), g.cuda())]
    for name, a, b in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        assert rel(a, b) < 1e-2, name
