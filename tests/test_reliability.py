"""Reliability in one process: the run-folder lock, finite checkpoints, one config schema for validate and
train, clear errors for bad files and plugins, and what a resume drops. The cases that need a second process
(SIGKILL, two trainers at once) are in test_faults.py."""

import copy
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_dists import make_dist
from toy_plugin import TOY_CONFIG

import gemzoo
from gemzoo.cli import main
from gemzoo.config import load_config
from gemzoo.errors import CheckpointError, ConfigError, PluginError
from gemzoo.train import checkpoint as ckpt
from gemzoo.train import run_folder
from gemzoo.train.trainer import Trainer, train

ROOT = Path(__file__).resolve().parents[1]
GEM_TINY = str(ROOT / "configs" / "gem-tiny.toml")


def _cfg(out, checkpoint=None, **run):
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=str(out), **run)
    raw["checkpoint"].update(checkpoint or {})
    return load_config(raw=raw)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _steps(out):
    return [p.name for p in ckpt.list_checkpoints(out / "checkpoints")]


# ------------------------------------------------------------------------------ 1: one trainer a run folder
def test_a_second_trainer_is_refused_naming_the_holders_pid_and_host(toy, tmp_path):
    out = tmp_path / "run"
    held = run_folder.RunLock.acquire(out)  # as a trainer running in another process holds it
    try:
        with pytest.raises(run_folder.RunFolderBusy, match=rf"in use.*PID {os.getpid()} on host "
                                                           rf"{socket.gethostname()}.*--out DIR"):
            train(_cfg(out, steps=5), progress=False)
        with pytest.raises(run_folder.RunFolderBusy, match="in use"):  # --resume and --overwrite too
            train(_cfg(out, steps=5), progress=False, overwrite=True)
    finally:
        held.release()
    assert sorted(p.name for p in out.iterdir()) == [run_folder.LOCK]  # nothing written by the refused ones


def test_only_rank_zero_takes_the_lock(toy, tmp_path, monkeypatch):
    """Under torchrun (RANK set) the other ranks do not lock; they wait for rank 0 at the first barrier."""
    out = tmp_path / "run"
    held = run_folder.RunLock.acquire(out)
    try:
        monkeypatch.setenv("RANK", "1")
        trainer = Trainer(_cfg(out, steps=5), progress=False).assemble()  # one process: no barrier to wait at
        assert trainer.lock is None
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(run_folder.RunFolderBusy):
            Trainer(_cfg(out, steps=5), progress=False).assemble()
    finally:
        held.release()


def test_the_lock_is_released_when_a_run_ends_or_its_process_is_killed(toy, tmp_path):
    out = tmp_path / "run"
    code = ("import os, signal, sys; from gemzoo.train.run_folder import RunLock; RunLock.acquire(sys.argv[1]); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", code, str(out)], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert (out / run_folder.LOCK).is_file()  # the file stays; the lock went with the process
    train(_cfg(out, steps=10), progress=False)  # a left-over lock file does not make the folder "not empty"
    run_folder.RunLock.acquire(out).release()  # train released it when it returned
    train(_cfg(out, steps=20), resume=True, progress=False)
    assert _steps(out) == ["step-00000010", "step-00000020"]


def test_an_output_folder_that_cannot_be_written_is_a_clear_error(toy, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"cannot write to run folder .*a-file/run.*writable folder with --out"):
        train(_cfg(blocker / "run", steps=5), progress=False)
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(run_folder.LOCK):
            raise PermissionError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(run_folder.os, "open", read_only)
    with pytest.raises(ConfigError, match="cannot write to run folder .*Read-only file system"):
        train(_cfg(tmp_path / "ro", steps=5), progress=False)


# ------------------------------------------------------------------------------ 2: finite checkpoints only
class _Poison:
    """A step-end hook that writes a non-finite value into the state after step ``at``."""

    def __init__(self, at, where):
        self.at, self.where = at, where

    @gemzoo.hookimpl
    def gemzoo_step_end(self, trainer, step, metrics):
        if step != self.at:
            return
        with torch.no_grad():
            if self.where == "parameter":
                next(trainer.model.parameters()).view(-1)[0] = float("nan")
            else:
                state = next(iter(trainer.optimizers["dense"].state.values()))
                state["exp_avg_sq"].view(-1)[0] = float("inf")


