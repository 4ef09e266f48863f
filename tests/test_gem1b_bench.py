"""bench/fp8_gem1b.py: its --smoke path trains a tiny GEM per precision on the CPU and writes the JSON and table."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from gemzoo.api import registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fp8_gem1b", ROOT / "bench" / "fp8_gem1b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_rows_json_and_table(bench, tmp_path, monkeypatch):
    if not {"jfa"} <= set(registry.names("attention")) or "fp8-tensorwise" not in registry.names("precision"):
        pytest.skip("needs plugins/gemzoo-jfa and plugins/gemzoo-mxfp8")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    rc = bench.main(["--smoke", "--out", str(out), "--rows", "bf16,fp8-tensorwise", "--steps", "2", "--warmup", "1",
                     "--profile", "1"])
    assert rc == 0
    data = json.loads((out / "fp8_gem1b.json").read_text())
    assert data["smoke"] and data["steps"] == 2 and data["warmup"] == 1
    rows = {r["precision"]: r for r in data["rows"]}
    assert list(rows) == ["bf16", "fp8-tensorwise"]
    for r in rows.values():
        assert r["status"] == "ok" and r["finite"] and len(r["losses"]) == 3
        assert r["mean_samples_per_s"] > 0 and r["mean_mfu"] > 0 and r["max_step_s"] >= r["median_step_s"] > 0
        assert r["profile"]["steps"] == 1 and r["profile"]["groups_ms"]["gemm"] > 0
        assert r["profile"]["step_ms"] > 0 and r["profile"]["idle"] == {}  # GPU idle: CUDA only
        assert r["profile"]["tokens"] > 0 and r["profile"]["tflops"] > 0
    fp8 = rows["fp8-tensorwise"]
    assert fp8["vs_bf16"] == pytest.approx(fp8["mean_samples_per_s"] / rows["bf16"]["mean_samples_per_s"])
    assert fp8["loss_within_1pct"], fp8["loss_vs_bf16"]  # the same batches from the same seed, two steps in
    assert fp8["profile"]["groups_ms"]["cast / amax"] > 0
    table = (out / "fp8_gem1b.md").read_text()
    assert "| precision | samples/s | vs bf16 | MFU |" in table and "| `fp8-tensorwise` |" in table
    assert "GEMM ms | cast/amax ms" in table and "| GPU idle ms | profiled TFLOP/s |" in table and " | n/a |" in table


def test_kernel_groups(bench):
    assert bench.group_of("sm90_xmma_gemm_e4m3e4m3_bf16_f32_tn_n_tilesize128x128x64") == "gemm"
    assert bench.group_of("nvjet_qqtst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert bench.group_of("triton_red_fused_abs_amax_clamp_min_0") == "cast / amax"
    assert bench.group_of("triton_poi_fused__to_copy_clamp_mul_reciprocal_1") == "cast / amax"
    assert bench.group_of("_mx_cast_kernel") == "cast / amax"
    assert bench.group_of("_jfa_fwd_kernel") == "attention"
    assert bench.group_of("aten::_scaled_mm") == "gemm" and bench.group_of("aten::amax") == "cast / amax"
    assert bench.group_of("triton_poi_fused_add_gelu_2") == "other"


def test_bad_arguments(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--out", str(tmp_path), "--rows", "bf16,fp9"])
    assert "fp9" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.main(["--out", str(tmp_path)])
        assert "no CUDA device" in capsys.readouterr().err
