"""Fault injection on ``gemzoo train`` (gem-tiny, CPU): SIGKILL inside the checkpoint write window and at
seeded random moments, two trainers into one folder, NaN, and a full disk. Each case ends in a bit-exact
resume (the final loss and the final checkpoint's SHA-256 equal an uninterrupted run's, every metrics row
once) or a clear refusal that loses nothing."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemzoo.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 18
SMALL = ["--set", f"run.steps={STEPS}", "--set", "checkpoint.every=6", "--set", "checkpoint.keep=0",
         "--set", "eval.every=0", "--set", "run.log_every=1", "--set", "run.device=cpu"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gemzoo.cli", "train", "--config", str(ROOT / "configs" / "gem-tiny.toml"),
            "--out", str(out), "--quiet", *SMALL, *extra]


def _run(cmd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, timeout=600)


def _final_loss(stdout: str) -> float:
    return json.loads(stdout.strip().splitlines()[-1])["final_loss"]


def _model_sha(out: Path) -> str:
    return json.loads((out / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").read_text())[
        "files"]["model.safetensors"]["sha256"]


def _step_rows(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # every line JSON
    return [r["step"] for r in rows if "event" not in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: (final loss, final checkpoint's model SHA-256)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    done = _run(_cmd(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return _final_loss(done.stdout), _model_sha(out)


def _assert_resumes_bit_exact(out: Path, reference) -> subprocess.CompletedProcess:
    resumed = _run(_cmd(out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (_final_loss(resumed.stdout), _model_sha(out)) == reference
    assert _step_rows(out) == list(range(1, STEPS + 1))  # every row once, in order: nothing lost or doubled
    assert not list((out / "checkpoints").glob(".tmp-step-*"))
    return resumed


def _wait_for(predicate, proc, what: str, limit: float = 300) -> None:
    deadline = time.time() + limit
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_sigkill_inside_the_checkpoint_write_window(tmp_path, reference):
    """Killed after step 12's tensor files, before its manifest: step 12 is not committed, step 6 is."""
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**ENV, ckpt.PAUSE_ENV: "60"})

    def in_window() -> bool:
        tmp = list((out / "checkpoints").glob(".tmp-step-00000012-*"))
        return bool(tmp) and (tmp[0] / "rng.safetensors").is_file() and not (tmp[0] / "manifest.json").exists()

    _wait_for(in_window, proc, "step 12's write window")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step-00000006"]
    resumed = _assert_resumes_bit_exact(out, reference)
    assert "resumed from" in resumed.stdout and "step-00000006" in resumed.stdout


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_a_random_moment(tmp_path, reference, seed):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    _wait_for(lambda: (out / "metrics.jsonl").is_file(), proc, "the first metrics row")
    time.sleep(random.Random(seed).uniform(0.0, 1.5))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    _assert_resumes_bit_exact(out, reference)


def test_two_trainers_into_one_folder(tmp_path, reference):
    out = tmp_path / "run"
    procs = [subprocess.Popen(_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for _ in range(2)]
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [err[-1000:] for _, _, err in results]
    (winner, won, _), (loser, _, refused) = sorted(results, key=lambda r: r[0].returncode)
    assert f"in use: a trainer holds its lock, PID {winner.pid} on host" in refused, refused[-1000:]
    assert "Traceback" not in refused
    assert (_final_loss(won), _model_sha(out)) == reference  # the run that trained is intact
    assert _step_rows(out) == list(range(1, STEPS + 1))


def test_nan_stops_without_a_non_finite_checkpoint_and_resumes(tmp_path):
    out = tmp_path / "run"
    diverging = ["--set", "optim.lr=1e3", "--set", "optim.grad_clip=0", "--set", "checkpoint.every=1"]
    stopped = _run(_cmd(out, *diverging))
    assert stopped.returncode == 2 and "Traceback" not in stopped.stderr
    assert "NaN or infinity" in stopped.stderr or "loss is nan" in stopped.stderr, stopped.stderr[-2000:]
    committed = ckpt.list_checkpoints(out / "checkpoints")
    assert str(committed[-1]) in stopped.stderr  # the message names the last finite checkpoint
    for path in committed:
        state = ckpt.load_checkpoint(path)
        tensors = {**state["model"], **{f"{n}.{k}": v for n, o in state["optimizers"].items()
                                        for s in o["state"].values() for k, v in s.items()}}
        assert ckpt.nonfinite_tensors(tensors) == [], path
    # the advice resumes: the checkpoint loads; this run's lr of 1e3 left parameters so large (finite) that
    # the next loss is NaN again, which stops as clearly, and the rows stay valid JSON, each step once
    resumed = _run(_cmd(out, "--resume", *diverging))
    assert f"resumed from {committed[-1]}" in resumed.stdout, resumed.stderr[-2000:]
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr
    steps = _step_rows(out)
    assert steps == sorted(set(steps))


DISK_FULL = """
import errno, sys
from gemzoo.train import checkpoint
real, calls = checkpoint.save_file, []
def save_file(tensors, path):
    calls.append(path)
    if len(calls) == 6:  # the second checkpoint (step 12), its second file
        raise OSError(errno.ENOSPC, "No space left on device", path)
    return real(tensors, path)
checkpoint.save_file = save_file
from gemzoo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_disk_full_while_writing_a_checkpoint(tmp_path, reference):
    out = tmp_path / "run"
    full = _run([sys.executable, "-c", DISK_FULL, *_cmd(out)[3:]])
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-2000:]
    assert "No space left on device" in full.stderr and "The write is atomic" in full.stderr
    assert "step-00000006, is kept" in full.stderr
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step-00000006"]
    assert not list((out / "checkpoints").glob(".tmp-step-*"))
    _assert_resumes_bit_exact(out, reference)