@pytest.mark.parametrize("where,named", [("parameter", "model."), ("optimizer", "optim-dense.")])
def test_finite_loss_but_non_finite_state_commits_no_checkpoint(toy, tmp_path, where, named):
    out = tmp_path / "run"
    poison = _Poison(20, where)
    toy.host().pm.register(poison)
    try:
        with pytest.raises(ckpt.NonFiniteState) as exc:
            train(_cfg(out, steps=30), progress=False)
    finally:
        toy.host().pm.unregister(poison)
    message = str(exc.value)
    assert "step 20: 1 of " in message and named in message and "NaN or infinity" in message
    assert "step-00000010" in message and "--resume" in message  # the last finite checkpoint, by name
    assert _steps(out) == ["step-00000010"]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    resumed = train(_cfg(out, steps=30), resume=True, progress=False)  # following the advice works
    assert resumed.history[0]["step"] == 11 and _steps(out) == ["step-00000020", "step-00000030"]


def test_save_checkpoint_refuses_non_finite_tensors_and_writes_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    good = {"w": torch.ones(3), "steps": torch.arange(3)}
    ckpt.save_checkpoint(root, 1, model_state=good, optimizers={}, manifest={})
    bad = {"w": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16), "steps": torch.arange(3)}
    with pytest.raises(ckpt.NonFiniteState, match=r"step 2: 1 of 1 tensors .*model.w.*step-00000001"):
        ckpt.save_checkpoint(root, 2, model_state=bad, optimizers={}, manifest={})
    optim = {"state": {0: {"exp_avg": torch.tensor([float("-inf")]), "step": torch.tensor(2.0)}},
             "param_groups": [{"params": [0]}]}
    with pytest.raises(ckpt.NonFiniteState, match=r"optim-dense.0.exp_avg"):
        ckpt.save_checkpoint(root, 2, model_state=good, optimizers={"dense": optim}, manifest={})
    assert [p.name for p in root.iterdir()] == ["step-00000001"]


