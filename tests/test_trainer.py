import copy
import json
from pathlib import Path

import pytest
import torch
from toy_plugin import TOY_CONFIG

from gemzoo.config import load_config
from gemzoo.errors import CheckpointError, ConfigError, PluginError, TrainingError
from gemzoo.train import checkpoint as ckpt
from gemzoo.train.trainer import Trainer, train


def _cfg(tmp_path, **sections):
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"]["out_dir"] = str(tmp_path / "run")
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return load_config(raw=raw)


def test_loss_falls_and_files_are_written(toy, tmp_path):
    result = train(_cfg(tmp_path, run={"steps": 60}), progress=False)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    assert last < first
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["event"] == "start" and "mfu_peak" in lines[0]
    steps = [l for l in lines if "loss" in l]
    for key in ("loss", "samples_per_s", "tokens_per_s", "tflops", "mfu", "peak_mem_gib"):
        assert key in steps[-1]
    assert "eval/accuracy" in result.eval
    assert len(ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")) == 2  # keep=2


def test_resume_is_bit_exact(toy, tmp_path):
    full = train(_cfg(tmp_path / "a", run={"steps": 30}), progress=False)
    train(_cfg(tmp_path / "b", run={"steps": 20}), progress=False)
    resumed = train(_cfg(tmp_path / "b", run={"steps": 30}), resume=True, progress=False)
    assert resumed.history[0]["step"] == 21
    assert resumed.final_loss == full.final_loss  # dropout RNG, optimizer state and data all restored


def test_truncated_checkpoint_raises_and_previous_stays_usable(toy, tmp_path):
    train(_cfg(tmp_path, run={"steps": 20}), progress=False)
    root = tmp_path / "run" / "checkpoints"
    newest = ckpt.list_checkpoints(root)[-1]
    model_file = newest / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.load_checkpoint(newest)
    with pytest.warns(RuntimeWarning, match="skipping unusable checkpoint"):
        state = ckpt.load_latest(root)
    assert state["manifest"]["step"] == 10
    trainer = Trainer(_cfg(tmp_path, run={"steps": 20}), resume=True, progress=False)
    with pytest.warns(RuntimeWarning):
        trainer.assemble()
    assert trainer.start_step == 10


def test_checkpoint_is_not_pickle_and_has_manifest(toy, tmp_path):
    train(_cfg(tmp_path, run={"steps": 10}), progress=False)
    newest = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["step"] == 10
    assert manifest["plugins"]["reference"]["distribution"] == "gemzoo"
    assert manifest["config"]["model"]["family"] == "toy"
    assert not list(newest.glob("*.pt")) and not list(newest.glob("*.pkl"))


def test_nan_loss_stops_with_a_clear_error(toy, tmp_path):
    cfg = _cfg(tmp_path, run={"steps": 5})
    trainer = Trainer(cfg, progress=False).assemble()
    with torch.no_grad():
        trainer.model.head.weight.fill_(float("nan"))
    with pytest.raises(TrainingError, match="loss is nan at step 0.*optim.lr"):
        trainer.fit()


def test_kernel_without_capability_fails_at_assembly(toy, tmp_path):
    cfg = _cfg(tmp_path, plugins={"attention": "flex"})  # flex has no backward on CPU
    with pytest.raises(PluginError, match="backward on 'cpu'.*Kernels that can: .*reference"):
        Trainer(cfg, progress=False).assemble()


@pytest.mark.parametrize("plugins", ["sdpa-padded,bf16", "reference,full-ac"])
def test_plugin_swaps_train(toy, tmp_path, plugins):
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=str(tmp_path / "run"), steps=10)
    cfg = load_config(raw=raw, plugins=plugins)
    result = train(cfg, progress=False)
    assert torch.isfinite(torch.tensor(result.final_loss))


