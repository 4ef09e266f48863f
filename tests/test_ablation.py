"""Ablation files (configs/ablations/*.toml) and bench/e2e.py, which runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemzoo.config import load_ablation
from gemzoo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ABLATIONS = sorted((ROOT / "configs" / "ablations").glob("*.toml"))


@pytest.mark.parametrize("path", ABLATIONS, ids=lambda p: p.stem)
def test_shipped_ablations_validate(path):
    ablation = load_ablation(path)
    assert ablation.runs and Path(ablation.config).is_file()


def test_unknown_key_and_unknown_plugin(tmp_path):
    bad = tmp_path / "a.toml"
    bad.write_text('config = "configs/gem-tiny.toml"\nruns = ["cpu,fp32"]\nstep = 3\n')
    with pytest.raises(ConfigError, match="unknown key ablation.step.*Did you mean ablation.steps"):
        load_ablation(bad)
    bad.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\nruns = ["cpu,fp32", "cpu,fp9"]\n')
    with pytest.raises(ConfigError, match="run 'cpu,fp9'.*fp9"):
        load_ablation(bad)
    bad.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\nruns = []\n')
    with pytest.raises(ConfigError, match="runs is empty"):
        load_ablation(bad)


def test_e2e_runs_an_ablation(tmp_path):
    ablation = tmp_path / "tiny.toml"
    ablation.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\nruns = ["cpu,fp32", "cpu,bf16"]\n'
                        'steps = 3\nwarmup = 1\nset = ["data.batch_size=8"]\n')
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--ablation", str(ablation),
                           "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["plugins"] for r in rows] == ["cpu,fp32", "cpu,bf16"]
    assert all(r["steps"] == 3 and r["samples_per_s"] > 0 for r in rows)
    assert "vs first" in proc.stdout
