"""act-quant: the fp8 casts, what is and is not quantized, gradients and loss against the unquantized run."""

from __future__ import annotations

import math

import pytest
import torch
from gemzoo_act_quant import ActQuantOptions, ActQuantPolicy, dequantize, quantize
from gemzoo_act_quant.plugin import inline_supported
from gemzoo_act_quant.quant import mx_api

from gemzoo.api import ConfigError, Trainer, load_config, registry

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs" / "gem-tiny.toml")
# e4m3 keeps 3 mantissa bits: every element within 2^-4 of itself; a parameter's gradient, the sum of
# many such products, lands at 1-3.5% on gem-tiny. The promise the policy declares (gemzoo.testing.memory reads it):
GRAD_RTOL = ActQuantPolicy.grad_rtol


# ------------------------------------------------------------------------------------------ casts
@pytest.mark.parametrize("scale", ["row", "block32", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip_within_e4m3_rounding(scale, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 70, generator=g) * torch.logspace(-3, 3, 37).unsqueeze(1)).to(dtype)
    x[3] = 0.0  # an all-zero row
    p = quantize(x, torch.float8_e4m3fn, scale)
    y = dequantize(p)
    assert y.dtype == dtype and y.shape == x.shape
    assert p.nbytes < x.numel() * x.element_size()
    xf, yf = x.float(), y.float()
    # normals: relative error <= 2^-4; tiny values relative to their row/block max may flush to
    # e4m3 subnormals, whose absolute step is 2^-9 of the group scale
    amax = xf.abs().amax(dim=1, keepdim=True)
    bound = torch.maximum(xf.abs() * 2**-4, amax * 2**-9 / 448 * 2) + xf.abs() * 2**-7  # + the dtype's own rounding
    assert bool(((xf - yf).abs() <= bound).all())
    assert bool((y[3] == 0).all())


@pytest.mark.parametrize("scale", ["row", "block32"])
def test_strides_come_back(scale):
    """Compiled backward graphs assert the strides of what they saved: a view of q out of a fused qkv."""
    qkv = torch.randn(50, 3, 4, 32)
    q = qkv.unbind(1)[0]
    y = dequantize(quantize(q, torch.float8_e4m3fn, scale))
    assert y.shape == q.shape and y.stride() == q.stride()
    assert torch.allclose(y, q, rtol=2**-4, atol=1e-2)


def test_powers_of_two_are_exact_and_nan_stays():
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0, 2.0**-6], [3.0, 0.0, float("nan"), 1.5, 0.75]]).repeat(1, 8)
    y = dequantize(quantize(x, torch.float8_e4m3fn, "row"))
    assert torch.equal(y[0], x[0])
    assert bool(y[1].isnan().eq(x[1].isnan()).all())
    finite = ~x[1].isnan()
    assert torch.equal(y[1][finite], x[1][finite])


@pytest.mark.skipif(mx_api() is None, reason="gemzoo-mxfp8 not installed")
def test_block32_uses_the_mx_cast_when_installed():
    x = torch.randn(8, 64)
    p = quantize(x, torch.float8_e4m3fn, "block32")
    assert p.kind == "mx" and p.scale.dtype == torch.float8_e8m0fnu
    assert p.scale.shape == (8, 2)


# ------------------------------------------------------------------------------------------ options
def test_registered():
    assert "act-quant" in registry.names("memory")
    entry = registry.entry("memory", "act-quant")
    assert entry.distribution == "gemzoo-act-quant"


@pytest.mark.parametrize("bad, match", [
    ({"elem": "e3m4"}, "elem must be one of"),
    ({"scale": "tensor"}, "scale must be one of"),
    ({"modules": "tower.*"}, "list of fnmatch patterns"),
    ({"min_numel": -1}, "min_numel"),
    ({"fp32": "yes"}, "fp32 must be one of"),
])
def test_bad_options_name_the_fix(bad, match):
    with pytest.raises(ConfigError, match=match):
        ActQuantOptions(**bad)


