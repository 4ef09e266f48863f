"""Grouped-query and multi-query attention (k/v with fewer heads than q): the contract, the reference, the C++
``cpu`` kernel (forward and gradients), the torch baselines, the errors, and the models' ``num_kv_heads``."""

from __future__ import annotations

import pytest
import torch

import gemzoo
from gemzoo.api import (
    AttentionCapabilities,
    AttentionRequest,
    FunctionKernel,
    JaggedAttention,
    PluginError,
    RelativeAttentionBias,
    check_inputs,
    lengths_to_offsets,
    reference_attention,
    repeat_kv,
)
from gemzoo.attention import site_missing
from gemzoo.errors import ConfigError
from gemzoo.testing.attention import AttentionCase, check_attention, grouped_query_errors


def _qkv(q_lens, k_lens=None, heads=4, kv_heads=2, d=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ql = torch.tensor(q_lens)
    kl = ql if k_lens is None else torch.tensor(k_lens)
    q = torch.randn(int(ql.sum()), heads, d, generator=gen, dtype=dtype)
    k = torch.randn(int(kl.sum()), kv_heads, d, generator=gen, dtype=dtype)
    v = torch.randn(int(kl.sum()), kv_heads, d + 3, generator=gen, dtype=dtype)
    return q, k, v, lengths_to_offsets(ql), None if k_lens is None else lengths_to_offsets(kl)


# -- repeat_kv and the reference ------------------------------------------------------------------------------

def test_repeat_kv_maps_query_head_to_its_group():
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    r = repeat_kv(x, 2)
    assert r.shape == (2, 6, 4)
    for h in range(6):
        assert torch.equal(r[:, h], x[:, h // 2])
    assert repeat_kv(x, 1) is x
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n_rep must be an int >= 1"):
            repeat_kv(x, bad)
    with pytest.raises(ValueError, match=r"\[T, Hkv, D\]"):
        repeat_kv(x[0], 2)


def test_repeat_kv_gradient_sums_over_the_group():
    x = torch.randn(5, 2, 3, requires_grad=True)
    g = torch.randn(5, 6, 3)
    repeat_kv(x, 3).backward(g)
    torch.testing.assert_close(x.grad, g.view(5, 2, 3, 3).sum(2))


@pytest.mark.parametrize("kw", [dict(), dict(causal=False), dict(activation="silu", norm=8.0, window=4),
                                dict(block_size=3, rope_theta=100.0)], ids=str)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_reference_equals_mha_on_repeated_kv(kw, kv_heads):
    q, k, v, qo, ko = _qkv([5, 0, 9, 3], [7, 2, 9, 0], kv_heads=kv_heads)
    got = reference_attention(q, k, v, qo, ko, **kw)
    want = reference_attention(q, repeat_kv(k, 4 // kv_heads), repeat_kv(v, 4 // kv_heads), qo, ko, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reference_with_relative_bias_equals_mha_on_repeated_kv():
    q, k, v, qo, _ = _qkv([6, 0, 11])
    rb = RelativeAttentionBias(torch.randn(8, dtype=torch.float64))
    got = reference_attention(q, k, v, qo, relative_bias=rb)
    torch.testing.assert_close(got, reference_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), qo, relative_bias=rb))


# -- the cpu kernel (C++) and the torch baselines -----------------------------------------------------------------

CPU_CASES = {
    "gqa4x2-causal": dict(q_lens=[5, 0, 70, 16, 130]),
    "mqa4x1-full-asym": dict(q_lens=[5, 0, 37, 16], k_lens=[9, 4, 90, 0], kv_heads=1, causal=False),
    "gqa6x3-silu-window": dict(q_lens=[5, 0, 70], heads=6, kv_heads=3, activation="silu", norm=16.0, window=9),
    "gqa8x2-block": dict(q_lens=[9, 4, 100], heads=8, block_size=7),
    "gqa4x2-d50": dict(q_lens=[5, 0, 37], head_dim=50),
    "mqa4x1-d256": dict(q_lens=[5, 0, 20], kv_heads=1, head_dim=256),
    "gqa4x2-relative-bias": dict(q_lens=[5, 0, 70, 16], relative_bias=True, activation="silu", norm=16.0),
    "gqa4x2-empty-sequences": dict(q_lens=[0, 0, 7, 0], k_lens=[3, 0, 5, 0]),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_kernel_forward_and_gradients(name):
    cpu = gemzoo.registry.get("attention", "cpu")
    assert cpu.capabilities.grouped_kv
    errors = grouped_query_errors(cpu, **CPU_CASES[name])
    for key in [k for k in errors if not k.endswith("_finite")]:
        assert errors[f"{key}_finite"], f"{name}: {key} has NaN/Inf"
        assert errors[key] < 1e-5, f"{name}: {key} relative error {errors[key]:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_half_inputs(dtype):
    errors = grouped_query_errors(gemzoo.registry.get("attention", "cpu"), [5, 0, 37, 16], dtype=dtype)
    assert max(e for k, e in errors.items() if not k.endswith("_finite")) < 1e-2, errors


@pytest.mark.parametrize("name", ["sdpa-padded", "flex"])
def test_torch_baselines_serve_grouped_kv(name):
    kernel = gemzoo.registry.get("attention", name)
    assert kernel.capabilities.grouped_kv
    q, k, v, qo, ko = _qkv([5, 0, 9, 3], [7, 2, 9, 0], kv_heads=1, dtype=torch.float32)
    with torch.no_grad():
        got = kernel(q, k, v, qo, ko, causal=False)
    torch.testing.assert_close(got, reference_attention(q, k, v, qo, ko, causal=False), rtol=1e-5, atol=1e-5)


# -- errors ---------------------------------------------------------------------------------------------------------

def test_head_counts_that_do_not_divide_name_both_and_the_fix():
    q, k, v, qo, _ = _qkv([4, 3], heads=4, kv_heads=3)
    for name in ("reference", "cpu", "sdpa-padded"):
        with pytest.raises(PluginError, match=r"q with 4 heads and k/v with 3.*a divisor of that count \(1, 2, 4\)"):
            gemzoo.registry.get("attention", name)(q.float(), k.float(), v.float(), qo)
    q, k, v, qo, _ = _qkv([4, 3], heads=2, kv_heads=4)
    with pytest.raises(PluginError, match=r"q with 2 heads and k/v with 4"):
        reference_attention(q, k, v, qo)


def _plain_mha(q, k, v, q_offsets, k_offsets=None, **kw):
    """A multi-head-only kernel: checks its own capabilities (no grouped_kv), then runs the reference."""
    check_inputs(q, k, v, q_offsets, k_offsets, capabilities=PLAIN.capabilities, kernel="plain-mha", **kw)
    return reference_attention(q, k, v, q_offsets, k_offsets, **kw)


PLAIN = FunctionKernel(_plain_mha, AttentionCapabilities(dtypes=frozenset({torch.float64})))


def test_a_kernel_without_grouped_kv_names_the_kernels_that_serve():
    plain = PLAIN
    q, k, v, qo, _ = _qkv([4, 3])
    with pytest.raises(PluginError, match=r"does not support grouped_kv.*can serve this call: .*reference"):
        plain(q, k, v, qo)
    # the shared conformance suite's "unsupported" check covers it for every kernel that does not declare it
    errors = check_attention(plain, AttentionCase(check="unsupported"), dtype=torch.float64)
    assert errors["unsupported_options"] >= 1


def test_site_request_asks_for_grouped_kv():
    req = AttentionRequest(grouped_kv=True)
    assert "grouped_kv (k/v with fewer heads than q)" in site_missing(AttentionCapabilities(), req)
    assert not site_missing(AttentionCapabilities(grouped_kv=True), req)
    site = JaggedAttention(req)
    q, k, v, qo, _ = _qkv([4, 3], dtype=torch.float32)
    torch.testing.assert_close(site(q, k, v, qo), reference_attention(q, k, v, qo))


# -- models ---------------------------------------------------------------------------------------------------------

def _model(family, **overrides):
    from gemzoo.data.synthetic import SyntheticGemConfig, SyntheticGemDataset

    spec = gemzoo.registry.get("model", family)
    base = {"gem": dict(d_model=32, num_layers=1, num_heads=4, embedding_dim=16, mlp_dims=[16]),
            "hstu": dict(embedding_dim=16, num_layers=1, num_heads=4, num_negatives=8, dropout=0.0),
            "sasrec": dict(embedding_dim=16, num_layers=1, num_heads=4, num_negatives=8, dropout=0.0)}[family]
    if family == "gem":
        info = SyntheticGemDataset(SyntheticGemConfig(batch_size=4, max_len=12, median_len=6, min_len=0,
                                                      max_candidates=3, num_items=50, num_clusters=3,
                                                      num_sparse_tables=0), seed=0).info
    else:
        info = {"task": "retrieval", "num_items": 50, "max_len": 12}
    with torch.device("meta"):
        model = spec.build(spec.config_cls(**{**base, **overrides}), info)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def _retrieval_batch():
    from gemzoo.data.batch import SeqBatch

    lengths = torch.tensor([5, 0, 9, 3])
    offsets = lengths_to_offsets(lengths)
    items = torch.randint(1, 50, (int(lengths.sum()),))
    return SeqBatch(items=items, offsets=offsets, targets=torch.randint(1, 50, (int(lengths.sum()),)))


@pytest.mark.parametrize("family,extra", [("gem", {}), ("hstu", {}), ("sasrec", {}),
                                          ("sasrec", {"block": "reference"})], ids=str)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_models_with_num_kv_heads(family, extra, kv_heads):
    from gemzoo.attention import attention_sites

    model = _model(family, num_kv_heads=kv_heads, **extra)
    mha = _model(family, **extra)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in mha.parameters())
    sites = attention_sites(model)
    assert sites and all(s.request.grouped_kv for s in sites.values())
    assert not any(s.request.grouped_kv for s in attention_sites(mha).values())
    for s in sites.values():
        s.set_kernel("cpu", gemzoo.registry.get("attention", "cpu"))
    if family == "gem":
        from gemzoo.data.synthetic import SyntheticGemConfig, SyntheticGemDataset

        ds = SyntheticGemDataset(SyntheticGemConfig(batch_size=4, max_len=12, median_len=6, min_len=0,
                                                    max_candidates=3, num_items=50, num_clusters=3,
                                                    num_sparse_tables=0), seed=0)
        batch = ds.train_batch(0)
    else:
        batch = _retrieval_batch()
    loss = model(batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is None or torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("family", ["gem", "hstu", "sasrec"])
def test_num_kv_heads_that_does_not_divide_is_a_config_error(family):
    with pytest.raises(ConfigError, match=r"num_kv_heads=3 does not divide num_heads=4.*1, 2, 4"):
        _model(family, num_kv_heads=3)
    with pytest.raises(ConfigError, match=r"num_kv_heads must be an int >= 0"):
        _model(family, num_kv_heads=-1)
    assert sum(p.numel() for p in _model(family, num_kv_heads=4).parameters()) == \
        sum(p.numel() for p in _model(family).parameters())


@pytest.mark.parametrize("family", ["gem", "hstu", "sasrec"])
def test_tensor_parallel_plans_split_grouped_kv_by_heads(family):
    from gemzoo.distributed.dense import from_rank_rows, tensor_parallel_plans, to_rank_rows

    model = _model(family, num_kv_heads=2)
    plans = tensor_parallel_plans(model, 2)  # 4 heads over 2 k/v heads: 2 ranks keep one group each
    fused = [(unit, name, parts) for _, unit, plan in plans for name, (kind, parts) in plan.items()
             if kind == "colwise" and isinstance(parts, tuple)]
    assert fused  # the fused q | k | v projection (hstu: u | v | q | k), parts of their own sizes
    for unit, name, parts in fused:
        w = unit.get_submodule(name).weight
        assert sum(parts) == w.shape[0]
        torch.testing.assert_close(from_rank_rows(to_rank_rows(w, parts, 2), parts, 2), w)
    with pytest.raises(ConfigError, match=r"tp=2 does not divide the attention heads: .* num_kv_heads=1"):
        tensor_parallel_plans(_model(family, num_kv_heads=1), 2)


def _gqa_blocks_under_tp(rank: int, port: int, path: str) -> None:
    """On 2 gloo ranks: each model's GQA block (4 query heads over 2 k/v heads) under its tp_plan against the
    whole block: output, input gradient and every parameter's gradient (made whole, in the model's row order)."""
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from gemzoo.distributed.dense import from_rank_rows, mark_rank_rows, parallelize_blocks, rank_rows
    from gemzoo.models.common import TransformerBlock
    from gemzoo.models.hstu import HSTUBlock
    from gemzoo.models.sasrec import SASRecReferenceBlock
    from gemzoo.testing.comms import rank_env

    rank_env(rank, 2, port)
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    offsets = torch.tensor([0, 3, 7])
    softmax = AttentionRequest(activation="softmax", causal=True)
    makers = {
        "transformer": lambda: TransformerBlock(16, 4, 4, 32, request=softmax, num_kv_heads=2),
        "sasrec": lambda: SASRecReferenceBlock(16, 4, 4, 32, request=softmax, dropout=0.0, attn_dropout=0.0,
                                               affine=True, num_kv_heads=2),
        "hstu": lambda: HSTUBlock(16, 4, 4, 6, 8, 0.0, relative_bias="position", num_kv_heads=2),
    }
    out = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        blocks = [make() for _ in range(2)]
        for p in blocks[0].parameters():  # away from torch.empty and the init, so every gradient counts
            p.data.copy_(torch.randn_like(p) * 0.3)
        blocks[1].load_state_dict(blocks[0].state_dict())
        for b in blocks:
            site = b.attn if isinstance(b.attn, JaggedAttention) else b.attn.attn
            site.set_kernel("cpu", gemzoo.registry.get("attention", "cpu"))
        holder = torch.nn.Module()
        holder.transformer_blocks = lambda blocks=blocks: [blocks[1]]
        mark_rank_rows(parallelize_blocks(holder, mesh["tp"], 2), 2)
        x = torch.randn(7, 16, generator=torch.Generator().manual_seed(1))
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ref, got = blocks[0](xs[0], offsets, 4), blocks[1](xs[1], offsets, 4)
        ref.square().sum().backward()
        got.square().sum().backward()
        worst = 0.0
        for p, pr in zip(blocks[1].parameters(), blocks[0].parameters(), strict=True):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            g = from_rank_rows(g, *rank_rows(p)) if rank_rows(p) is not None else g
            worst = max(worst, float((g - pr.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-12)))
        out[name] = {"out": float((got - ref).detach().abs().max()), "grad": float((xs[1].grad - xs[0].grad).abs().max()),
                     "param_grads": worst, "dtensors": sum(isinstance(p, DTensor) for p in blocks[1].parameters())}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f)
    torch.distributed.barrier()  # no rank tears gloo down while its peer still talks to it (a SIGABRT otherwise)
    torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_gqa_blocks_under_tensor_parallelism_match_the_whole_block(tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    from gemzoo.testing.timeouts import hang_guard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(tmp_path / "blocks.json")
    procs = [mp.get_context("spawn").Process(target=_gqa_blocks_under_tp, args=(r, port, path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=hang_guard(300))
    assert [p.exitcode for p in procs] == [0, 0]
    results = json.loads(open(path).read())
    assert set(results) == {"transformer", "sasrec", "hstu"}
    for name, block in results.items():
        assert block["dtensors"] >= 4 and block["out"] < 1e-5 and block["grad"] < 1e-5, (name, block)
        assert block["param_grads"] < 1e-4, (name, block)
