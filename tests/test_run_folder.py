"""One run folder holds one run: refusal, --overwrite, manifests of the wrong shape, leftovers of a crash."""

import copy
import hashlib
import json
import shutil

import pytest
from toy_plugin import TOY_CONFIG

from gemzoo.config import load_config
from gemzoo.errors import CheckpointError, ConfigError
from gemzoo.train import checkpoint as ckpt
from gemzoo.train.trainer import Trainer, train


def _cfg(out, **run):
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=str(out), **run)
    return load_config(raw=raw)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _steps(out):
    return [p.name for p in ckpt.list_checkpoints(out / "checkpoints")]


# ------------------------------------------------------------------------------ item 1: one run a folder
def test_a_fresh_run_refuses_a_folder_that_holds_a_run(toy, tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, steps=20), progress=False)
    before = (out / "metrics.jsonl").read_text(), _steps(out)
    with pytest.raises(ConfigError, match=r"not empty.*--resume.*--overwrite.*--out DIR"):
        train(_cfg(out, steps=10), progress=False)
    assert ((out / "metrics.jsonl").read_text(), _steps(out)) == before  # nothing touched


def test_overwrite_replaces_the_old_run_and_keeps_other_files(toy, tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, steps=30), progress=False)  # checkpoints 20 and 30
    (out / "notes.txt").write_text("mine")
    train(_cfg(out, steps=10), progress=False, overwrite=True)
    assert _steps(out) == ["step-00000010"]  # the old step-20/30 would have made keep delete this one
    events = [r["event"] for r in _rows(out) if "event" in r]
    assert events == ["start", "end"] and max(r["step"] for r in _rows(out)) == 10
    assert (out / "notes.txt").read_text() == "mine"  # --overwrite deletes only what a run writes


def test_resume_and_overwrite_together_is_an_error(toy, tmp_path):
    with pytest.raises(ConfigError, match="contradict"):
        Trainer(_cfg(tmp_path / "run"), resume=True, overwrite=True, progress=False).assemble()


# ------------------------------------------------------------------------------ item 4: manifest schema
def _write_copy_outside(newest, tmp_path):
    """A valid safetensors file outside the checkpoint folder, and its manifest entry."""
    outside = tmp_path / "outside.safetensors"
    shutil.copy(newest / "rng.safetensors", outside)
    return {"bytes": outside.stat().st_size, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}


BAD_MANIFESTS = {
    "no-files": lambda m, e: {"format": 1, "step": 20},
    "a-list": lambda m, e: [],
    "step-is-text": lambda m, e: {**m, "step": "forty"},
    "step-of-another-folder": lambda m, e: {**m, "step": 30},
    "file-outside-the-folder": lambda m, e: {**m, "files": {**m["files"], "../../../outside.safetensors": e}},
    "optimizer-state-not-an-object": lambda m, e: {**m, "optimizers": {"dense": []}},
    "files-not-an-object": lambda m, e: {**m, "files": ["model.safetensors"]},
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_manifest_of_the_wrong_shape_is_skipped_for_the_previous_checkpoint(toy, tmp_path, case):
    out = tmp_path / "run"
    train(_cfg(out, steps=20), progress=False)
    newest = ckpt.list_checkpoints(out / "checkpoints")[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    bad = BAD_MANIFESTS[case](manifest, _write_copy_outside(newest, tmp_path))
    (newest / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="manifest.json"):
        ckpt.load_checkpoint(newest)
    with pytest.warns(RuntimeWarning, match="skipping unusable checkpoint"):
        state = ckpt.load_latest(out / "checkpoints")
    assert state["manifest"]["step"] == 10


# ------------------------------------------------------------------------------ item 5: crash leftovers
def test_resume_drops_superseded_metrics_rows_and_stale_temporaries(toy, tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, steps=20), progress=False)  # rows at 5, 10, 15, 20; checkpoints 10, 20
    shutil.rmtree(out / "checkpoints" / "step-00000020")  # killed before step 20's checkpoint was in place
    stale = out / "checkpoints" / ".tmp-step-00000020-4242"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "loss": 1.0')  # a line the kill cut short
    train(_cfg(out, steps=20), resume=True, progress=False)
    rows = _rows(out)
    steps = [r["step"] for r in rows if "event" not in r]
    assert steps == sorted(set(steps)) == [5, 10, 15, 20]  # each step once, in order
    assert [(r["event"], r["step"]) for r in rows if "event" in r] == [("start", 0), ("resume", 10), ("end", 20)]
    assert not list((out / "checkpoints").glob(".tmp-step-*"))


def test_resume_sets_aside_a_newer_unusable_checkpoint(toy, tmp_path):
    """keep=1: the corrupt step-30 sorted above the new step-25, so keep deleted the new one."""
    out = tmp_path / "run"
    train(_cfg(out, steps=30), progress=False)  # checkpoints 20, 30
    model = out / "checkpoints" / "step-00000030" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=str(out), steps=25)
    raw["checkpoint"].update(every=5, keep=1)
    with pytest.warns(RuntimeWarning, match="skipping unusable checkpoint"):
        train(load_config(raw=raw), resume=True, progress=False)
    assert _steps(out) == ["step-00000025"]
    assert (out / "checkpoints" / "step-00000030.unusable").is_dir()  # set aside, not deleted


def test_resume_from_an_older_checkpoint_into_a_folder_with_later_ones_is_refused(toy, tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, steps=30), progress=False)
    with pytest.raises(CheckpointError, match="after step 20.*mix two histories"):
        train(_cfg(out, steps=30), resume=str(out / "checkpoints" / "step-00000020"), progress=False)


def test_metrics_log_writes_null_for_nan(tmp_path):
    from gemzoo.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "eval/auc": float("nan"), "spread": [float("inf"), 1.0]})
    log.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line}"))
    assert row["eval/auc"] is None and row["spread"] == [None, 1.0]
