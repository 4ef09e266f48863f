"""Kill ``gemzoo train`` mid-run, rerun with --resume: the final loss equals an uninterrupted run's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24
SMALL = ["--set", f"run.steps={STEPS}", "--set", "checkpoint.every=6", "--set", "eval.every=12",
         "--set", "eval.batches=2", "--set", "run.log_every=6"]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gemzoo.cli", "train", "--config", str(ROOT / "configs" / "gem-tiny.toml"),
            "--out", str(out), "--quiet", *SMALL, *extra]


def _final(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = subprocess.run(_cmd(tmp_path / "full"), capture_output=True, text=True, env=env, timeout=600)
    assert full.returncode == 0, full.stderr[-2000:]

    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step-00000012").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    resumed = subprocess.run(_cmd(out, "--resume"), capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    assert _final(resumed.stdout)["final_loss"] == _final(full.stdout)["final_loss"]
