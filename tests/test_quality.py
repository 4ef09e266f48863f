"""The HSTU reference's details (docs/quality-ml1m.md), on synthetic MovieLens-format files: the split,
the item catalogue, positions, negatives, the relative attention bias, the SASRec reference block, init and
AdamW betas."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gemzoo
from gemzoo.attention import attention_sites, relative_bias_block
from gemzoo.config import load_config
from gemzoo.data.movielens import MovieLensConfig, MovieLensDataset
from gemzoo.errors import ConfigError, PluginError
from gemzoo.interfaces.attention import RelativeAttentionBias
from gemzoo.jagged import lengths_to_offsets

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(embedding_dim=16, num_layers=2, num_heads=2, num_negatives=8, dropout=0.0)


def write_ml(folder: Path, users: int = 10, items: int = 12, extra_movies: int = 0, seed: int = 0) -> Path:
    """ratings.dat with 6..12 events a user (distinct items, increasing timestamps with varied gaps); with
    ``extra_movies`` a movies.dat beside it that also lists movies nobody rated."""
    rng = random.Random(seed)
    lines = []
    for u in range(1, users + 1):
        t = 1_000_000 + rng.randrange(1000)
        for movie in rng.sample(range(1, items + 1), rng.randrange(6, min(12, items) + 1)):
            t += rng.choice([0, 1, 7, 60, 3600, 86_400])
            lines.append(f"{u}::{movie}::{rng.randrange(1, 6)}::{t}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ratings.dat").write_text("\n".join(lines) + "\n")
    if extra_movies:
        (folder / "movies.dat").write_text("".join(f"{m}::Movie {m} (1999)::Drama\n"
                                                   for m in range(1, items + extra_movies + 1)))
    return folder / "ratings.dat"


def build(family: str, info: dict, seed: int = 0, kernel: str = "reference", **overrides):
    spec = gemzoo.registry.get("model", family)
    cfg = spec.config_cls(**{**SMALL, **overrides})
    with torch.device("meta"):
        model = spec.build(cfg, info)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    for site in attention_sites(model).values():
        site.set_kernel(kernel, gemzoo.registry.get("attention", kernel))
    return model


# -- the split -------------------------------------------------------------------------------------
@pytest.mark.parametrize("split,cut", [("val", 2), ("test", 1)])
def test_training_ends_before_the_held_out_item_of_the_split(tmp_path, split, cut):
    ds = MovieLensDataset(MovieLensConfig(path=str(write_ml(tmp_path)), batch_size=4, max_len=50,
                                          eval_split=split), seed=0)
    assert ds.info["train_items"] == ("before_val" if split == "val" else "before_test")
    for u in range(len(ds.users)):
        assert ds.train_seqs[u].tolist() == ds.seqs[u].tolist()[:-cut]
    # the validation item is the last training target exactly when test is reported (the reference's way)
    assert all((int(ds.train_seqs[u][-1]) == ds.val_items[u]) == (split == "test") for u in ds.trainable)
    b = ds.train_batch(0)
    for s in range(b.num_samples):  # every window ends with the end of a training sequence
        lo, hi = int(b.offsets[s]), int(b.offsets[s + 1])
        window = b.items[lo:hi].tolist() + [int(b.targets[hi - 1])]
        assert any(ds.train_seqs[u].tolist()[-len(window):] == window for u in ds.trainable)
    forced = MovieLensDataset(MovieLensConfig(path=str(write_ml(tmp_path)), eval_split=split,
                                              train_items="before_val"))
    assert all(forced.train_seqs[u].tolist() == forced.seqs[u].tolist()[:-2] for u in range(len(forced.users)))


def test_batches_carry_timestamps_of_inputs_and_of_what_follows(tmp_path):
    path = write_ml(tmp_path)
    ds = MovieLensDataset(MovieLensConfig(path=str(path), batch_size=3, max_len=4, eval_split="test"))
    b = ds.train_batch(0)
    assert b.times.shape == b.items.shape == b.next_times.shape
    assert bool((b.next_times >= b.times).all())  # time order
    for s in range(b.num_samples):
        lo, hi = int(b.offsets[s]), int(b.offsets[s + 1])
        assert b.times[lo + 1:hi].tolist() == b.next_times[lo:hi - 1].tolist()
    e = ds._eval_batch([0, 1, 2])
    for j in range(3):
        last = int(e.offsets[j + 1]) - 1
        assert int(e.targets[last]) == int(ds.seqs[j][-1])
        assert int(e.next_times[last]) == int(ds.times[j][-1])  # the held-out (test) item's time
        assert int(e.times[last]) == int(ds.times[j][-2])
    sub = b.select([2, 0])
    assert sub.times is not None and sub.times.numel() == sub.items.numel()


# -- the item catalogue ------------------------------------------------------------------------------
def test_items_from_movies_dat_include_unrated_movies(tmp_path, capsys):
    path = write_ml(tmp_path, items=12, extra_movies=5)
    auto = MovieLensDataset(MovieLensConfig(path=str(path)))
    assert auto.info["num_items"] == 17 and auto.info["items"].endswith("movies.dat")
    assert "5 never rated" in capsys.readouterr().err
    rated = MovieLensDataset(MovieLensConfig(path=str(path), items="rated"))
    assert rated.info["num_items"] == len({int(l.split("::")[1]) for l in path.read_text().split()})
    # unrated movies are candidates: the evaluator ranks over every row of the table
    model = build("hstu", auto.info)
    assert model.item_emb.num_embeddings == 17
    (tmp_path / "movies.dat").unlink()
    with pytest.raises(ConfigError, match="movies.dat"):
        MovieLensDataset(MovieLensConfig(path=str(path), items="movies"))


def test_movies_dat_must_list_every_rated_movie(tmp_path):
    path = write_ml(tmp_path, items=12, extra_movies=1)
    (tmp_path / "movies.dat").write_text("1::A (1999)::Drama\n")
    with pytest.raises(ConfigError, match="does not list"):
        MovieLensDataset(MovieLensConfig(path=str(path), items="movies"))


# -- positions ---------------------------------------------------------------------------------------
def test_positions_count_from_the_window_start(tmp_path):
    ds = MovieLensDataset(MovieLensConfig(path=str(write_ml(tmp_path)), max_len=6))
    offsets = lengths_to_offsets(torch.tensor([3, 0, 6]))
    start = build("sasrec", ds.info, positions="from_start")
    recent = build("sasrec", ds.info)
    assert start.positions(offsets, 9).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert recent.positions(offsets, 9).tolist() == [2, 1, 0, 5, 4, 3, 2, 1, 0]


# -- negatives -----------------------------------------------------------------------------------------
def _drawn_negatives(model, batch):
    """The per-position [P, k] draw of one forward."""
    seen = []
    score = model.negative_logits
    model.negative_logits = lambda user, negatives: seen.append(negatives.clone()) or score(user, negatives)
    try:
        model(batch)
    finally:
        del model.negative_logits
    return seen[0]


def test_redrawn_negatives_never_equal_the_target_and_cover_the_rest(tmp_path):
    ds = MovieLensDataset(MovieLensConfig(path=str(write_ml(tmp_path, items=6)), batch_size=8, max_len=8))
    model = build("hstu", ds.info, negatives="per_position", accidental_hits="redraw", num_negatives=64)
    batch = ds.train_batch(0)
    neg = _drawn_negatives(model, batch)
    target = batch.targets[batch.targets >= 0]
    assert neg.shape == (target.numel(), 64)
    assert not bool((neg == target.unsqueeze(1)).any())
    assert int(neg.min()) >= 0 and int(neg.max()) < ds.info["num_items"]
    for row, t in zip(neg, target, strict=True):  # uniform over the other items: 64 draws of 5 miss none (p < 1e-5)
        assert set(row.tolist()) == set(range(ds.info["num_items"])) - {int(t)}
    masked = build("hstu", ds.info, negatives="per_position", num_negatives=64)
    assert bool((_drawn_negatives(masked, batch) == target.unsqueeze(1)).any())  # "mask" may draw it
    with pytest.raises(ConfigError, match="per_position"):
        build("hstu", ds.info, accidental_hits="redraw")


def test_loss_is_cosine_over_temperature_with_drawn_targets_masked(tmp_path):
    ds = MovieLensDataset(MovieLensConfig(path=str(write_ml(tmp_path, items=6)), batch_size=4, max_len=8))
    model = build("sasrec", ds.info, negatives="per_position", num_negatives=16, temperature=0.07)
    batch = ds.train_batch(0)
    torch.manual_seed(3)
    loss = model(batch).loss
    torch.manual_seed(3)
    neg = _drawn_negatives(model, batch)
    with torch.no_grad():
        keep = batch.targets >= 0
        user = F.normalize(model.encode(batch)[keep], dim=-1)
        items = F.normalize(model.item_emb.weight, dim=-1)
        target = batch.targets[keep]
        pos = (user * items[target]).sum(-1, keepdim=True)
        negs = torch.einsum("pd,pkd->pk", user, items[neg]).masked_fill(neg == target.unsqueeze(1), -math.inf)
        want = -torch.log_softmax(torch.cat([pos, negs], 1) / 0.07, 1)[:, 0].mean()
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("items,k", [(6, 16), (40, 2)])  # 6 <= 16·d: every item scored; 40 > 2·d: gathered
def test_negative_logits_equal_the_gathered_cosines_with_their_gradients(tmp_path, items, k):
    """Whichever way negative_logits takes (every item scored then picked, or the k embeddings gathered), the
    cosines and the gradients reaching the user vectors and the item table are those of the gather."""
    ds = MovieLensDataset(MovieLensConfig(path=str(write_ml(tmp_path, items=items)), batch_size=4, max_len=8))
    model = build("hstu", ds.info, negatives="per_position", num_negatives=k)
    d = model.item_emb.weight.shape[1]
    assert (ds.info["num_items"] <= k * d) == (items == 6)
    gen = torch.Generator().manual_seed(0)
    user = F.normalize(torch.randn(9, d, generator=gen), dim=-1).requires_grad_()
    negatives = torch.randint(ds.info["num_items"], (9, k), generator=gen)
    weight = torch.randn(9, k, generator=gen)
    got = model.negative_logits(user, negatives)
    (got * weight).sum().backward()
    got_user, got_table = user.grad.clone(), model.item_emb.weight.grad.clone()
    user.grad, model.item_emb.weight.grad = None, None
    want = torch.einsum("pd,pkd->pk", user, F.normalize(model.item_emb(negatives), dim=-1))
    (want * weight).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_user, user.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_table, model.item_emb.weight.grad, rtol=1e-5, atol=1e-5)  # fp32 sum order


# -- relative attention bias -------------------------------------------------------------------------
def _buckets(q_times: torch.Tensor, k_times: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """[Lq, Lk] time buckets of the relative bias's definition: a table whose weight is its bucket index."""
    rb = RelativeAttentionBias(torch.zeros(1, dtype=torch.float64),
                               torch.arange(num_buckets + 1, dtype=torch.float64), q_times, k_times)
    return relative_bias_block(rb, 0, q_times.numel(), 0, k_times.numel()).long()