# ------------------------------------------------------------------------------------------ the hooks
class _SaveAll(torch.autograd.Function):
    """Saves whatever it is given, then returns grad * 2 for the float input."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.save_for_backward(x, *others)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        x, *others = ctx.saved_tensors
        ctx.unpacked = [x, *others]
        return (g * 2, *[None] * len(others))


def _policy(**kw) -> ActQuantPolicy:
    policy = ActQuantPolicy(ActQuantOptions(**kw))
    policy.apply(torch.nn.Linear(2, 2), None)
    return policy


def test_skips_what_it_cannot_hold_and_says_so_once(capfd):
    policy = _policy(min_numel=16)
    x = torch.randn(64, 64, requires_grad=True)
    offsets = torch.arange(0, 65, 8)
    mask = torch.rand(64, 64) > 0.5
    sparse = torch.randn(64, 64).to_sparse()
    fp8 = torch.randn(64, 64).to(torch.float8_e4m3fn)
    for _ in range(2):
        with policy.step_context():
            y = _SaveAll.apply(x, offsets, mask, sparse, fp8)
            y.sum().backward()
    err = capfd.readouterr().err
    for note in ("integer/bool", "sparse", "8 bits"):
        assert err.count(note) == 1, (note, err)
    r = policy.report()
    assert r["skipped"] == {"integer": 2, "sparse": 1, "8-bit": 1}
    assert sum(v["tensors"] for v in r["quantized"].values()) == 1  # only x
    assert r["bytes_saved_per_step"] == 64 * 64 * 4 - r["bytes_after_per_step"] > 0


def test_patterns_parameters_and_statistics_stay_exact():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64))
    policy = ActQuantPolicy(ActQuantOptions(min_numel=1, exclude=["2"]))
    policy.apply(model, None)
    with policy.step_context():
        model(torch.randn(128, 64)).sum().backward()
    r = policy.report()
    modules = {k.split()[0] for k in r["quantized"]}
    assert modules == {"1"}, r["quantized"]  # layer norm's input; not "0" (its input needs no grad), not "2"
    assert r["skipped"]["parameter"] >= 3 and r["skipped"]["pattern"] >= 1


# ------------------------------------------------------------------------------------------ gem-tiny
def _trainer(plugins: str, tmp_path, *extra) -> Trainer:
    cfg = load_config(TINY, overrides=["eval.every=0", "checkpoint.every=0", *extra], plugins=plugins)
    return Trainer(cfg, out_dir=str(tmp_path / plugins.replace(",", "-")), progress=False).assemble()


def _grads(tr: Trainer) -> dict[str, torch.Tensor]:
    batch = tr.dataset.train_batch(0).to(tr.device)
    contexts = [p.step_context() for p in tr.memory]
    for c in contexts:
        c.__enter__()
    tr.forward(batch).loss.backward()
    for c in reversed(contexts):
        c.__exit__(None, None, None)
    return {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
            for n, p in tr.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("plugins", ["jfa,fp32", "jfa,bf16", "jfa,bf16,full-ac", "jfa,mxfp8"])
def test_gradients_match_unquantized_per_parameter(plugins, tmp_path):
    ref = _grads(_trainer(plugins, tmp_path / "ref"))
    tr = _trainer(plugins + ",act-quant", tmp_path / "aq")
    got = _grads(tr)
    assert got.keys() == ref.keys()
    rel = {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref}
    worst = sorted(rel.items(), key=lambda kv: -kv[1])[:5]
    print(f"{plugins}: relative gradient error per parameter, worst: "
          + ", ".join(f"{n} {e:.4f}" for n, e in worst) + f"; median {sorted(rel.values())[len(rel) // 2]:.4f}")
    assert all(math.isfinite(e) for e in rel.values())
    assert worst[0][1] <= GRAD_RTOL, worst
    report = tr.memory[-1].report()
    assert report["bytes_saved_per_step"] > 0
    assert not any("float8" in k for k in report["quantized"])  # mxfp8's own fp8 is never quantized again
    if "mxfp8" in plugins:
        assert report["skipped"].get("8-bit", 0) > 0


@pytest.mark.slow
def test_loss_within_one_percent_of_unquantized(tmp_path):
    """The README records the 400-step figure (run by hand); CI trains 60 steps."""
    steps = 60
    a = _trainer("jfa,bf16", tmp_path / "a", f"run.steps={steps}").fit()
    b = _trainer("jfa,bf16,act-quant", tmp_path / "b", f"run.steps={steps}").fit()
    la = sum(h["loss"] for h in a.history[-10:]) / 10
    lb = sum(h["loss"] for h in b.history[-10:]) / 10
    print(f"mean loss of the last 10 of {steps} steps: {la:.5f} without, {lb:.5f} with act-quant "
          f"({100 * (lb / la - 1):+.3f}%)")
    assert abs(lb / la - 1) < 0.01


def test_config_show_lists_the_selection(capsys):
    from gemzoo.testing import cli_main as main

    assert main(["config", "show", TINY, "--plugins", "jfa,act-quant"]) == 0
    import json

    selection = json.loads(capsys.readouterr().out)["memory_selection"]
    assert selection["act-quant"]["min_numel"] == 4096 and selection["act-quant"]["modules"] == ["*"]
    assert "integer/bool" in selection["act-quant"]["never"]


@pytest.mark.slow
@pytest.mark.skipif(not inline_supported(), reason="this torch does not inline saved-tensor hooks")
def test_compiled_graphs_cast_inside_the_graphs(tmp_path):
    """run.compile: the casts are inlined into the compiled graphs (PT2 GraphModule saved-tensor hooks), so no
    eager hook runs for what the graphs save; the loss stays within 1% of compiled training without them, and
    another element format compiles anew (the hooks' cache hash) instead of reusing a cached graph."""
    steps = ["run.steps=3", "run.compile=true", "model.num_layers=1"]
    base = _trainer("jfa,bf16", tmp_path / "base", *steps).fit()
    tr = _trainer("jfa,bf16,act-quant", tmp_path / "aq", *steps)
    got = tr.fit()
    policy = tr.memory[-1]
    report = policy.report()
    assert report["inlined"] and "inside the compiled graphs" in report["summary"]
    assert not any(k.startswith("<graph>") for k in report["quantized"])  # nothing of the graphs went eager
    assert abs(got.final_loss / base.final_loss - 1) < 0.01
    e5 = _trainer("jfa,bf16,act-quant", tmp_path / "e5", *steps, "plugins.options.act-quant.elem='e5m2'").fit()
    assert e5.final_loss != got.final_loss
    off = _trainer("jfa,bf16,act-quant", tmp_path / "off", *steps, "plugins.options.act-quant.inline=false")
    off.fit()
    assert not off.memory[-1].report()["inlined"] and off.memory[-1].report()["bytes_saved_per_step"] > 0
