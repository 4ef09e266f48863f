"""``gemzoo plan``'s step time and MFU at several worlds: a one-GPU profile (a run folder's measured step, or
--step-s / --mfu) plus the layout's communication less the overlapped part; world 1 gives the measured step
back, exactly; bad input is named."""

from __future__ import annotations

import json
import shutil

import pytest
import sharding_2d_cases as cases
from gemzoo_sharding_2d.scale import (
    Links,
    Profile,
    describe_config,
    group_for,
    parse_bytes,
    plan_report,
    profile_from_run,
    step_time,
)

from gemzoo.api import ConfigError, load_config
from gemzoo.testing import cli_main as main


def _cfg(tmp_path):
    return load_config(cases.CONFIG, overrides=cases.overrides(str(tmp_path / "unused"), 5))


def _fake_run(folder, rows, config=cases.CONFIG):
    """A run folder as gemzoo train leaves it, with the given metrics rows (config.toml: gem-tiny's, batch 64)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, folder / "config.toml")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


START = {"event": "start", "step": 0, "world_size": 1, "peak_flops": 989e12}


def test_the_step_is_compute_plus_the_communication_not_overlapped():
    layout = {"world": 16, "seconds": {"total": 0.05}}
    prof = Profile(step_s=0.2, flops=80e12, batch=64, peak_flops=1e15, source="test")
    assert prof.mfu == pytest.approx(0.4)
    serial = step_time(layout, prof, 64, overlap=0.0)
    assert serial["step_s"] == pytest.approx(0.25) and serial["exposed_comm_s"] == pytest.approx(0.05)
    assert serial["samples_per_s"] == pytest.approx(16 * 64 / 0.25) and serial["mfu"] == pytest.approx(0.4 * 0.2 / 0.25)
    assert step_time(layout, prof, 64, overlap=0.6)["step_s"] == pytest.approx(0.2 + 0.05 * 0.4)
    assert step_time(layout, prof, 64, overlap=1.0)["step_s"] == pytest.approx(0.2)
    # communication longer than the compute can hide at most the compute
    slow = step_time({"world": 16, "seconds": {"total": 0.5}}, prof, 64, overlap=1.0)
    assert slow["step_s"] == pytest.approx(0.5) and slow["scaling_efficiency"] == pytest.approx(0.4)
    # half the batch a rank: half the compute and the FLOPs, the same MFU without communication
    half = step_time({"world": 2, "seconds": {"total": 0.0}}, prof, 32, overlap=0.0)
    assert half["compute_s"] == pytest.approx(0.1) and half["mfu"] == pytest.approx(prof.mfu)
    with pytest.raises(ConfigError, match=r"--overlap .* in \[0, 1\]; got 1.5"):
        step_time(layout, prof, 64, overlap=1.5)
    with pytest.raises(ConfigError, match="step_s must be a positive number"):
        Profile(step_s=0.0, flops=1.0, batch=1, peak_flops=1.0, source="test")


@pytest.mark.slow
def test_world_1_reproduces_a_measured_run_and_more_ranks_add_communication(tmp_path):
    """A real (short) one-process run of the test config: its end event's mean step and MFU come back at world 1,
    exactly; at 4 and 16 ranks the step grows by the layout's communication time."""
    from gemzoo.api import train

    out = tmp_path / "run"
    cfg = load_config(cases.CONFIG, overrides=[*cases.overrides(str(out), 6), "run.peak_tflops=0.5"])
    train(cfg, progress=False)
    end = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "end" and end["mean_step_s"] > 0
    prof, config = profile_from_run(out)
    assert config == str(out / "config.toml") and prof.batch == cases.BATCH
    assert prof.step_s == end["mean_step_s"] and prof.peak_flops == pytest.approx(0.5e12)
    assert prof.mfu == pytest.approx(end["mean_mfu"], rel=1e-12)
    desc = describe_config(load_config(config))
    reports = {w: plan_report(None, w, group_for(w, 4), parse_bytes("80GB"), Links(), desc=desc, profile=prof,
                              overlap=0.25) for w in (1, 4, 16)}
    one = reports[1]["layouts"]["1d"]["step"]
    assert one["step_s"] == prof.step_s and one["mfu"] == pytest.approx(end["mean_mfu"], rel=1e-12)
    assert one["samples_per_s"] == pytest.approx(end["mean_samples_per_s"], rel=1e-9)
    assert reports[1]["profile"]["mfu"] == pytest.approx(end["mean_mfu"], rel=1e-12)
    for w in (4, 16):
        for name, r in reports[w]["layouts"].items():
            st = r["step"]
            assert st["comm_s"] == r["seconds"]["total"] > 0, (w, name)
            assert st["step_s"] == pytest.approx(prof.step_s + 0.75 * st["comm_s"])
            assert st["mfu"] < prof.mfu and st["samples_per_s"] == pytest.approx(w * cases.BATCH / st["step_s"])