def test_time_buckets_follow_the_reference_formula():
    times = torch.tensor([0, 0, 0, 0, 0], dtype=torch.long)
    next_times = torch.tensor([1, 2, 10, 1000, 10 ** 9], dtype=torch.long)
    b = _buckets(next_times, times, num_buckets=64)
    # floor(ln(gap) / 0.301) for query i against key 0 (gap = next_times[i]); clamped at num_buckets
    assert b[:, 0].tolist() == [0, 2, 7, 22, 64]


def _edge_gaps() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.cat([torch.randint(1, 10 ** 9, (200_000,), generator=gen),
                      torch.round(torch.exp(torch.arange(1, 60) * 0.301)).long()])  # gaps at every bucket edge


def test_time_buckets_take_the_log_in_float32_as_the_reference():
    """The reference buckets int64 gaps with torch.log, which computes in float32; in float64 some gaps near a
    bucket edge land one bucket apart (343 of 1.34e8 on MovieLens-1M)."""
    gaps = _edge_gaps()
    rb = RelativeAttentionBias(torch.zeros(1, dtype=torch.float64), torch.arange(1001, dtype=torch.float64),
                               gaps, torch.zeros_like(gaps))
    # one sequence of one item per gap: query 0 against key 0
    got = torch.stack([relative_bias_block(rb, i, 1, i, 1)[0, 0] for i in range(0, gaps.numel(), 997)]).long()
    want = (torch.log(torch.abs(gaps).clamp(min=1)) / 0.301).long()
    assert torch.equal(got, want[::997])
    in_float64 = (gaps.double().log() / 0.301).long()
    assert not torch.equal(in_float64, want)  # the case the float32 log is there for


