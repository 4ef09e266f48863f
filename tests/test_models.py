"""Model families gem, hstu, sasrec: building on meta, init, precision, flops, jagged corner cases, learning."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import tomllib
import torch

import gemzoo
from gemzoo.attention import attention_sites
from gemzoo.data.batch import GemBatch, SeqBatch
from gemzoo.data.movielens import MovieLensConfig, MovieLensDataset
from gemzoo.data.synthetic import SyntheticGemConfig, SyntheticGemDataset
from gemzoo.errors import ConfigError
from gemzoo.interfaces.models import ModelOutput
from gemzoo.interfaces.precision import PrecisionConfig
from gemzoo.jagged import lengths_to_offsets
from gemzoo.models.common import binary_auc
from gemzoo.models.retrieval import RankingEvaluator
from gemzoo.testing import skip_unless_torchrec
from gemzoo.testing.pytest_plugin import registered

ROOT = Path(__file__).resolve().parents[1]
GEM_DATA = dict(batch_size=16, max_len=40, median_len=10, min_len=0, max_candidates=6, num_items=200,
                num_clusters=6, num_sparse_tables=3, sparse_table_size=40)
SMALL_MODEL = {
    "gem": dict(d_model=32, num_layers=2, num_heads=2, embedding_dim=16, mlp_dims=[32, 16]),
    "hstu": dict(embedding_dim=16, num_layers=2, num_heads=2, num_negatives=16, dropout=0.0),
    "sasrec": dict(embedding_dim=16, num_layers=2, num_heads=2, num_negatives=16, dropout=0.0),
}


def chain_ratings(path: Path, users=48, items=40, seed=0) -> None:
    """Users walk item ids upwards (with 10% random jumps): next-item prediction is learnable."""
    rng = random.Random(seed)
    lines = []
    for u in range(1, users + 1):
        start = rng.randrange(items)
        for i in range(rng.randrange(8, 20)):
            item = (start + i) % items if rng.random() > 0.1 else rng.randrange(items)
            lines.append(f"{u}::{item + 1}::{rng.randrange(1, 6)}::{1000 + 10 * i}")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def ml_dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("ml") / "ratings.dat"
    chain_ratings(path)
    return MovieLensDataset(MovieLensConfig(path=str(path), batch_size=16, max_len=16), seed=0)


@pytest.fixture(scope="module")
def gem_dataset():
    return SyntheticGemDataset(SyntheticGemConfig(**GEM_DATA), seed=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: one thread beats two fighting over a busy 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def dataset_for(family, gem_dataset, ml_dataset):
    """This module's dataset the family builds from: ranking (gem) or retrieval (hstu, sasrec); a family of
    another plugin is tried on both, on meta, and fails here if it builds from neither."""
    (spec, cfg), errors = _spec_and_cfg(family), []
    for ds in (gem_dataset, ml_dataset):
        try:
            with torch.device("meta"):
                spec.build(cfg, ds.info)
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        return ds
    pytest.fail(f"model family {family!r} builds from neither synthetic-gem nor movielens: {'; '.join(errors)}")


def _spec_and_cfg(family: str, **overrides):
    """The family's spec and a small config: SMALL_MODEL for gemzoo's own, the config class's defaults else."""
    spec = gemzoo.registry.get("model", family)
    return spec, spec.config_cls(**{**SMALL_MODEL.get(family, {}), **overrides})


def build(family: str, info: dict, seed: int = 0, **overrides):
    """The trainer's recipe: build on meta, to_empty, seed, init_weights."""
    spec, cfg = _spec_and_cfg(family, **overrides)
    with torch.device("meta"):
        model = spec.build(cfg, info)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


FAMILIES = registered("model")  # every registered family, gemzoo's and installed plugins' (timm style)