def test_a_profile_without_an_end_event_reads_its_rows_after_the_first(tmp_path):
    rows = [START, {"step": 10, "step_s": 0.9, "tflops": 1.0},  # warm-up: left out
            {"step": 20, "step_s": 0.2, "tflops": 100.0}, {"step": 30, "step_s": 0.3, "tflops": 200.0}]
    prof, _ = profile_from_run(_fake_run(tmp_path / "cut", rows))
    assert prof.step_s == pytest.approx(0.25) and prof.flops == pytest.approx((20e12 + 60e12) / 2)
    assert prof.batch == 64 and prof.peak_flops == 989e12 and "2 metrics rows" in prof.source
    again, _ = profile_from_run(_fake_run(tmp_path / "cut", rows), peak_tflops=500)
    assert again.peak_flops == 500e12
    end = {"event": "end", "mean_step_s": 0.5, "mean_tflops": 300.0, "measured_steps": 9, "warmup_steps": 5}
    prof, config = profile_from_run(_fake_run(tmp_path / "done", [*rows, "cut sh", end]))
    assert prof.step_s == 0.5 and prof.flops == pytest.approx(150e12) and "mean of 9 steps" in prof.source
    rep = plan_report(_cfg(tmp_path), 1, 1, parse_bytes("80GB"), profile=prof, batch_per_rank=64)
    one = rep["layouts"]["1d"]["step"]
    assert one["step_s"] == 0.5 and one["mfu"] == pytest.approx(300e12 / 989e12)  # world 1: the measured step


def test_bad_profiles_are_named(tmp_path):
    with pytest.raises(ConfigError, match="not a run folder of gemzoo train"):
        profile_from_run(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="that run had 2 ranks.*profile a one-process run"):
        profile_from_run(_fake_run(tmp_path / "two", [{**START, "world_size": 2}]))
    with pytest.raises(ConfigError, match="no step rows"):
        profile_from_run(_fake_run(tmp_path / "empty", [START]))


def test_plan_cli_several_worlds_and_bad_input(tmp_path, capsys):
    base = ["plan", "--config", cases.CONFIG, "--set", "data.sparse_table_size=64", "--group", "4",
            "--flop-batches", "1"]
    assert main([*base, "--world", "1,4,16", "--step-s", "0.1", "--peak-tflops", "2", "--overlap", "0.5",
                 "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["world"] for r in reports] == [1, 4, 16] and [r["group"] for r in reports] == [1, 4, 4]
    assert reports[0]["layouts"]["1d"]["step"]["step_s"] == 0.1
    per_sample = reports[0]["model"]["flops_per_sample"]
    assert reports[0]["profile"]["flops"] == pytest.approx(per_sample * 64)
    assert reports[2]["layouts"]["2d-replicated"]["step"]["step_s"] > 0.1
    assert main([*base, "--world", "4", "--mfu", "0.25", "--peak-tflops", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["profile"]["step_s"] == pytest.approx(per_sample * 64 / (0.25 * 2e12))
    assert main([*base, "--world", "1,16", "--step-s", "0.1", "--peak-tflops", "2"]) == 0
    text = capsys.readouterr().out
    assert "step time and MFU by world" in text and "2d-fully_sharded" in text
    assert text.count(" 1 x 1 ") == 1  # world 1: 1d only (its 2D layouts are the same one group)
    for extra, message in ((["--world", "4", "--step-s", "0.1"], "need --peak-tflops"),
                           (["--world", "4", "--step-s", "0.1", "--mfu", "0.3", "--peak-tflops", "1"], "give one of"),
                           (["--world", "4", "--mfu", "3", "--peak-tflops", "1"], "--mfu is a fraction"),
                           (["--world", "4", "--overlap", "-0.1"], "--overlap is the fraction"),
                           (["--world", "6"], "--group 4 does not divide --world 6"),
                           (["--world", "4", "--profile", str(tmp_path), "--step-s", "1"], "leave out --step-s")):
        assert main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    with pytest.raises(SystemExit) as exc:
        main([*base, "--world", "8,x"])
    assert exc.value.code == 2 and "give rank counts separated by commas" in capsys.readouterr().err
    assert main(["plan", "--world", "4"]) == 2
    assert "give --config F" in capsys.readouterr().err