def test_attention_norm_is_a_config_value():
    from gemzoo.models.hstu import HSTUConfig, HSTUModel

    info = {"num_items": 20, "max_len": 8, "timestamps": True, "task": "retrieval"}
    small = dict(embedding_dim=8, num_layers=1, num_heads=1, num_negatives=4)
    default = HSTUModel(HSTUConfig(**small), info)
    assert default.blocks[0].attn.options["norm"] == 8.0  # the data's max_len
    reference = HSTUModel(HSTUConfig(**small, attention_norm=19.0), info)
    assert reference.blocks[0].attn.options["norm"] == 19.0


@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_attention_bias_in_reference_and_sdpa_padded(activation):
    torch.manual_seed(0)
    lengths = torch.tensor([3, 5, 0, 2])
    offsets = lengths_to_offsets(lengths)
    t, h, d, lmax = int(lengths.sum()), 2, 4, 6
    q, k, v = (torch.randn(t, h, d, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(4, 1, lmax, lmax, dtype=torch.float64)
    norm = 5.0 if activation == "silu" else None
    ref = gemzoo.registry.get("attention", "reference")
    out = ref(q, k, v, offsets, activation=activation, scale=1.0, norm=norm, bias=bias)
    want = []
    for b in range(4):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        n = hi - lo
        if n == 0:
            continue
        s = torch.einsum("ihd,jhd->hij", q[lo:hi], k[lo:hi]) + bias[b, :, :n, :n]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if activation == "silu":
            p = torch.where(causal, F.silu(s), 0.0) / norm
        else:
            p = torch.softmax(s.masked_fill(~causal, -math.inf), -1)
        want.append(torch.einsum("hij,jhd->ihd", p, v[lo:hi]))
    torch.testing.assert_close(out, torch.cat(want))
    padded = gemzoo.registry.get("attention", "sdpa-padded")(q.float(), k.float(), v.float(), offsets,
                                                             activation=activation, scale=1.0, norm=norm,
                                                             bias=bias.float())
    torch.testing.assert_close(padded.double(), out, rtol=1e-4, atol=1e-5)
    with pytest.raises(PluginError, match="bias.*reference.*sdpa-padded|bias.*sdpa-padded"):
        gemzoo.registry.get("attention", "cpu")(q.float(), k.float(), v.float(), offsets, activation=activation,
                                                scale=1.0, norm=norm, bias=bias.float())


def test_hstu_relative_bias_is_learned_per_block_and_refused_by_kernels_without_it(tmp_path):
    ds = MovieLensDataset(MovieLensConfig(path=str(write_ml(tmp_path)), batch_size=4, max_len=8))
    batch = ds.train_batch(0)
    plain = build("hstu", ds.info)
    biased = build("hstu", ds.info, relative_bias="position_time")
    sites = attention_sites(biased)
    assert all(s.request.relative_bias for s in sites.values()) and not any(
        s.request.relative_bias or s.request.bias for s in attention_sites(plain).values())
    rel = [blk.rel_bias for blk in biased.blocks]
    assert len({id(r) for r in rel}) == 2 and rel[0].pos.numel() == 8 and rel[0].time.numel() == 129
    biased(batch).loss.backward()
    assert all(r.pos.grad.abs().sum() > 0 and r.time.grad.abs().sum() > 0 for r in rel)
    # a constant bias on the silu scores changes the user states (it is really added before the activation)
    with torch.no_grad():
        before = biased.encode(batch)
        rel[0].pos.add_(1.0)
        assert not torch.allclose(before, biased.encode(batch))
    padded = build("hstu", ds.info, relative_bias="position_time", kernel="sdpa-padded")
    padded.load_state_dict(biased.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(padded.encode(batch), biased.encode(batch), rtol=1e-4, atol=1e-5)
    fused = build("hstu", ds.info, relative_bias="position_time", kernel="cpu")
    fused.load_state_dict(biased.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fused.encode(batch), biased.encode(batch), rtol=1e-4, atol=1e-5)
    cfg = load_config(ROOT / "configs" / "hstu-ml1m.toml", plugins="flex",
                      overrides=[f"data.path='{tmp_path / 'ratings.dat'}'", "run.device=cpu"])
    from gemzoo.train.trainer import build_on_meta

    with pytest.raises(PluginError, match="lacks .*relative_bias .* or bias .*Kernels that can: .*cpu.*sdpa-padded"):
        build_on_meta(cfg)


# -- init, blocks, optimizer ----------------------------------------------------------------------------
def test_reference_init_schemes(tmp_path):
    ds = MovieLensDataset(MovieLensConfig(path=str(write_ml(tmp_path, items=12)), max_len=200))
    torch.manual_seed(0)
    h = build("hstu", {**ds.info, "num_items": 4000}, embedding_dim=50, num_heads=1, init="reference",
              norm_affine=False, uvqk_bias=False)
    blk = h.blocks[0]
    assert blk.uvqk.bias is None and blk.norm.weight is None and blk.attn_norm.weight is None
    assert float(blk.out.weight.std()) == pytest.approx((2 / 100) ** 0.5, rel=0.1)  # xavier_uniform 50 x 50
    assert float(h.pos_emb.weight.std()) == pytest.approx((2 / 250) ** 0.5, rel=0.1)  # xavier_normal 200 x 50
    assert float(blk.uvqk.weight.std()) == pytest.approx(0.02, rel=0.1)
    assert float(h.item_emb.weight.std()) == pytest.approx(0.02 * 0.88, rel=0.1)  # truncated at 2 std
    s = build("sasrec", {**ds.info, "num_items": 4000}, embedding_dim=50, num_heads=1, init="reference",
              block="reference", norm_affine=False)
    assert float(s.pos_emb.weight.std()) == pytest.approx(50 ** -0.5 * 0.88, rel=0.1)
    assert float(s.blocks[0].kv.weight.std()) == pytest.approx((2 / 200) ** 0.5, rel=0.1)
    assert isinstance(s.output_norm, torch.nn.Identity)


def test_sasrec_reference_block_matches_torch_multihead_attention():
    from gemzoo.interfaces.attention import AttentionRequest
    from gemzoo.models.sasrec import SASRecReferenceBlock

    torch.manual_seed(0)
    d, heads, n = 8, 2, 5
    blk = SASRecReferenceBlock(d, heads, d // heads, d, request=AttentionRequest(), dropout=0.0,
                               attn_dropout=0.0, affine=False).double()
    blk.attn.set_kernel("reference", gemzoo.registry.get("attention", "reference"))
    mha = torch.nn.MultiheadAttention(d, heads, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([blk.q.weight, blk.kv.weight]))
        mha.in_proj_bias.copy_(torch.cat([blk.q.bias, blk.kv.bias]))
        mha.out_proj.weight.copy_(blk.out.weight)
        mha.out_proj.bias.copy_(blk.out.bias)
    x = torch.randn(n, d, dtype=torch.float64)
    q = F.layer_norm(x, (d,), eps=1e-8)
    a, _ = mha(q[None], x[None], x[None], attn_mask=torch.ones(n, n, dtype=torch.bool).triu(1))
    z = F.layer_norm(q + a[0], (d,), eps=1e-8)
    want = z + blk.mlp.fc2(F.relu(blk.mlp.fc1(z)))
    torch.testing.assert_close(blk(x, torch.tensor([0, n])), want)


def test_optim_betas_reach_adamw(tmp_path):
    from gemzoo.train.optim import build_optimizers

    cfg = load_config(ROOT / "configs" / "sasrec-ml1m.toml", overrides=[f"data.path='{write_ml(tmp_path)}'"])
    assert cfg.optim.betas == [0.9, 0.98] and cfg.optim.grad_clip == 0.0
    opt = build_optimizers(torch.nn.Linear(2, 2), cfg)["dense"]
    assert opt.param_groups[0]["betas"] == (0.9, 0.98)
    with pytest.raises(ConfigError, match="betas"):  # the config's schema refuses it before any optimizer
        load_config(ROOT / "configs" / "sasrec-ml1m.toml",
                    overrides=[f"data.path='{write_ml(tmp_path)}'", "optim.betas=[0.9, 1.5]"])
    assert not opt.defaults.get("fused")  # CPU parameters: torch's default implementation
    if torch.cuda.is_available():  # plain CUDA parameters: the fused kernel
        cfg.optim.betas = [0.9, 0.98]
        assert build_optimizers(torch.nn.Linear(2, 2).cuda(), cfg)["dense"].defaults["fused"] is True


def _train_first_losses(tmp_path, plugins: str | None, device: str = "cpu") -> tuple[list[float], dict[str, str]]:
    """The first 3 logged losses of configs/hstu-ml1m.toml on synthetic MovieLens files (fp32, full-fp32
    matmuls), and the kernel each attention site ran."""
    from gemzoo import registry
    from gemzoo.train.trainer import train

    data = write_ml(tmp_path / "ml", users=24, items=40, extra_movies=5)
    built = {}

    class Capture:
        @gemzoo.hookimpl
        def gemzoo_model_built(self, model, config):
            built["model"] = model

    plugin = Capture()
    registry.host().register(plugin, name=f"capture-hstu-{len(registry.host().pm.get_plugins())}")
    try:
        cfg = load_config(ROOT / "configs" / "hstu-ml1m.toml", plugins=plugins, overrides=[
            f"data.path='{data}'", f"run.device='{device}'", "run.steps=3", "run.log_every=1", "data.batch_size=8",
            "run.matmul_precision='highest'", f"run.out_dir='{tmp_path / (plugins or 'own')}'", "eval.every=0",
            "checkpoint.every=0"])
        result = train(cfg, progress=False)
    finally:
        registry.host().pm.unregister(plugin)
    kernels = {name: site.kernel_name for name, site in attention_sites(built["model"]).items()}
    return [h["loss"] for h in result.history], kernels


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_hstu_ml1m_trains_on_the_fused_relative_bias(tmp_path, device):
    """configs/hstu-ml1m.toml with its own plugins trains on a kernel that computes the relative bias in its tiles
    (gdpa: its Triton kernels on CUDA, on CPU its fallback, the C++ cpu kernel), never a padded or reference one,
    and its first losses are those of --plugins reference within 1e-4 in fp32."""
    before = torch.get_float32_matmul_precision()
    try:
        _check_fused_against_reference(tmp_path, device)
    finally:
        torch.set_float32_matmul_precision(before)


def _check_fused_against_reference(tmp_path, device):
    fused, kernels = _train_first_losses(tmp_path, None, device)
    assert kernels and not set(kernels.values()) & {"sdpa-padded", "reference", "flex"}, kernels
    for site in kernels:
        kernel = gemzoo.registry.get("attention", kernels[site])
        assert kernel.capabilities.relative_bias, (site, kernels[site])
    reference, ref_kernels = _train_first_losses(tmp_path, "reference", device)
    assert set(ref_kernels.values()) == {"reference"}
    assert len(fused) == len(reference) == 3
    assert fused == pytest.approx(reference, rel=1e-4)