def test_builtin_families_registered():
    assert {"gem", "hstu", "sasrec"} <= set(gemzoo.registry.names("model"))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_names_its_family(family):
    assert gemzoo.registry.get("model", family).config_cls().family == family


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_build_and_init_are_deterministic(family, gem_dataset, ml_dataset):
    info = dataset_for(family, gem_dataset, ml_dataset).info
    a, b, c = build(family, info, seed=5), build(family, info, seed=5), build(family, info, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() and len(sa) > 0
    for name in sa:
        assert sa[name].device.type == "cpu" and torch.isfinite(sa[name]).all(), name
        assert torch.equal(sa[name], sb[name]), f"{name} differs between two builds with the same seed"
    changed = [n for n in sa if sa[n].numel() > 1 and not torch.equal(sa[n], sc[n])]
    assert len(changed) >= len(sa) // 3  # a different seed gives different weights


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_backward_and_api(family, gem_dataset, ml_dataset):
    ds = dataset_for(family, gem_dataset, ml_dataset)
    model = build(family, ds.info)
    batch = ds.train_batch(0)
    out = model(batch)
    assert isinstance(out, ModelOutput) and out.loss.dim() == 0 and torch.isfinite(out.loss)
    # floats, or detached 0-dim tensors (read after the step: no host sync inside it)
    assert all(isinstance(v, float) or (torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad)
               for v in out.logs.values())
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(getattr(m, "is_transformer_block", False) for m in model.modules()
               if type(m).__name__.endswith("Block"))
    assert attention_sites(model), "attention must go through JaggedAttention"
    ev = model.evaluator()
    model.eval()
    with torch.no_grad():
        for eb in ds.eval_batches(2):
            ev.update(eb)
    metrics = ev.compute()
    assert metrics and all(isinstance(v, float) for v in metrics.values())


def test_gem_attention_requests(gem_dataset):
    sites = attention_sites(build("gem", gem_dataset.info))
    assert set(sites) == {"tower.blocks.0.attn.attn", "tower.blocks.1.attn.attn", "cross.attn"}
    assert sites["tower.blocks.0.attn.attn"].request.causal and not sites["tower.blocks.0.attn.attn"].request.asymmetric
    cross = sites["cross.attn"].request
    assert not cross.causal and cross.asymmetric and cross.activation == "softmax"


def test_hstu_uses_pointwise_silu_attention_normalised_by_max_len(ml_dataset):
    sites = attention_sites(build("hstu", ml_dataset.info))
    for site in sites.values():
        assert site.request.activation == "silu" and site.request.causal
        assert site.options["norm"] == ml_dataset.info["max_len"]


def test_hstu_large_head_dims(ml_dataset):
    model = build("hstu", ml_dataset.info, num_heads=2, qk_dim=5, v_dim=7)
    block = model.blocks[0]
    assert block.uvqk.out_features == 2 * (2 * 7 + 2 * 5) and block.out.in_features == 2 * 7
    assert torch.isfinite(model(ml_dataset.train_batch(0)).loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_with_bf16_linears(family, gem_dataset, ml_dataset):
    ds = dataset_for(family, gem_dataset, ml_dataset)
    model = build(family, ds.info)
    batch = ds.train_batch(1)
    torch.manual_seed(0)  # the same sampled negatives in both forwards
    ref = model(batch).loss.detach()
    policy = gemzoo.registry.get("precision", "bf16")
    policy.apply(model, PrecisionConfig(keep=["head.*"]))
    assert any(getattr(m, "precision", None) == "bf16" for m in model.modules())
    torch.manual_seed(0)
    out = model(batch)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert abs(float(out.loss.detach()) - float(ref)) < 0.05 * abs(float(ref)) + 1e-3
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _gem_batch_with_lengths(ds: SyntheticGemDataset, lengths: list[int]) -> GemBatch:
    b = ds.train_batch(2)
    lengths_t = torch.tensor(lengths)
    items = torch.randint(ds.cfg.num_items, (int(lengths_t.sum()),), generator=torch.Generator().manual_seed(0))
    n = len(lengths)
    keep_cand = b.cand_offsets[n]
    f = len(b.sparse_keys)
    per_key = b.sparse_lengths.view(f, -1)[:, :n]
    vals = torch.cat([b.sparse_values[int(b.sparse_lengths.view(f, -1)[:k].sum()):][: int(per_key[k].sum())]
                      for k in range(f)])
    return dataclasses.replace(
        b, history_items=items, history_offsets=lengths_to_offsets(lengths_t),
        cand_items=b.cand_items[:keep_cand], cand_offsets=b.cand_offsets[: n + 1],
        click=b.click[:keep_cand], conversion=b.conversion[:keep_cand],
        sparse_values=vals, sparse_lengths=per_key.reshape(-1).contiguous())


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_positive_and_grow_with_length(family, gem_dataset, ml_dataset):
    ds = dataset_for(family, gem_dataset, ml_dataset)
    model = build(family, ds.info)
    kind = type(ds.train_batch(0))
    if kind is GemBatch:
        short, long = _gem_batch_with_lengths(ds, [3, 5, 0]), _gem_batch_with_lengths(ds, [30, 5, 0])
    elif kind is SeqBatch:
        short = SeqBatch(torch.arange(8), lengths_to_offsets(torch.tensor([3, 5])), torch.arange(8))
        long = SeqBatch(torch.arange(16), lengths_to_offsets(torch.tensor([11, 5])), torch.arange(16))
    else:
        pytest.skip(f"this test builds GemBatch and SeqBatch batches, not {kind.__name__} "
                    "(gemzoo.testing.models.check_model counts every family's FLOPs)")
    f_short, f_long = model.flops(short), model.flops(long)
    assert isinstance(f_short, int) and 0 < f_short < f_long


def test_gem_flops_match_hand_count(gem_dataset):
    """One block, one head, known lengths: the count is the sum of the documented terms."""
    from gemzoo.flops import linear_flops

    model = build("gem", gem_dataset.info, num_layers=1, num_heads=1, d_model=8, embedding_dim=4, mlp_dims=[6],
                  ffn_mult=2)
    b = _gem_batch_with_lengths(gem_dataset, [2, 3, 0])
    cl = b.cand_lengths.tolist()
    T, C, B, d = 5, sum(cl), 3, 8
    pairs_self = 3 + 6  # causal L(L+1)/2 for L = 2, 3
    pairs_cross = cl[0] * 2 + cl[1] * 3
    want = (linear_flops(T, 4, d) + linear_flops(T, d, 3 * d) + linear_flops(T, d, d) + linear_flops(T, d, 2 * d)
            + linear_flops(T, 2 * d, d) + 12 * d * pairs_self
            + linear_flops(C, 4, d) + linear_flops(C, d, d) + linear_flops(T, d, 2 * d) + linear_flops(C, d, d)
            + 12 * d * pairs_cross + linear_flops(B, 3 * 4, d) + linear_flops(C, 5 * d, 6) + 2 * linear_flops(C, 6, 1))
    assert model.flops(b) == want


def test_gem_zero_length_histories(gem_dataset):
    model = build("gem", gem_dataset.info)
    batch = _gem_batch_with_lengths(gem_dataset, [0, 4, 0])
    out = model(batch)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    everyone_empty = _gem_batch_with_lengths(gem_dataset, [0, 0, 0])
    assert torch.isfinite(model(everyone_empty).loss)


@pytest.mark.parametrize("family", ["hstu", "sasrec"])
def test_retrieval_zero_length_sequences(family, ml_dataset):
    model = build(family, ml_dataset.info)
    batch = SeqBatch(torch.tensor([1, 2, 3, 4]), lengths_to_offsets(torch.tensor([0, 3, 0, 1])),
                     torch.tensor([2, 3, 4, -1]))
    out = model(batch)
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_torchrec_and_plain_torch_engines_agree(gem_dataset, monkeypatch):
    skip_unless_torchrec()
    with_torchrec = build("gem", gem_dataset.info)
    assert with_torchrec.sparse_arch.engine == "torchrec"
    tables = with_torchrec.embedding_tables()
    assert type(tables[0]).__name__ == "EmbeddingBagConfig" and len(tables) == GEM_DATA["num_sparse_tables"]
    monkeypatch.setenv("GEMZOO_NO_TORCHREC", "1")
    plain = build("gem", gem_dataset.info)
    assert plain.sparse_arch.engine == "torch"
    assert [t.name for t in plain.embedding_tables()] == [t.name for t in tables]
    plain.load_state_dict(with_torchrec.state_dict())  # same parameter names under either engine
    batch = gem_dataset.train_batch(3)
    torch.testing.assert_close(plain(batch).loss, with_torchrec(batch).loss, rtol=1e-5, atol=1e-6)


def test_plain_torch_engine_notice(monkeypatch, caplog):
    import gemzoo.embedding as emb

    monkeypatch.setenv("GEMZOO_NO_TORCHREC", "1")
    monkeypatch.setattr(emb, "_notice_given", False)
    with caplog.at_level("WARNING", logger="gemzoo.embedding"):
        emb.SparseArch([emb.TableConfig("t", 10, 4, ["f"])])
        emb.SparseArch([emb.TableConfig("t", 10, 4, ["f"])])
    notices = [r for r in caplog.records if "plain-torch EmbeddingBag engine" in r.getMessage()]
    assert len(notices) == 1 and "GEMZOO_NO_TORCHREC" in notices[0].getMessage()


def test_bad_model_configs(gem_dataset, ml_dataset):
    with pytest.raises(ConfigError, match="not divisible by num_heads"):
        build("gem", gem_dataset.info, d_model=30, num_heads=4)
    with pytest.raises(ConfigError, match="temperature"):
        build("sasrec", ml_dataset.info, temperature=0.0)
    with pytest.raises(ConfigError, match="num_items"):
        build("hstu", {"max_len": 10})
    with pytest.raises(ConfigError, match="source = \"synthetic-gem\""):
        build("gem", ml_dataset.info)
    with pytest.raises(ConfigError, match="source = \"movielens\""):
        build("sasrec", gem_dataset.info)
    model = build("gem", gem_dataset.info)
    too_long = _gem_batch_with_lengths(gem_dataset, [GEM_DATA["max_len"] + 1, 1, 1])
    with pytest.raises(ConfigError, match="max_len"):
        model(too_long)


def test_binary_auc_matches_pair_count():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (200,), generator=g).float()  # many ties
    labels = (torch.rand(200, generator=g) < 0.4).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    want = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    assert binary_auc(scores, labels) == pytest.approx(want, abs=1e-12)
    assert binary_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert binary_auc(torch.ones(3), torch.ones(3)) != binary_auc(torch.ones(3), torch.ones(3))  # NaN


def test_ranking_evaluator_hand_case(ml_dataset, monkeypatch):
    """Known user states and item embeddings: HR@K / NDCG@K follow from the target's rank."""
    model = build("sasrec", ml_dataset.info, eval_ks=[1, 3])
    n = model.num_items
    with torch.no_grad():
        model.item_emb.weight.zero_()
        model.item_emb.weight[:, 0] = -1.0
        model.item_emb.weight[:4, 0] = torch.tensor([1.0, 0.9, 0.8, 0.7])
        model.item_emb.weight[:4, 1] = torch.tensor([0.0, 0.3, 0.6, 0.9])
    user = torch.zeros(2, model.cfg.embedding_dim)
    user[:, 0] = 1.0  # cosine ranks items 0 > 1 > 2 > 3 > the rest
    monkeypatch.setattr(model, "encode", lambda batch: user)
    batch = SeqBatch(torch.tensor([5, 6]), lengths_to_offsets(torch.tensor([1, 1])), torch.tensor([0, 2]))
    ev = RankingEvaluator(model)
    ev.update(batch)
    m = ev.compute()
    assert n > 4
    assert m["hr@1"] == 0.5 and m["hr@3"] == 1.0
    assert m["ndcg@3"] == pytest.approx((1.0 + 1.0 / torch.log2(torch.tensor(4.0)).item()) / 2)
    assert m["mrr"] == pytest.approx((1 + 1 / 3) / 2)


def test_ranking_unseen_leaves_history_items_out(ml_dataset, monkeypatch):
    """eval_ranking="unseen": items of the user's own history (not the target) drop out of the ranking."""
    model = build("sasrec", ml_dataset.info, eval_ks=[1, 3], eval_ranking="unseen")
    with torch.no_grad():
        model.item_emb.weight.zero_()
        model.item_emb.weight[:, 0] = -1.0
        model.item_emb.weight[:5, 0] = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6])
        model.item_emb.weight[:5, 1] = torch.tensor([0.0, 0.3, 0.6, 0.9, 1.2])
    user = torch.zeros(4, model.cfg.embedding_dim)
    user[:, 0] = 1.0  # cosine ranks items 0 > 1 > 2 > 3 > 4 > the rest
    monkeypatch.setattr(model, "encode", lambda batch: user)
    # user 0 saw items 0 and 1, target 2: rank 2 among all items, 0 among unseen ones. User 1 saw 0 and 3,
    # target 3 repeats a seen item and stays rankable: rank 3 among all, 2 among unseen (0 left out).
    items = torch.tensor([0, 1, 0, 3])
    targets = torch.tensor([-1, 2, -1, 3])
    batch = SeqBatch(items, lengths_to_offsets(torch.tensor([2, 2])), targets)
    ev = RankingEvaluator(model)
    ev.update(batch)
    m = ev.compute()
    assert set(m) >= {"hr@1_unseen", "hr@3_unseen", "ndcg@3_unseen", "mrr_unseen"} and "hr@1" not in m
    assert m["mrr_unseen"] == pytest.approx((1 / 1 + 1 / 3) / 2)
    assert m["hr@1_unseen"] == 0.5 and m["hr@3_unseen"] == 1.0 and m["eval_users"] == 2
    full = build("sasrec", ml_dataset.info, eval_ks=[1, 3])
    full.item_emb.weight.data.copy_(model.item_emb.weight.data)
    monkeypatch.setattr(full, "encode", lambda batch: user)
    ev = RankingEvaluator(full)
    ev.update(batch)
    assert ev.compute()["mrr"] == pytest.approx((1 / 3 + 1 / 4) / 2)


