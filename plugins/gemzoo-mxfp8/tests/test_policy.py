"""The mxfp8 / fp8-rowwise / fp8-tensorwise policies: registration, options, selective precision, MX attention."""

import pytest
import torch
from gemzoo_mxfp8.attention import MXAttention, fake_quant_mx_sequence
from gemzoo_mxfp8.linear import MXLinear
from gemzoo_mxfp8.plugin import MXFP8Options, MXFP8Policy
from torch import nn

from gemzoo.api import (
    AttentionRequest,
    BF16Linear,
    ConfigError,
    JaggedAttention,
    PrecisionConfig,
    precision_report,
    registry,
)


class Block(nn.Module):
    is_transformer_block = True

    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.attn = JaggedAttention(AttentionRequest())
        self.out = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, offsets):
        t, d = x.shape
        q, k, v = self.qkv(x).to(x.dtype).view(t, 3, 2, d // 2).unbind(1)
        x = x + self.out(self.attn(q, k, v, offsets).reshape(t, d)).to(x.dtype)
        return x + self.mlp(x).to(x.dtype)


class Toy(nn.Module):
    def __init__(self, d=32, layers=4):
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.embed_proj = nn.Linear(d, d)
        self.tower = nn.Module()
        self.tower.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Module()
        self.head.click = nn.Linear(d, 1)

    def forward(self, ids, offsets):
        x = self.embed_proj(self.embed(ids)).to(self.embed.weight.dtype)
        for b in self.tower.blocks:
            x = b(x, offsets)
        return self.head.click(x)


def test_registered_through_entry_point():
    assert {"mxfp8", "fp8-rowwise", "fp8-tensorwise"} <= set(registry.names("precision"))
    assert isinstance(registry.get("precision", "mxfp8"), MXFP8Policy)


def test_default_keep_list():
    model = MXFP8Policy().apply(Toy(), PrecisionConfig())
    rep = precision_report(model)
    assert rep["embed_proj"] == "bf16" and rep["head.click"] == "bf16"
    for name in ("qkv", "out", "mlp.0", "mlp.2"):
        assert rep[f"tower.blocks.0.{name}"] == "bf16", name
        assert rep[f"tower.blocks.3.{name}"] == "bf16", name
        assert rep[f"tower.blocks.1.{name}"] == "mxfp8", name
        assert rep[f"tower.blocks.2.{name}"] == "mxfp8", name


def test_user_keep_and_no_default():
    policy = MXFP8Policy().configure(MXFP8Options(default_keep=False))
    model = policy.apply(Toy(), PrecisionConfig(keep=["*.mlp.*"]))
    rep = precision_report(model)
    assert rep["tower.blocks.0.qkv"] == "mxfp8" and rep["head.click"] == "mxfp8"
    assert rep["tower.blocks.2.mlp.0"] == "bf16" and rep["tower.blocks.2.out"] == "mxfp8"
    assert policy.last_plan["tower.blocks.2.mlp.2"] == "kept"
    assert type(model.get_submodule("tower.blocks.2.mlp.2")) is BF16Linear


def test_state_dict_names_unchanged():
    model = Toy()
    before = set(model.state_dict())
    MXFP8Policy().configure(MXFP8Options(default_keep=False)).apply(model, PrecisionConfig())
    assert set(model.state_dict()) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trains_any_module(dtype):
    torch.manual_seed(0)
    model = Toy().to(dtype)
    MXFP8Policy().configure(MXFP8Options(default_keep=False, rht=True)).apply(model, PrecisionConfig())
    assert sum(isinstance(m, MXLinear) for m in model.modules()) == 4 * 4 + 2
    ids = torch.randint(0, 50, (40,))
    offsets = torch.tensor([0, 7, 40])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randn(40, 1)
    losses = []
    for _ in range(8):
        loss = (model(ids, offsets).float() - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["mxfp8", "fp8-rowwise", "fp8-tensorwise"])
def test_policy_linears_compute_in_bf16(name):
    """Like BF16Linear: fp32 activations in, bf16 out (so attention and activations downstream run in bf16),
    and the input gradient comes back in the input's dtype."""
    policy = registry.get("precision", name)
    lin = policy.make_linear(nn.Linear(64, 32))
    x = torch.randn(8, 64, requires_grad=True)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


def test_weight_dtype_bf16():
    model = MXFP8Policy().configure(MXFP8Options(default_keep=False, weight_dtype="bf16")).apply(Toy(), PrecisionConfig())
    assert model.tower.blocks[1].qkv.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("bad,match", [(dict(rht_block=8), "rht_block"), (dict(grad_elem="e3m4"), "grad_elem"),
                                       (dict(backend="cutlass"), "backend"), (dict(attention_layers="*"), "list")])
def test_bad_options(bad, match):
    with pytest.raises(ConfigError, match=match):
        MXFP8Options(**bad)


def test_mx_attention_per_layer():
    model = Toy()
    policy = MXFP8Policy().configure(MXFP8Options(attention=True, attention_layers=["tower.blocks.1.*"]))
    policy.apply(model, PrecisionConfig())
    kinds = {i: type(b.attn.kernel).__name__ for i, b in enumerate(model.tower.blocks)}
    assert kinds[1] == "MXAttention" and kinds[0] != "MXAttention" and kinds[2] != "MXAttention"
    assert precision_report(model)["tower.blocks.1.attn"] == "mxfp8"


def test_mx_attention_numerics():
    ref_kernel = registry.get("attention", "reference")
    mx = MXAttention(ref_kernel, "reference")
    torch.manual_seed(0)
    offsets = torch.tensor([0, 5, 45, 45, 90])
    q, k, v = (torch.randn(90, 2, 64, requires_grad=True) for _ in range(3))
    out = mx(q, k, v, offsets)
    want = ref_kernel(q, k, v, offsets)
    err = float((out - want).detach().norm() / want.detach().norm())
    assert 1e-4 < err < 0.06, err
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(v.grad).all()


def test_v_quantized_per_sequence():
    """A huge value in one sequence must not change the MX scale of its neighbour's keys."""
    v = torch.randn(64, 1, 32)
    offsets = torch.tensor([0, 20, 64])
    a = fake_quant_mx_sequence(v, offsets)
    v2 = v.clone()
    v2[0] = 1e6
    b = fake_quant_mx_sequence(v2, offsets)
    assert torch.equal(a[20:], b[20:])


def test_mx_attention_through_jfa():
    """The MX path wraps whatever kernel a site uses: through jfa it matches the MX reference."""
    if "jfa" not in registry.names("attention"):
        pytest.skip("gemzoo-jfa is not installed")
    ref_kernel = registry.get("attention", "reference")
    jfa = registry.get("attention", "jfa")
    torch.manual_seed(1)
    offsets = torch.tensor([0, 33, 40, 100])
    q, k, v = (torch.randn(100, 2, 32) for _ in range(3))
    got = MXAttention(jfa, "jfa")(q, k, v, offsets)
    want = MXAttention(ref_kernel, "reference")(q, k, v, offsets)
    assert float((got - want).norm() / want.norm()) < 1e-4