def test_a_nan_loss_names_the_last_finite_checkpoint(toy, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(_cfg(out, steps=30), progress=False).assemble()
    poison = _Poison(11, "parameter")  # after step 10's checkpoint: the next step's loss is NaN
    toy.host().pm.register(poison)
    try:
        with pytest.raises(gemzoo.errors.TrainingError, match=r"loss is nan at step 11.*step-00000010.*--resume"):
            trainer.fit()
    finally:
        toy.host().pm.unregister(poison)
        trainer.release()


# ------------------------------------------------------------------------------ 3: one schema, two commands
BAD_SETTINGS = {
    "betas-too-short": (["optim.betas=[0.9]"], "optim.betas must list 2 value"),
    "beta-out-of-range": (["optim.betas=[1.5, 0.9]"], r"optim.betas\[0\] must be in \[0, 1\)"),
    "mlp-dims-not-ints": (["model.mlp_dims=['a']"], r"model.mlp_dims\[0\] must be int"),
    "mlp-dims-empty": (["model.mlp_dims=[]"], "model.mlp_dims must list at least 1"),
    "dropout-above-one": (["model.dropout=1.5"], r"model.dropout must be in \[0, 1\)"),
    "init-std-nan": (["model.embedding_init_std=nan"], "model.embedding_init_std must be a finite number"),
    "lr-infinite": (["optim.lr=inf"], "optim.lr must be a finite number"),
    "median-above-max": (["data.median_len=1000", "data.max_len=8"], "median_len <= max_len"),
}


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_config_validate_refuses_what_train_refuses_with_the_same_message(fresh_registry, tmp_path, capsys, case):
    settings, message = BAD_SETTINGS[case]
    sets = [a for s in settings for a in ("--set", s)]
    errors = []
    for argv in (["config", "validate", GEM_TINY, *sets],
                 ["train", "--config", GEM_TINY, *sets, "--out", str(tmp_path / "run"), "--quiet"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        errors.append([line for line in err.splitlines() if line.startswith("gemzoo: error:")])
    assert errors[0] == errors[1] and len(errors[0]) == 1
    assert pytest.importorskip("re").search(message, errors[0][0]), errors[0][0]
    assert not (tmp_path / "run").exists()  # refused before the run folder was touched


def test_a_config_file_that_is_not_utf8_is_a_clear_error(fresh_registry, tmp_path, capsys):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(Path(GEM_TINY).read_bytes() + '\n# caf\u00e9\n'.encode("latin-1"))
    for argv in (["config", "validate", str(bad)], ["train", "--config", str(bad), "--out", str(tmp_path / "r")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is not UTF-8 text" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ 4: bad environment and files
def test_disk_full_while_writing_a_checkpoint_keeps_the_last_good_one(toy, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(_cfg(out, steps=10), progress=False)
    real = ckpt.save_file
    calls = []

    def full_disk(tensors, path):
        calls.append(path)
        if len(calls) == 2:  # the second file of step 20's checkpoint
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(tensors, path)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(CheckpointError, match=r"step 20 .*No space left on device \(the disk is full.*atomic.*"
                                              r"step-00000010, is kept"):
        train(_cfg(out, steps=30), resume=True, progress=False)
    assert _steps(out) == ["step-00000010"] and not list((out / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(ckpt, "save_file", real)
    full = train(_cfg(tmp_path / "full", steps=30), progress=False)
    resumed = train(_cfg(out, steps=30), resume=True, progress=False)  # nothing lost: it resumes bit-exact
    assert resumed.final_loss == full.final_loss
    steps = [r["step"] for r in _rows(out) if "event" not in r]
    assert steps == sorted(set(steps))


def test_binary_junk_metrics_on_resume_is_dropped_and_named(toy, tmp_path, capsys):
    out = tmp_path / "run"
    train(_cfg(out, steps=20), progress=False)
    good = (out / "metrics.jsonl").read_bytes()
    (out / "metrics.jsonl").write_bytes(good + bytes(range(256)) * 8 + b'\n{"step": 25, "loss"')
    capsys.readouterr()
    train(_cfg(out, steps=30), resume=True, progress=False)
    said = capsys.readouterr().out
    assert "dropped from metrics.jsonl" in said and "not UTF-8 text" in said and "not JSON (cut short" in said
    rows = _rows(out)  # valid JSON again, every step once
    steps = [r["step"] for r in rows if "event" not in r]
    assert steps == [5, 10, 15, 20, 25, 30]


def test_resume_names_the_superseded_rows(toy, tmp_path, capsys):
    out = tmp_path / "run"
    train(_cfg(out, steps=25, log_every=5), progress=False)  # checkpoints 20, 25
    shutil.rmtree(out / "checkpoints" / "step-00000025")  # killed before step 25's checkpoint was in place
    capsys.readouterr()
    train(_cfg(out, steps=25), resume=True, progress=False)
    said = capsys.readouterr().out
    # the step-25 row and the end event
    assert "dropped from metrics.jsonl: 2 row(s) (lines 6-7)" in said and "after step 20, where the run resumes" in said


def _checkpoints_of_a_run(out):
    train(_cfg(out, steps=20), progress=False)
    return ckpt.list_checkpoints(out / "checkpoints")


def _rewrite_manifest(folder, change, rehash):
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    if rehash:
        manifest[ckpt.MANIFEST_HASH] = ckpt.manifest_digest(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_an_edited_manifest_fails_its_own_hash(toy, tmp_path):
    older, newest = _checkpoints_of_a_run(tmp_path / "run")
    _rewrite_manifest(newest, lambda m: m["optimizers"]["dense"].update(param_groups=[]), rehash=False)
    with pytest.raises(CheckpointError, match="manifest.json fails its own SHA-256 check"):
        ckpt.load_checkpoint(newest)
    with pytest.warns(RuntimeWarning, match="skipping unusable checkpoint"):
        assert ckpt.load_latest(tmp_path / "run" / "checkpoints")["path"] == older


@pytest.mark.parametrize("groups", [[], [{"params": [0]}] * 3, [{"params": "x"}]])
def test_param_groups_of_the_wrong_shape_are_a_checkpoint_error(toy, tmp_path, groups):
    out = tmp_path / "run"
    newest = _checkpoints_of_a_run(out)[-1]
    _rewrite_manifest(newest, lambda m: m["optimizers"]["dense"].update(param_groups=groups), rehash=True)
    with pytest.raises(CheckpointError, match=r"optimizer 'dense' does not fit this run's"):
        train(_cfg(out, steps=30), resume=str(newest), progress=False)


def test_a_file_that_is_not_safetensors_says_so(toy, tmp_path):
    newest = _checkpoints_of_a_run(tmp_path / "run")[-1]
    model = newest / "model.safetensors"
    model.write_bytes(b"\x80\x04\x95" + b"pickle payload " * 40)  # a pickle's opening bytes
    digest = ckpt._sha256(model)

    def point_at_it(m):
        m["files"]["model.safetensors"] = {"bytes": model.stat().st_size, "sha256": digest}

    _rewrite_manifest(newest, point_at_it, rehash=True)
    with pytest.raises(CheckpointError, match="model.safetensors is not a safetensors file"):
        ckpt.load_checkpoint(newest)


NOT_A_KERNEL = """
import gemzoo

def attend(q, k, v, offsets):
    return q

@gemzoo.hookimpl
def gemzoo_register_attention(register):
    register("not-a-kernel", attend)
"""


def test_a_plugin_registering_a_non_kernel_fails_to_load(tmp_path, fresh_registry, monkeypatch):
    make_dist(monkeypatch, tmp_path, "gemzoo-odd", "gemzoo_odd_mod", NOT_A_KERNEL, "odd")
    fresh_registry.reset()
    assert "not-a-kernel" not in fresh_registry.names("attention")
    error = fresh_registry.host().failed()["odd"].error
    assert "AttentionKernel" in error and "lacks capabilities" in error
    with pytest.raises(PluginError, match="gemzoo-odd.*AttentionKernel"):
        fresh_registry.get("attention", "not-a-kernel")


# ------------------------------------------------------------------------------ 5: plugins that exit
@pytest.mark.parametrize("code,name", [("import sys\nsys.exit(0)\n", "SystemExit"),
                                       ("raise KeyboardInterrupt\n", "KeyboardInterrupt")])
def test_a_plugin_that_exits_at_import_is_a_load_failure(tmp_path, fresh_registry, monkeypatch, code, name):
    make_dist(monkeypatch, tmp_path, "gemzoo-quits", "gemzoo_quits_mod", code, "quits")
    fresh_registry.reset()
    assert "reference" in fresh_registry.names("attention")  # the process and the other plugins go on
    assert fresh_registry.host().failed()["quits"].error.startswith(name)


def test_train_warns_once_for_each_plugin_that_failed_to_load(tmp_path, fresh_registry, monkeypatch, capsys):
    make_dist(monkeypatch, tmp_path / "a", "gemzoo-quits", "gemzoo_quits_mod", "import sys\nsys.exit(0)\n", "quits")
    make_dist(monkeypatch, tmp_path / "b", "gemzoo-odd", "gemzoo_odd_mod", NOT_A_KERNEL, "odd")
    fresh_registry.reset()
    argv = ["train", "--config", GEM_TINY, "--steps", "1", "--set", "eval.every=0", "--set", "checkpoint.every=0",
            "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "failed to load" in line]
    assert len(warnings) == 2
    assert any("'quits' (gemzoo-quits)" in w and "SystemExit" in w for w in warnings)
    assert any("'odd' (gemzoo-odd)" in w for w in warnings)


# ------------------------------------------------------------------------------ 6: checkpoint.keep = 0
def test_keep_zero_keeps_every_checkpoint(toy, tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, {"every": 5, "keep": 0}, steps=20), progress=False)
    assert _steps(out) == [f"step-{s:08d}" for s in (5, 10, 15, 20)]