# -- learning: a short plain loop per family (the trainer does the same with more machinery) ---------
def _use_kernel(model, name: str) -> None:
    kernel = gemzoo.registry.get("attention", name)
    for site in attention_sites(model).values():
        site.set_kernel(name, kernel)


def _train(model, ds, steps: int, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        out = model(ds.train_batch(step))
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss))
    return losses


def _evaluate(model, ds, n: int) -> dict[str, float]:
    ev = model.evaluator()
    model.eval()
    with torch.no_grad():
        for b in ds.eval_batches(n):
            ev.update(b)
    model.train()
    return ev.compute()


@pytest.mark.slow
def test_gem_learns_the_planted_labels():
    ds = SyntheticGemDataset(SyntheticGemConfig(batch_size=64, max_len=32, median_len=8, max_candidates=16,
                                                num_items=200, num_clusters=6, num_sparse_tables=2,
                                                sparse_table_size=100), seed=0)
    model = build("gem", ds.info)
    _use_kernel(model, "sdpa-padded")
    before = _evaluate(model, ds, 4)["auc_click"]
    losses = _train(model, ds, 150, 3e-3)
    after = _evaluate(model, ds, 4)
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 0.05
    assert after["auc_click"] > 0.62 and after["auc_click"] > before + 0.08, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["hstu", "sasrec"])
