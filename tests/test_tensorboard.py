"""``run.tensorboard = true``: metrics.jsonl's step rows as TensorBoard scalars, the config as text."""

import copy
import json

import pytest
from toy_plugin import TOY_CONFIG, install

from gemzoo.config import load_config
from gemzoo.train.trainer import train

pytest.importorskip("tensorboard")


def _cfg(out, **run):
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=str(out), log_every=1, tensorboard=True, **run)
    raw.setdefault("eval", {}).update(every=4, batches=1)
    return load_config(raw=raw)


def _events(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_match_metrics_jsonl(fresh_registry, tmp_path):
    install(fresh_registry)
    train(_cfg(tmp_path / "run", steps=8), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    acc = _events(tmp_path / "run" / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "tflops", "mfu", "peak_mem_gib"} <= tags
    assert any(t.startswith("eval/") for t in tags)
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in rows}, rel=1e-6)  # every row, same values
    evals = [t for t in tags if t.startswith("eval/")]
    assert [e.step for e in acc.Scalars(evals[0])] == [4, 8]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"tensorboard": true' in text and '"steps": 8' in text


def test_off_by_default_and_clear_error_without_the_package(fresh_registry, tmp_path, monkeypatch):
    install(fresh_registry)
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=str(tmp_path / "off"), steps=2)
    train(load_config(raw=raw), progress=False)
    assert not (tmp_path / "off" / "tensorboard").exists()

    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kw):
        if name.startswith(("torch.utils.tensorboard", "tensorboard")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    from gemzoo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"gemzoo\[tensorboard\]"):
        train(_cfg(tmp_path / "on", steps=2), progress=False)


def test_resumed_run_continues_the_curves(fresh_registry, tmp_path):
    install(fresh_registry)
    out = tmp_path / "run"
    raw = lambda steps: _cfg(out, steps=steps)  # noqa: E731
    cfg = raw(4)
    cfg.checkpoint.every, cfg.eval.every = 2, 0
    train(cfg, progress=False)
    rows = {json.loads(line)["step"]: json.loads(line)["loss"]
            for line in (out / "metrics.jsonl").read_text().splitlines() if "event" not in json.loads(line)}
    cfg = raw(6)
    cfg.checkpoint.every, cfg.eval.every = 2, 0
    train(cfg, resume=True, progress=False)
    loss = [(e.step, e.value) for e in _events(out / "tensorboard").Scalars("loss")]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]  # one point a step across both processes
    assert dict(loss)[3] == pytest.approx(rows[3], rel=1e-6)


def test_points_after_the_resume_step_are_purged(fresh_registry, tmp_path):
    """A crash after step 4 with the last checkpoint at 2: the resumed run's steps 3-4 replace the old ones."""
    import shutil

    install(fresh_registry)
    out = tmp_path / "run"
    cfg = _cfg(out, steps=4)
    cfg.checkpoint.every, cfg.checkpoint.keep, cfg.eval.every = 2, 0, 0
    train(cfg, progress=False)
    shutil.rmtree(out / "checkpoints" / "step-00000004")  # as if killed before that checkpoint landed
    cfg = _cfg(out, steps=4)
    cfg.checkpoint.every, cfg.checkpoint.keep, cfg.eval.every = 2, 0, 0
    train(cfg, resume=True, progress=False)
    steps = [e.step for e in _events(out / "tensorboard").Scalars("loss")]
    assert steps == [1, 2, 3, 4]
