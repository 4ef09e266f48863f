"""HSTU's fused relative attention bias trains as the materialised one: a few optimizer steps of an HSTU model
on tiny synthetic jagged batches with timestamps (zero-length sequences included), fp32, once on a kernel that
computes the bias inside its tiles (``gdpa``, whose CPU path is the C++ ``cpu`` kernel; ``jfa`` for softmax
attention) and once on the ``reference`` kernel given the bias materialised as a padded ``[B, 1, L, L]`` tensor
(``materialize_relative_bias``, as a site serves a kernel that declares only ``bias``). The losses of every step
agree within 1e-4 relative and both bias tables' gradients of every block within 1e-4. The GPU variant runs
gdpa's and jfa's Triton kernels (skipped without CUDA); ``materialize_relative_bias`` itself is checked
against the per-sequence definition and on the meta device (it reads nothing back from the device)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gemzoo
import gemzoo.attention.sites as sites_mod
from gemzoo.attention import (
    FunctionKernel,
    attention_sites,
    materialize_relative_bias,
    reference_attention,
    relative_bias_block,
)
from gemzoo.attention.semantics import REFERENCE_CAPABILITIES
from gemzoo.data.batch import SeqBatch
from gemzoo.interfaces.attention import RelativeAttentionBias
from gemzoo.jagged import lengths_to_offsets

STEPS = 4
NUM_ITEMS, MAX_LEN = 30, 12
LENGTHS = [[0, 7, 1, 12, 0, 5], [3, 0, 0, 12, 9, 2, 0], [12, 11, 0, 4, 1, 6]]  # zero first, inside and last
# Gradients agree to fp32 rounding at the first step (a few 1e-7); each model then trains on its own, and Adam,
# which scales every update to about lr whatever the gradient's size, turns rounding-level differences in
# near-zero gradient entries into lr-sized parameter differences: by step 2 jfa's softmax position_time case
# measured 5.3e-5 on a 2-core x86 host (1.2e-6 on another). A wrong bias is off by order one.
LOSS_RTOL, GRAD_RTOL = 1e-4, 1e-4

# the reference oracle serving the bias only materialised: the site builds the padded tensor for it
MATERIALISED = FunctionKernel(reference_attention, dataclasses.replace(REFERENCE_CAPABILITIES, relative_bias=False),
                              "reference, relative bias materialised as bias=")


def _batch(gen: torch.Generator, lengths: list[int], device) -> SeqBatch:
    """Items, next-item targets (a few -1) and int64 timestamps with gaps from 0 s to about a year, so the time
    buckets spread from 0 to past the last bucket."""
    offsets = lengths_to_offsets(torch.tensor(lengths))
    t = int(offsets[-1])
    items = torch.randint(NUM_ITEMS, (t,), generator=gen)
    targets = torch.randint(NUM_ITEMS, (t,), generator=gen)
    targets[torch.rand(t, generator=gen) < 0.2] = -1
    gaps = torch.exp(torch.rand(t + 1, generator=gen) * 17.3).long()
    gaps[torch.rand(t + 1, generator=gen) < 0.15] = 0  # same-second events: bucket 0
    stamps = 1_000_000_000 + gaps.cumsum(0)
    times, next_times = stamps[:-1].clone(), stamps[1:].clone()
    return SeqBatch(items, offsets, targets, times, next_times).to(device)


def _model(relative_bias: str, device, activation: str):
    spec = gemzoo.registry.get("model", "hstu")
    cfg = spec.config_cls(embedding_dim=16, num_layers=2, num_heads=2, num_negatives=8, dropout=0.0,
                          relative_bias=relative_bias, positions="from_start", init="reference",
                          norm_affine=False, uvqk_bias=False, attention_norm=13.0)
    with torch.device("meta"):
        model = spec.build(cfg, {"num_items": NUM_ITEMS, "max_len": MAX_LEN, "timestamps": True})
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():  # the tables start at std 0.02; larger values make their effect on the loss visible
        for block in model.blocks:
            for table in block.rel_bias.parameters():
                table.normal_(0.0, 0.5)
    if activation == "softmax":  # the same blocks with softmax attention (jfa serves softmax only)
        for site in attention_sites(model).values():
            site.request = site.request.replace(activation="softmax")
            site.options.pop("norm")
    return model


def _train(relative_bias: str, kernel_name: str, kernel, device, activation: str = "silu"):
    """Per step: the loss and every bias table's gradient (block index, table name) -> tensor."""
    model = _model(relative_bias, device, activation)
    for site in attention_sites(model).values():
        site.set_kernel(kernel_name, kernel)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for step in range(STEPS):
        batch = _batch(gen, LENGTHS[step % len(LENGTHS)], device)
        torch.manual_seed(100 + step)  # the same negatives for both kernels
        loss = model(batch).loss
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({(b, name): p.grad.detach().double().cpu().clone()
                      for b, block in enumerate(model.blocks) for name, p in block.rel_bias.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _compare(fused, materialised, loss_rtol: float, grad_rtol: float) -> None:
    (f_losses, f_grads), (m_losses, m_grads) = fused, materialised
    assert len(f_losses) == len(m_losses) == STEPS
    assert f_losses == pytest.approx(m_losses, rel=loss_rtol), (f_losses, m_losses)
    for step, (fg, mg) in enumerate(zip(f_grads, m_grads, strict=True)):
        assert fg.keys() == mg.keys()
        for key in fg:
            assert mg[key].norm() > 0, f"step {step}, {key}: no gradient reached the table"
            err = _rel(fg[key], mg[key])
            assert err <= grad_rtol, f"step {step}, block {key[0]} {key[1]}: gradient relative error {err:.2e}"


def _count_materialised(monkeypatch) -> list:
    calls = []
    real = sites_mod.materialize_relative_bias

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(sites_mod, "materialize_relative_bias", counting)
    return calls


@pytest.mark.parametrize("relative_bias", ["position", "position_time"])
def test_gdpa_fused_bias_trains_as_the_materialised_reference(relative_bias, monkeypatch):
    calls = _count_materialised(monkeypatch)
    gdpa = gemzoo.registry.get("attention", "gdpa")
    assert gdpa.capabilities.relative_bias and gdpa.cpu_fallback == "cpu"
    fused = _train(relative_bias, "gdpa", gdpa, "cpu")
    assert not calls, "gdpa was given a materialised bias; it must compute the bias in its tiles"
    materialised = _train(relative_bias, "reference-materialised", MATERIALISED, "cpu")
    assert len(calls) == 2 * STEPS  # both blocks, every step
    _compare(fused, materialised, LOSS_RTOL, GRAD_RTOL)


@pytest.mark.parametrize("relative_bias", ["position", "position_time"])
def test_jfa_fused_bias_trains_as_the_materialised_reference(relative_bias, monkeypatch):
    jfa = gemzoo.registry.get("attention", "jfa")
    if not jfa.capabilities.relative_bias:
        pytest.skip("jfa declares no relative_bias")
    calls = _count_materialised(monkeypatch)
    fused = _train(relative_bias, "jfa", jfa, "cpu", activation="softmax")
    assert not calls
    materialised = _train(relative_bias, "reference-materialised", MATERIALISED, "cpu", activation="softmax")
    _compare(fused, materialised, LOSS_RTOL, GRAD_RTOL)


def test_a_wrong_bias_is_caught():
    """The comparison can fail: a kernel whose time term is off by one bucket trains differently."""
    def shifted(q, k, v, q_offsets, k_offsets=None, *, relative_bias=None, **kw):
        tw = relative_bias.time_weights
        rb = dataclasses.replace(relative_bias, time_weights=torch.cat([tw[1:], tw[-1:]]))
        return reference_attention(q, k, v, q_offsets, k_offsets, relative_bias=rb, **kw)

    wrong = FunctionKernel(shifted, REFERENCE_CAPABILITIES, "a bias one bucket off")
    with pytest.raises(AssertionError):
        _compare(_train("position_time", "wrong", wrong, "cpu"),
                 _train("position_time", "reference-materialised", MATERIALISED, "cpu"), LOSS_RTOL, GRAD_RTOL)


# On the GPU, fp32 under torch's default matmul precision ("highest") multiplies in full fp32 in the Triton
# kernels as in torch's matmuls, so the CPU bounds hold. Under "high" (TF32, about 1e-3 relative per product) the
# bound is that of the kernels' own GPU tests: measured on an H200 (2026-12-04), the position table's gradient of
# gdpa at step 1 was 5.3e-3 off the materialised reference, the losses within 5e-3. A wrong bias is off by order one.
GPU_RTOL = {"highest": (LOSS_RTOL, GRAD_RTOL), "high": (5e-3, 1e-2)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", sorted(GPU_RTOL))
@pytest.mark.parametrize("kernel_name,activation", [("gdpa", "silu"), ("jfa", "softmax")])
@pytest.mark.parametrize("relative_bias", ["position", "position_time"])
def test_fused_bias_trains_as_the_materialised_reference_on_gpu(kernel_name, activation, relative_bias, precision,
                                                               monkeypatch):
    calls = _count_materialised(monkeypatch)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        fused = _train(relative_bias, kernel_name, gemzoo.registry.get("attention", kernel_name), "cuda", activation)
        assert not calls
        materialised = _train(relative_bias, "reference-materialised", MATERIALISED, "cuda", activation)
    finally:
        torch.set_float32_matmul_precision(before)
    _compare(fused, materialised, *GPU_RTOL[precision])


# -- materialize_relative_bias ------------------------------------------------------------------------------
def _bias(gen, q_lens, k_lens, timed, n_pos=9, n_buckets=128, device="cpu"):
    q_off, k_off = lengths_to_offsets(torch.tensor(q_lens)), lengths_to_offsets(torch.tensor(k_lens))
    tq, tk = int(q_off[-1]), int(k_off[-1])
    tw = q_times = k_times = None
    if timed:
        tw = torch.randn(n_buckets + 1, generator=gen, dtype=torch.float64)
        q_times = 10**9 + torch.exp(torch.rand(tq, generator=gen) * 17).long()
        k_times = 10**9 + torch.exp(torch.rand(tk, generator=gen) * 17).long()
    pos = torch.randn(n_pos, generator=gen, dtype=torch.float64)
    return RelativeAttentionBias(pos, tw, q_times, k_times), q_off, k_off


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("q_lens,k_lens", [([0, 5, 1, 0, 11], [0, 5, 1, 0, 11]), ([3, 0, 4], [5, 2, 4]),
                                           ([0, 0], [0, 0]), ([2, 0], [0, 3])])
def test_materialised_bias_is_the_per_sequence_definition_padded(q_lens, k_lens, timed):
    gen = torch.Generator().manual_seed(len(q_lens) + sum(k_lens))
    rb, q_off, k_off = _bias(gen, q_lens, k_lens, timed)
    lq, lk = max(q_lens) + 2, max(k_lens) + 1  # longer than the longest: padding everywhere
    got = materialize_relative_bias(rb, q_off, k_off, lq, lk)
    assert got.shape == (len(q_lens), 1, lq, lk) and got.dtype == torch.float64
    want = torch.zeros_like(got)
    for b in range(len(q_lens)):
        block = relative_bias_block(rb, int(q_off[b]), q_lens[b], int(k_off[b]), k_lens[b])
        want[b, 0, :q_lens[b], :k_lens[b]] = block
    assert torch.equal(got, want)


def test_materialised_bias_gradients_reach_only_the_sequences_slots():
    gen = torch.Generator().manual_seed(3)
    rb, q_off, k_off = _bias(gen, [4, 0, 6], [4, 0, 6], True)
    rb = dataclasses.replace(rb, positions=rb.positions.requires_grad_(), time_weights=rb.time_weights.requires_grad_())
    upstream = torch.randn(3, 1, 7, 8, generator=gen, dtype=torch.float64)
    (materialize_relative_bias(rb, q_off, k_off, 7, 8) * upstream).sum().backward()
    got = rb.positions.grad.clone(), rb.time_weights.grad.clone()
    rb.positions.grad = rb.time_weights.grad = None
    total = sum((relative_bias_block(rb, int(q_off[b]), n, int(k_off[b]), n) * upstream[b, 0, :n, :n]).sum()
                for b, n in enumerate([4, 0, 6]))
    total.backward()
    torch.testing.assert_close(got, (rb.positions.grad, rb.time_weights.grad), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("timed", [False, True])
def test_materialised_bias_reads_nothing_back_from_the_device(timed):
    """On the meta device a tensor has no data, so any read of a device value (``tolist``, ``int``, ``item``)
    raises; the padded bias is built from shapes alone."""
    gen = torch.Generator().manual_seed(5)
    rb, q_off, k_off = _bias(gen, [3, 0, 5], [3, 0, 5], timed)
    meta = RelativeAttentionBias(*(None if t is None else t.to("meta") for t in
                                   (rb.positions, rb.time_weights, rb.q_times, rb.k_times)))
    out = materialize_relative_bias(meta, q_off.to("meta"), k_off.to("meta"), 5, 5)
    assert out.device.type == "meta" and out.shape == (3, 1, 5, 5)