def test_gem_on_the_plain_torch_engine_trains_sparse_and_resumes_bit_exact(tmp_path, monkeypatch):
    """Without torchrec the tables get sparse gradients from the trainer; --resume stays bit-exact."""
    from pathlib import Path

    monkeypatch.setenv("GEMZOO_NO_TORCHREC", "1")
    config = Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml"

    def cfg(out, steps):
        return load_config(config, overrides=[f"run.steps={steps}", "eval.every=0", "checkpoint.every=2",
                                              "run.device=cpu",
                                              f"run.out_dir='{tmp_path / out}'", "data.batch_size=8"])

    trainer = Trainer(cfg("a", 4), progress=False).assemble()
    assert trainer.model.sparse_arch.engine == "torch" and trainer.model.sparse_arch.ebc.sparse_grad
    full = trainer.fit()
    train(cfg("b", 2), progress=False)
    resumed = train(cfg("b", 4), resume=True, progress=False)
    assert resumed.history[0]["step"] == 3
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history[2:]]


# ------------------------------------------------------------------------- resume under a changed config
def test_resume_applies_a_changed_lr_and_says_so(toy, tmp_path, capsys):
    train(_cfg(tmp_path, run={"steps": 20}), progress=False)
    changed = _cfg(tmp_path, run={"steps": 30}, optim={"lr": 0.5})
    trainer = Trainer(changed, resume=True, progress=False).assemble()
    out = capsys.readouterr().out
    assert "changed since the checkpoint: optim.lr 0.01 -> 0.5, run.steps 20 -> 30" in out
    assert all(g["lr"] == g["base_lr"] == 0.5 for g in trainer.optimizers["dense"].param_groups)
    assert trainer.fit().history[0]["step"] == 21


@pytest.mark.parametrize("section,key,value,old", [
    ("model", "d_model", 32, 16),
    ("data", "batch_size", 4, 8),
    ("plugins", "attention", "sdpa-padded", "reference"),
    ("run", "seed", 1, 0),
])
def test_resume_refuses_a_changed_model_data_plugins_or_seed(toy, tmp_path, section, key, value, old):
    train(_cfg(tmp_path, run={"steps": 10}), progress=False)
    with pytest.raises(ConfigError) as exc:
        sections = {"run": {"steps": 20}}
        sections.setdefault(section, {})[key] = value
        Trainer(_cfg(tmp_path, **sections), resume=True, progress=False).assemble()
    assert f"{section}.{key} is {old!r} in the checkpoint, {value!r} now" in str(exc.value)
    assert "--out DIR" in str(exc.value)


def test_checkpoint_of_another_shape_names_tensor_shapes_and_keys(toy, tmp_path):
    """A checkpoint whose recorded config agrees but whose tensors do not (data-derived sizes, older code)."""
    train(_cfg(tmp_path, run={"steps": 10}), progress=False)
    newest = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["config"]["model"]["d_model"] = 32
    (newest / "manifest.json").write_text(json.dumps({**manifest, ckpt.MANIFEST_HASH: ckpt.manifest_digest(manifest)}))
    trainer = Trainer(_cfg(tmp_path, run={"steps": 20}, model={"d_model": 32}), resume=True, progress=False)
    with pytest.raises(CheckpointError, match=r"emb\.weight is \[\d+, 16\] in the checkpoint but "
                                              r"\[\d+, 32\] in this model.*agree"):
        trainer.assemble()
    del manifest["config"]
    (newest / "manifest.json").write_text(json.dumps({**manifest, ckpt.MANIFEST_HASH: ckpt.manifest_digest(manifest)}))
    with pytest.raises(CheckpointError, match=r"in this model.*records no config"):
        Trainer(_cfg(tmp_path, run={"steps": 20}, model={"d_model": 32}), resume=True, progress=False).assemble()


@pytest.mark.parametrize("signame,sync,stops_at", [("SIGTERM", "step", 3), ("SIGINT", "step", 3),
                                                   ("SIGTERM", "log", 5)])  # "log": step 3 is read at step 5
