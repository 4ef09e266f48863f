"""``gemzoo eval``: a checkpoint's eval metrics, without training, equal what the training run logged."""

import json
from pathlib import Path

import pytest

from gemzoo.cli import main
from gemzoo.cli.eval import evaluate_checkpoint, logged_eval
from gemzoo.config import load_config
from gemzoo.errors import CheckpointError, ConfigError
from gemzoo.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.batch_size=8", "data.max_len=16", "eval.every=3", "eval.batches=2", "checkpoint.every=3",
        "checkpoint.keep=0", "run.log_every=1"]


@pytest.fixture(scope="module")
def gem_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gem") / "run"
    cfg = load_config(ROOT / "configs" / "gem-tiny.toml", overrides=[*TINY, "run.steps=6", f"run.out_dir='{out}'"])
    train(cfg, progress=False)
    return out


@pytest.mark.parametrize("step", [3, 6])
def test_eval_reproduces_logged_metrics(gem_run, step):
    result = evaluate_checkpoint(gem_run / "checkpoints" / f"step-{step:08d}")
    logged = logged_eval(gem_run, step)
    assert set(logged) >= {"eval/auc_click", "eval/auc_conversion"}
    assert result["step"] == step and result["metrics"] == pytest.approx(logged, rel=1e-6, abs=1e-7)


def test_cli_picks_the_newest_checkpoint_and_writes_json(gem_run, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(gem_run), "--json", str(tmp_path / "e.json")]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "e.json").read_text())
    assert printed["step"] == written["step"] == 6 and written["split"] == "val"
    assert written["metrics"] == pytest.approx(written["logged"], rel=1e-6, abs=1e-7)
    assert 0 < written["metrics"]["eval/auc_click"] < 1


def test_bad_checkpoint_and_split_are_clear_errors(gem_run, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        evaluate_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint under"):
        evaluate_checkpoint(tmp_path / "empty")
    with pytest.raises(ConfigError, match="one held-out stream.*--split test"):
        evaluate_checkpoint(gem_run, split="test")
    with pytest.raises(CheckpointError, match="in the checkpoint but .* in the model"):
        evaluate_checkpoint(gem_run, config=str(ROOT / "configs" / "gem-tiny.toml"),
                            overrides=["model.d_model=32", "data.max_len=16"])


def _ratings(path: Path, users: int = 24, items: int = 30) -> None:
    """Each user walks up the item ids: next-item retrieval is learnable and every user has 8+ events."""
    path.write_text("".join(f"{u}::{(u + i) % items + 1}::5::{100 + i}\n" for u in range(1, users + 1)
                            for i in range(8 + u % 5)))


def test_retrieval_family_val_and_test(tmp_path):
    _ratings(tmp_path / "ratings.dat")
    out = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "sasrec-ml1m.toml", overrides=[
        f"data.path='{tmp_path / 'ratings.dat'}'", "data.batch_size=8", "data.max_len=12", "model.embedding_dim=16",
        "model.num_negatives=8", "model.eval_ks=[5, 10]", "model.dropout=0.0", "run.steps=4", "eval.every=4",
        "eval.batches=2", "checkpoint.every=4", f"run.out_dir='{out}'"])
    train(cfg, progress=False)
    val = evaluate_checkpoint(out, split="val")
    assert val["metrics"] == pytest.approx(logged_eval(out, 4), rel=1e-6, abs=1e-7)
    # the ML-1M configs rank unseen items only, so the names end in _unseen
    assert {k.split("@")[0].removesuffix("_unseen") for k in val["metrics"]} >= {"eval/hr", "eval/ndcg", "eval/mrr"}
    test = evaluate_checkpoint(out, split="test")
    assert set(test["metrics"]) == set(val["metrics"]) and test["split"] == "test"