def test_retrieval_families_learn(family, ml_dataset):
    model = build(family, ml_dataset.info)
    _use_kernel(model, "sdpa-padded")
    before = _evaluate(model, ml_dataset, 10)
    losses = _train(model, ml_dataset, 80, 1e-2)
    after = _evaluate(model, ml_dataset, 10)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert after["hr@10"] > before["hr@10"] + 0.2 and after["ndcg@10"] > before["ndcg@10"]


# -- configs: every shipped config names real fields and builds -------------------------------------
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_fields_exist(path):
    cfg = tomllib.loads(path.read_text())
    mspec = gemzoo.registry.get("model", cfg["model"]["family"])
    dspec = gemzoo.registry.get("dataset", cfg["data"]["source"])
    for table, cls in (("model", mspec.config_cls), ("data", dspec.config_cls)):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(cfg[table]) - fields
        assert not unknown, f"{path.name} [{table}] has unknown keys {unknown}"
        cls(**cfg[table])
    assert cfg["plugins"]["attention"] in gemzoo.registry.names("attention")
    assert cfg["plugins"]["precision"] in gemzoo.registry.names("precision")


def test_gem_bench_config_shape():
    """gem-bench builds on meta: 8 blocks of d_model 1024, 8 heads of 128, 16 tables of 1M x 128."""
    cfg = tomllib.loads((ROOT / "configs" / "gem-bench.toml").read_text())
    spec = gemzoo.registry.get("model", "gem")
    dcfg = cfg["data"]
    info = {"num_items": dcfg["num_items"], "max_len": dcfg["max_len"], "max_candidates": dcfg["max_candidates"],
            "sparse_tables": [{"name": f"table_{t}", "num_embeddings": dcfg["sparse_table_size"],
                               "feature_names": [f"sparse_{t}"]} for t in range(dcfg["num_sparse_tables"])]}
    with torch.device("meta"):
        model = spec.build(spec.config_cls(**cfg["model"]), info)
    assert len(model.tower.blocks) == 8 and model.tower.blocks[0].attn.head_dim == 128
    assert model.tower.blocks[0].attn.num_heads == 8 and model.cfg.d_model == 1024
    tables = model.embedding_tables()
    assert len(tables) == 16 and all(t.num_embeddings == 1_000_000 and t.embedding_dim == 128 for t in tables)
    assert dcfg["median_len"] == 1024 and dcfg["max_len"] == 16384 and dcfg["batch_size"] == 64
    assert dcfg["min_candidates"] == dcfg["max_candidates"] == 32
    assert cfg["plugins"]["attention"] == "sdpa-padded" and cfg["plugins"]["precision"] == "bf16"