def test_a_signal_finishes_the_step_checkpoints_and_resumes_bit_exact(toy, tmp_path, signame, sync, stops_at):
    import os
    import signal

    import gemzoo
    from gemzoo.train.loop import TrainingInterrupted

    class SignalAtStep3:  # what a scheduler or Ctrl-C does, from inside the loop
        @gemzoo.hookimpl
        def gemzoo_step_end(self, trainer, step, metrics):
            if step == 3 and not trainer.resume:
                os.kill(os.getpid(), getattr(signal, signame))

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # SIG_IGN under `cmd &`
    run = {"steps": 8, "sync": sync}
    straight = train(_cfg(tmp_path / "straight", run=run), progress=False)
    toy.host().register(SignalAtStep3(), name="signal-at-step-3")
    with pytest.raises(TrainingInterrupted) as exc:
        train(_cfg(tmp_path / "stopped", run=run), progress=False)
    assert exc.value.step == stops_at and exc.value.signal_name == signame
    assert exc.value.checkpoint.name == f"step-{stops_at:08d}"  # checkpoint.every is 10: written for the signal
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the process's own handlers restored
    rows = [json.loads(l) for l in (tmp_path / "stopped" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["event"] == "interrupted" and rows[-1]["signal"] == signame
    resumed = train(_cfg(tmp_path / "stopped", run=run), resume=True, progress=False)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history[stops_at:]]


def test_sync_log_queues_the_steps_between_points_and_trains_the_same(toy, tmp_path):
    """run.sync = "log": only steps that write a row, evaluate or checkpoint wait for the device; the run is the
    same (losses bit for bit, rows at the same steps), every step reaches the history and the step-end hooks
    in order, and the steps queued together share their stretch's mean time."""
    import gemzoo

    seen = []

    class Steps:
        @gemzoo.hookimpl
        def gemzoo_step_end(self, trainer, step, metrics):
            seen.append((trainer.cfg.run.sync, step))

    toy.host().register(Steps(), name="steps")

    def rows(folder):
        lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
        return [r["step"] for r in map(json.loads, lines) if "loss" in r]

    each = train(_cfg(tmp_path / "step", run={"steps": 23, "log_every": 4}), progress=False)
    queued = train(_cfg(tmp_path / "log", run={"steps": 23, "log_every": 4, "sync": "log"}), progress=False)
    assert [h["loss"] for h in queued.history] == [h["loss"] for h in each.history]
    assert [h["step"] for h in queued.history] == list(range(1, 24))
    assert [s for m, s in seen if m == "log"] == list(range(1, 24))
    assert rows(tmp_path / "log") == rows(tmp_path / "step") == [4, 8, 10, 12, 16, 20, 23]
    times = {h["step"]: h["step_s"] for h in queued.history}
    assert times[1] == times[2] == times[3] == times[4] and times[5] == times[6] == times[7] == times[8]
    assert times[9] == times[10] and times[11] == times[12]  # eval + checkpoint at 10: a point of its own


def test_sync_log_still_stops_at_a_non_finite_loss(toy, tmp_path):
    trainer = Trainer(_cfg(tmp_path, run={"steps": 10, "sync": "log", "log_every": 10}), progress=False).assemble()
    with torch.no_grad():
        trainer.model.head.weight.fill_(float("nan"))
    with pytest.raises(TrainingError, match="loss is nan at step 0.*optim.lr"):  # the first queued step named
        trainer.fit()
    assert not ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")  # read before step 10's checkpoint


def test_checkpoint_files_get_the_manifest_mode(toy, tmp_path):
    """safetensors writes 0600; every file of a checkpoint gets what the umask gives the manifest."""
    train(_cfg(tmp_path, run={"steps": 10}), progress=False)
    newest = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    want = (newest / "manifest.json").stat().st_mode & 0o777
    assert {p.name: p.stat().st_mode & 0o777 for p in newest.iterdir()} == {p.name: want for p in newest.iterdir()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_gem_with_sparse_table_gradients_trains_on_cuda(tmp_path, monkeypatch):
    """run.compile on the plain-torch tables (sparse gradients): Inductor on CUDA cannot take sparse tensors,
    so the lookup stays eager and the dense rest compiles."""
    from pathlib import Path

    monkeypatch.setenv("GEMZOO_NO_TORCHREC", "1")
    config = Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml"
    cfg = load_config(config, plugins="jfa,bf16", overrides=["run.steps=2", "eval.every=0", "checkpoint.every=0",
                                                             "model.num_layers=1",  # Inductor's compile time
                                                             "run.compile=true", "run.device=cuda",
                                                             f"run.out_dir='{tmp_path / 'run'}'"])
    trainer = Trainer(cfg, progress=False).assemble()
    assert trainer.model.sparse_arch.ebc.sparse_grad
    assert torch.isfinite(torch.tensor(trainer.fit().final_loss))


_GEM_TINY = Path(__file__).resolve().parents[1] / "configs" / "gem-tiny.toml"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gem_step_queues_on_cuda_without_a_host_sync(tmp_path, monkeypatch):
    """``launch_step`` on one GPU reads nothing back from the device, so with run.sync = "log" the host runs
    ahead of it (the profile's idle GPU time): torch's sync debug mode turns any synchronizing call into an error.
    gem with jfa and bf16 on the plain-torch tables (sparse gradients, SparseAdagrad), clipping on."""
    import math

    monkeypatch.setenv("GEMZOO_NO_TORCHREC", "1")
    cfg = load_config(_GEM_TINY, plugins="jfa,bf16", overrides=[
        "run.steps=4", "eval.every=0", "checkpoint.every=0", "run.device=cuda", "run.sync='log'",
        f"run.out_dir='{tmp_path / 'run'}'"])
    trainer = Trainer(cfg, progress=False).assemble()
    with trainer.lookahead:
        for step in (0, 1):  # first calls tune kernels and fill caches; step 2's batch is prefetched, pinned
            trainer.train_step(step)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = trainer.launch_step(2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        metrics = trainer.finish_steps([launched], 1.0)[0]
    assert math.isfinite(metrics["loss"])


def _compiled_gem_tiny(tmp_path, layers: int, scope: str):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = load_config(_GEM_TINY, plugins="cpu,fp32", overrides=[
        "run.steps=2", "eval.every=0", "checkpoint.every=0", f"model.num_layers={layers}", "run.compile=true",
        f"run.compile_scope='{scope}'", "run.device=cpu", f"run.out_dir='{tmp_path / f'{scope}{layers}'}'"])
    trainer = Trainer(cfg, progress=False).assemble()
    loss = trainer.fit().final_loss
    return trainer, loss, counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_regional_compile_shares_one_graph_across_blocks(tmp_path):
    """run.compile_scope = "blocks": each block's forward is compiled in place (names and hooks unchanged), and a
    deeper model compiles no more graphs (the blocks share them); the loss is the eager one."""
    trainer, loss1, graphs1 = _compiled_gem_tiny(tmp_path, 1, "blocks")
    blocks = trainer.model.transformer_blocks()
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks)
    assert trainer.forward is trainer.model
    _, loss3, graphs3 = _compiled_gem_tiny(tmp_path, 3, "blocks")
    assert graphs3 == graphs1 > 0
    eager = load_config(_GEM_TINY, plugins="cpu,fp32", overrides=[
        "run.steps=2", "eval.every=0", "checkpoint.every=0", "model.num_layers=1", "run.device=cpu",
        f"run.out_dir='{tmp_path / 'eager'}'"])
    assert loss1 == pytest.approx(train(eager, progress=False).final_loss, rel=1e-5)


def test_a_run_sets_its_fp32_matmul_precision(toy, tmp_path):
    """run.matmul_precision reaches torch (and through it gemzoo's Triton kernels, whose fp32 dots follow it)."""
    before = torch.get_float32_matmul_precision()
    try:
        train(_cfg(tmp_path, run={"steps": 2, "matmul_precision": "high"}), progress=False)
        assert torch.get_float32_matmul_precision() == "high"
        train(_cfg(tmp_path / "b", run={"steps": 2}), progress=False)
        assert torch.get_float32_matmul_precision() == "highest"  # the default, torch's own
    finally:
        torch.set_float32_matmul_precision(before)
