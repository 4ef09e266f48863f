"""A run's throughput over wall-clock time after warm-up, and metrics rows that report their own steps."""

import json

import pytest

from gemzoo.api import load_config, train
from gemzoo.train.metrics import Throughput, stretch_metrics


def _step(seconds: float, samples: int = 64, flops: float = 1e12, peak: float = 1e15) -> dict[str, float]:
    return {"step_s": seconds, "samples_per_s": samples / seconds, "tokens_per_s": 10 * samples / seconds,
            "tflops": flops / seconds / 1e12, "mfu": flops / seconds / peak}


def test_mean_is_total_work_over_total_time_after_warm_up():
    t = Throughput(warmup=2)
    for s in (9.0, 5.0):  # compiles: left out
        t.add(_step(s))
    assert t.warmed_up and t.summary() == {}
    for s in (0.1, 0.1, 0.1, 1.7):  # one stall: the mean sees it, a median would not
        t.add(_step(s))
    out = t.summary()
    assert out["measured_steps"] == 4 and out["warmup_steps"] == 2
    assert out["mean_samples_per_s"] == pytest.approx(4 * 64 / 2.0)
    assert out["mean_tflops"] == pytest.approx(4 * 1.0 / 2.0)
    assert out["mean_mfu"] == pytest.approx(4e12 / 2.0 / 1e15)
    assert out["max_step_s"] == pytest.approx(1.7) and out["median_step_s"] == pytest.approx(0.1)
    assert out["mean_step_s"] == pytest.approx(2.0 / 4)


def test_a_row_standing_for_several_steps_reports_their_work_over_their_time():
    steps = [_step(0.5, samples=10), _step(1.5, samples=30)]
    row = stretch_metrics(steps)
    assert row["samples_per_s"] == pytest.approx(40 / 2.0) and row["step_s"] == pytest.approx(1.0)
    assert stretch_metrics([]) == {}


@pytest.mark.parametrize("sync", ["step", "log"])
def test_a_run_reports_means_consistent_with_its_metrics_rows(tmp_path, sync):
    cfg = load_config("configs/gem-tiny.toml", plugins="cpu,fp32",
                      overrides=["run.steps=8", "run.log_every=2", "run.warmup=2", f"run.sync='{sync}'",
                                 "data.batch_size=8", "eval.every=0", "checkpoint.every=0", "run.device=cpu"])
    result = train(cfg, out_dir=tmp_path / "run", progress=False)
    out = result.throughput
    assert out["measured_steps"] == 6 and out["compiles_after_warmup"] == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_s" in r and r["step"] > 2]  # rows at steps 4, 6, 8: two steps each
    assert [r["step"] for r in steps] == [4, 6, 8]
    seconds = sum(2 * r["step_s"] for r in steps)
    samples = sum(2 * r["step_s"] * r["samples_per_s"] for r in steps)
    assert out["mean_samples_per_s"] == pytest.approx(samples / seconds, rel=1e-9)
    assert all(r["compiles_after_warmup"] == 0 for r in steps)
    end = rows[-1]
    assert end["event"] == "end" and end["mean_mfu"] == pytest.approx(out["mean_mfu"])