def test_gem_tiny_config_builds_and_steps():
    cfg = tomllib.loads((ROOT / "configs" / "gem-tiny.toml").read_text())
    dspec = gemzoo.registry.get("dataset", cfg["data"]["source"])
    ds = dspec.build(dspec.config_cls(**cfg["data"]), cfg["run"]["seed"])
    spec = gemzoo.registry.get("model", cfg["model"]["family"])
    with torch.device("meta"):
        model = spec.build(spec.config_cls(**cfg["model"]), ds.info)
    model.to_empty(device="cpu")
    model.init_weights()
    out = model(ds.train_batch(0))
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.flops(ds.train_batch(0)) > 0


def test_self_attention_pairs_match_the_flops_helper():
    from gemzoo.flops import attention_pairs
    from gemzoo.models.common import self_attention_pairs

    lengths = torch.tensor([0, 1, 5, 17])
    assert self_attention_pairs(lengths, causal=True) == attention_pairs(lengths, causal=True) == 0 + 1 + 15 + 153
    assert self_attention_pairs(lengths, causal=False) == attention_pairs(lengths, causal=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_sdpa_padded_step(family, gem_dataset, ml_dataset):
    ds = dataset_for(family, gem_dataset, ml_dataset)
    spec, cfg = _spec_and_cfg(family)
    with torch.device("meta"):
        model = spec.build(cfg, ds.info)
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    model.init_weights()
    _use_kernel(model, "sdpa-padded")
    gemzoo.registry.get("precision", "bf16").apply(model, PrecisionConfig(keep=["head.*"]))
    out = model(ds.train_batch(0).to("cuda"))
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.flops(ds.train_batch(0)) > 0


@pytest.mark.parametrize("negatives", ["shared", "per_position"])
def test_sampled_softmax_negatives(negatives, ml_dataset):
    model = build("hstu", ml_dataset.info, negatives=negatives)
    _use_kernel(model, "sdpa-padded")
    losses = _train(model, ml_dataset, 30, 1e-2)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    with pytest.raises(ConfigError, match="negatives"):
        build("hstu", ml_dataset.info, negatives="everywhere")


@pytest.mark.parametrize("family", FAMILIES)
def test_backward_is_bitwise_repeatable(family, gem_dataset, ml_dataset):
    """Bit-exact --resume on CPU needs deterministic gradients, also with several threads."""
    if family == "gem":  # many candidates per user: scatter-adds into the same rows collide often
        ds = SyntheticGemDataset(SyntheticGemConfig(**{**GEM_DATA, "batch_size": 64, "median_len": 4,
                                                        "min_candidates": 24, "max_candidates": 32}))
        model = build(family, ds.info, d_model=64)
    else:
        ds = dataset_for(family, gem_dataset, ml_dataset)
        model = build(family, ds.info)
    _use_kernel(model, "sdpa-padded")
    batch = ds.train_batch(4)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(8):
            model.zero_grad()
            torch.manual_seed(0)
            model(batch).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        torch.set_num_threads(threads)
    for g in grads[1:]:
        differ = [n for n in g if not torch.equal(g[n], grads[0][n])]
        assert not differ, f"gradients differ between identical backward passes: {differ}"


def test_plain_torch_engine_sparse_gradients_match_dense(gem_dataset, monkeypatch):
    """The trainer gives the fallback engine sparse table gradients; Adagrad steps land where dense ones would."""
    from gemzoo.embedding import use_sparse_gradients

    monkeypatch.setenv("GEMZOO_NO_TORCHREC", "1")
    models = [build("gem", gem_dataset.info) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    assert use_sparse_gradients(models[0].sparse_arch) == 1
    before = [t.detach().clone() for t in models[0].sparse_arch.parameters()]
    for model in models:
        tables = list(model.sparse_arch.parameters())
        opt = torch.optim.Adagrad(tables, lr=0.1)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            model(gem_dataset.train_batch(step)).loss.backward()
            assert tables[0].grad.is_sparse == (model is models[0])
            opt.step()
    for a, b, a0 in zip(models[0].sparse_arch.parameters(), models[1].sparse_arch.parameters(), before, strict=True):
        assert not torch.equal(a, a0)  # the tables did train
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

