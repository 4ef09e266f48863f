"""The shared attention input check and semantics every kernel follows.

Parametrised over every registered kernel that runs on CPU, so a plugin's kernel is held to the same rules.
"""

from __future__ import annotations

import pytest
import torch

import gemzoo
from gemzoo.errors import JaggedShapeError, PluginError
from gemzoo.jagged import lengths_to_offsets


def _cpu_kernels():
    return [n for n in gemzoo.registry.names("attention")
            if "cpu" in gemzoo.registry.get("attention", n).capabilities.devices]


def _softmax_kernels():
    return [n for n in _cpu_kernels() if "softmax" in gemzoo.registry.get("attention", n).capabilities.activations]


def _inputs(q_lens=(3, 0, 5), k_lens=None, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_lens = q_lens if k_lens is None else k_lens
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    k = torch.randn(sum(k_lens), heads, dim, generator=gen)
    v = torch.randn(sum(k_lens), heads, dim, generator=gen)
    return q, k, v, lengths_to_offsets(torch.tensor(q_lens)), lengths_to_offsets(torch.tensor(k_lens))


def _some_activation(caps):
    return "softmax" if "softmax" in caps.activations else sorted(caps.activations)[0]


@pytest.mark.parametrize("name", _cpu_kernels())
@pytest.mark.parametrize("hint", ["max_q_len", "max_k_len"])
def test_too_small_hints_raise_in_every_kernel(name, hint):
    """Item 21: sdpa-padded silently dropped keys when max_k_len was too small."""
    kernel = gemzoo.registry.get("attention", name)
    act = _some_activation(kernel.capabilities)
    q, k, v, qo, ko = _inputs((3, 0, 5), (4, 2, 6))
    with pytest.raises(JaggedShapeError, match=f"{hint}=4 is smaller than the longest"):
        kernel(q, k, v, qo, ko, causal=True, activation=act, **{hint: 4})
    kernel(q, k, v, qo, ko, causal=True, activation=act, max_q_len=5, max_k_len=6)  # exact hints are fine


@pytest.mark.parametrize("name", _cpu_kernels())
@pytest.mark.parametrize("bad", [{"window": 0}, {"window": -2}, {"block_size": 0}, {"window": 2.5}])
def test_window_and_block_must_be_positive_ints_in_every_kernel(name, bad):
    """Item 22: window=0 gave zeros in three kernels and a ValueError in cpu; one rule now: an int >= 1."""
    kernel = gemzoo.registry.get("attention", name)
    q, k, v, qo, _ = _inputs()
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an int >= 1"):
        kernel(q, k, v, qo, activation=_some_activation(kernel.capabilities), **bad)


@pytest.mark.parametrize("name", _cpu_kernels())
def test_options_outside_capabilities_are_rejected_by_every_kernel(name):
    """Item 22: flex computed softmax whatever activation it was given; jfa's CPU fallback accepted block_size
    and silu, neither of which jfa declares. Item 11: the error names registered kernels that can serve."""
    kernel = gemzoo.registry.get("attention", name)
    caps = kernel.capabilities
    q, k, v, qo, _ = _inputs()
    requests = [{"activation": a, "norm": 4.0} for a in ("silu", "gelu", "relu") if a not in caps.activations]
    requests += [{"activation": "softmax"}] if "softmax" not in caps.activations else []
    requests += [{"block_size": 2}] if not caps.block else []
    requests += [{"window": 2}] if not caps.window else []
    requests += [{"rope_theta": 10000.0}] if not caps.rotary else []
    act = _some_activation(caps)
    for req in requests:
        kw = {"activation": act, **req}
        with pytest.raises(PluginError, match=f"attention kernel {name!r} does not support") as exc:
            kernel(q, k, v, qo, **kw)
        named = set(str(exc.value).split("can serve this call: ")[1].rstrip(".").split(", ")) - {"(none)"}
        assert named <= set(gemzoo.registry.names("attention")), exc.value
        for other in named:  # each kernel it names really serves the call
            assert gemzoo.registry.get("attention", other)(q, k, v, qo, **kw).shape == (8, 2, 8)


def test_flex_rejects_pointwise_activations():
    flex = gemzoo.registry.get("attention", "flex")
    q, k, v, qo, _ = _inputs()
    with pytest.raises(PluginError, match=r"'flex' does not support activation='silu'"):
        flex(q, k, v, qo, activation="silu", norm=4.0)


def test_flex_is_never_traced_into_an_enclosing_compiled_graph():
    """run.compile's block graphs break around flex: traced inside them, its block mask and kernel were inlined
    into a dynamic-shape graph (the compiled gem-bench flex,bf16 row: 29.6 against 85.3 samples/s eager)."""
    from torch._dynamo.testing import CompileCounter

    flex = gemzoo.registry.get("attention", "flex")
    q, k, v, qo, _ = _inputs()
    counter = CompileCounter()

    def block(q, k, v):
        return flex(q * 2.0, k, v, qo) + 1.0

    out = torch.compile(block, backend=counter)(q, k, v)  # a new function: compiled afresh, no reset needed
    torch.testing.assert_close(out, block(q, k, v))
    assert counter.frame_count >= 1  # the block itself compiled ...
    assert counter.op_count <= 4  # ... around the call: the mul, the add, and no flex or block-mask op


def test_jfa_fallback_rejects_what_jfa_does_not_declare():
    if "jfa" not in gemzoo.registry.names("attention"):
        pytest.skip("gemzoo-jfa is not installed")
    jfa = gemzoo.registry.get("attention", "jfa")
    q, k, v, qo, _ = _inputs()
    with pytest.raises(PluginError, match="'jfa' does not support block_size"):
        jfa(q, k, v, qo, block_size=2)
    with pytest.raises(PluginError, match="'jfa' does not support activation='silu'"):
        jfa(q, k, v, qo, activation="silu", norm=2.0)


def test_norm_only_with_pointwise_activations():
    ref = gemzoo.registry.get("attention", "reference")
    q, k, v, qo, _ = _inputs()
    with pytest.raises(ValueError, match="norm divides pointwise activations only"):
        ref(q, k, v, qo, norm=4.0)


def test_strided_offsets_are_read_correctly():
    """Valid offsets given as a strided view are validated, then made contiguous for the kernel."""
    q, k, v, qo, _ = _inputs((3, 2, 5))
    strided = torch.stack([qo, torch.zeros_like(qo)], 1).reshape(-1)[::2]
    assert not strided.is_contiguous()
    for name in _softmax_kernels():
        kernel = gemzoo.registry.get("attention", name)
        torch.testing.assert_close(kernel(q, k, v, strided), kernel(q, k, v, qo))


# -- item 13: NaN stays in its own sequence; only rows with no allowed key are zeroed ----------------------

@pytest.mark.parametrize("name", _softmax_kernels())
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [True, False])
def test_nan_stays_in_its_sequence(name, which, causal):
    """A NaN query row came back as 0 from reference, cpu, sdpa-padded and jfa-on-CPU; flex spread a NaN
    in v into other sequences. Now the rows that see the NaN are NaN and nothing else changes."""
    kernel = gemzoo.registry.get("attention", name)
    q, k, v, qo, _ = _inputs((4, 0, 5, 3), seed=1)
    clean = kernel(q, k, v, qo, causal=causal)
    {"q": q, "k": k, "v": v}[which][5, 0, 0] = float("nan")  # sequence 2, position 1, head 0
    out = kernel(q, k, v, qo, causal=causal)
    sees = {"q": [5], "k": [5, 6, 7, 8] if causal else [4, 5, 6, 7, 8], "v": [5, 6, 7, 8] if causal else
            [4, 5, 6, 7, 8]}[which]
    assert torch.isnan(out[sees, 0]).any(-1).all(), f"{name}: rows {sees} see the NaN but are not NaN"
    others = torch.tensor([r not in range(4, 9) for r in range(out.shape[0])])
    assert torch.isfinite(out[others]).all(), f"{name}: the NaN reached another sequence"
    torch.testing.assert_close(out[others], clean[others], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", _cpu_kernels())
def test_rows_without_keys_are_zero_even_with_nan(name):
    """Causal with Lq > Lk: the first Lq - Lk queries have no allowed key and give exactly 0."""
    kernel = gemzoo.registry.get("attention", name)
    if not kernel.capabilities.asymmetric:
        pytest.skip(f"{name} does not serve Lq != Lk")
    act = _some_activation(kernel.capabilities)
    q, k, v, qo, ko = _inputs((4, 3), (2, 3), seed=2)
    v[0, 0, 0] = float("nan")  # sequence 0's first key
    out = kernel(q, k, v, qo, ko, causal=True, activation=act, norm=None if act == "softmax" else 4.0)
    assert (out[:2] == 0).all(), f"{name}: rows with no allowed key are {out[:2, 0]}"
    assert torch.isnan(out[2:4, 0]).any(-1).all() and torch.isfinite(out[4:]).all()


# -- item 23: bf16 backward uses the fp32 output ------------------------------------------------------------

@pytest.mark.parametrize("name", ["cpu", "sdpa-padded"])
def test_bf16_backward_uses_the_fp32_output(name):
    """rowsum(dO * O) from the bf16-rounded O put dk off by 1.7-2.5e-2 against about 2e-3 with fp32 O."""
    from gemzoo.attention import reference_attention

    kernel = gemzoo.registry.get("attention", name)
    errs = []
    for seed in range(3):
        q, k, v, qo, _ = _inputs((7, 12, 3, 9), heads=2, dim=16, seed=seed)
        q, k, v = (t.bfloat16() for t in (q, k, v))
        grad = torch.randn(q.shape[0], 2, 16, generator=torch.Generator().manual_seed(seed)).bfloat16()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kernel(*leaves, qo).backward(grad)
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        reference_attention(*ref, qo).backward(grad.double())
        dk, dk_ref = leaves[1].grad.double(), ref[1].grad
        floor = float((dk_ref.bfloat16().double() - dk_ref).norm() / dk_ref.norm())  # rounding dk to bf16
        errs.append(float((dk - dk_ref).norm() / dk_ref.norm()) / floor)
    # fp32 O: dk is as close as its own bf16 rounding allows (ratio ~1.02); bf16 O gave 1.3-1.7x that
    assert max(errs) < 1.2, f"{name}: bf16 dk error / bf16 rounding floor = {errs}"


# -- item 12: a kernel that returns the wrong thing is named at its first call ---------------------------------

@pytest.mark.parametrize("bad,what", [
    (lambda q, k, v, qo, ko=None, **kw: None, "a NoneType"),
    (lambda q, k, v, qo, ko=None, **kw: q[:-1], "shape (7, 2, 8)"),
    (lambda q, k, v, qo, ko=None, **kw: q.double(), "torch.float64"),
])
def test_wrong_kernel_output_names_the_plugin(fresh_registry, bad, what):
    from gemzoo.attention import FunctionKernel, JaggedAttention
    from gemzoo.interfaces.attention import AttentionCapabilities, AttentionRequest

    kernel = FunctionKernel(bad, AttentionCapabilities())
    fresh_registry.register("attention", "bad-output", kernel, distribution="gemzoo-bad-output")
    site = JaggedAttention(AttentionRequest())
    site.set_kernel("bad-output", kernel)
    q, k, v, qo, _ = _inputs((3, 0, 5))
    with pytest.raises(PluginError, match=r"'bad-output' \(plugin .* of distribution 'gemzoo-bad-output'\) "
                                          r"returned .*\[Tq, H, Dv\] = \(8, 2, 8\)") as exc:
        site(q, k, v, qo)
    assert what in str(exc.value)


def test_good_kernel_output_is_checked_once():
    from gemzoo.attention import JaggedAttention
    from gemzoo.interfaces.attention import AttentionRequest

    site = JaggedAttention(AttentionRequest())
    q, k, v, qo, _ = _inputs((3, 0, 5))
    site(q, k, v, qo)
    assert site._output_checked


def _relative_bias_inputs():
    from gemzoo.interfaces.attention import RelativeAttentionBias

    torch.manual_seed(0)
    off = lengths_to_offsets(torch.tensor([5, 0, 9, 3]))
    q, k, v = (torch.randn(17, 2, 8) for _ in range(3))
    times = torch.randint(0, 10 ** 6, (17,))
    rb = RelativeAttentionBias(torch.randn(6, requires_grad=True), torch.randn(40, requires_grad=True),
                               times + 77, times)
    return q, k, v, off, rb


@pytest.mark.parametrize("name", ["cpu", "reference", "sdpa-padded"])
def test_site_passes_relative_bias_or_materialises_it(name):
    """A site passes a RelativeAttentionBias to a kernel that declares relative_bias, and to one that declares
    only bias (sdpa-padded) the padded [B, 1, Lq, Lk] bias it materialises; output and the tables' gradients
    match the reference either way."""
    from gemzoo.attention import JaggedAttention, site_missing
    from gemzoo.interfaces.attention import AttentionRequest

    q, k, v, off, rb = _relative_bias_inputs()
    req = AttentionRequest(activation="silu", relative_bias=True)
    site = JaggedAttention(req, norm=9.0, scale=1.0)
    kernel = gemzoo.registry.get("attention", name)
    assert not site_missing(kernel.capabilities, req)
    site.set_kernel(name, kernel)
    out = site(q, k, v, off, relative_bias=rb)
    grads = torch.autograd.grad(out.square().sum(), [rb.positions, rb.time_weights])
    ref = gemzoo.registry.get("attention", "reference")(q, k, v, off, activation="silu", norm=9.0, scale=1.0,
                                                        relative_bias=rb)
    want = torch.autograd.grad(ref.square().sum(), [rb.positions, rb.time_weights])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_relative_bias_without_a_kernel_for_it_is_a_clear_error():
    from gemzoo.attention import JaggedAttention, site_kernels_that_serve, site_missing
    from gemzoo.interfaces.attention import AttentionRequest

    req = AttentionRequest(relative_bias=True)
    flex = gemzoo.registry.get("attention", "flex")
    assert site_missing(flex.capabilities, req) == [
        "relative_bias (fused relative position/time bias) or bias (additive attention bias)"]
    able = site_kernels_that_serve(req)
    assert {"cpu", "reference", "sdpa-padded"} <= set(able) and "flex" not in able
    q, k, v, off, rb = _relative_bias_inputs()
    site = JaggedAttention(req)
    site.set_kernel("flex", flex)
    with pytest.raises(PluginError, match="does not support relative_bias"):
        site(q, k, v, off, relative_bias=rb)


def test_a_passing_check_is_remembered_only_for_the_same_call():
    """A call identical to one that passed skips the work (same offsets tensors, unchanged); an offsets tensor
    changed in place, another shape, another option value or other capabilities are checked again in full."""
    from gemzoo.attention import checks
    from gemzoo.interfaces.attention import AttentionCapabilities

    q, k, v, q_off, k_off = _inputs((3, 0, 5), (4, 2, 6))
    caps = AttentionCapabilities(activations=frozenset({"softmax"}), asymmetric=True)
    full = []
    real = checks.check_inputs_uncached

    def counting(*a, **kw):
        full.append(1)
        return real(*a, **kw)

    checks.check_inputs_uncached = counting
    try:
        for _ in range(3):
            assert checks.check_inputs(q, k, v, q_off, k_off, capabilities=caps) == (q_off, k_off)
        assert len(full) == 1
        with pytest.raises(PluginError, match="window"):  # another option value: checked (and refused)
            checks.check_inputs(q, k, v, q_off, k_off, capabilities=caps, window=4)
        with pytest.raises(PluginError, match="window"):  # failures are never remembered
            checks.check_inputs(q, k, v, q_off, k_off, capabilities=caps, window=4)
        other = AttentionCapabilities(activations=frozenset({"softmax"}), asymmetric=True)
        checks.check_inputs(q, k, v, q_off, k_off, capabilities=other)  # other capabilities
        checks.check_inputs(q[:7], k, v, q_off, k_off, capabilities=caps)  # another shape (7 rows for 8)
    except JaggedShapeError:
        pass
    finally:
        checks.check_inputs_uncached = real
    assert len(full) == 5
    k_off[2] = 99  # in place: the version changes, the offsets are validated again
    with pytest.raises(JaggedShapeError, match="non-decreasing"):
        checks.check_inputs(q, k, v, q_off, k_off, capabilities=caps)
    strided = lengths_to_offsets(torch.tensor([3, 9, 0, 9, 5]))[::2]  # a strided view: a contiguous copy, each time
    q2 = torch.randn(21, 2, 8)
    first = checks.check_inputs(q2, q2, q2, strided)
    again = checks.check_inputs(q2, q2, q2, strided)
    assert first[0] is first[1] and again[0] is again[1] and first[0].is_contiguous()
    assert torch.equal(first[0], strided) and torch.equal(again[0], strided)
