"""Ablation files (configs/ablations/*.toml) and ``gemzoo ablate``, which runs them (bench/e2e.py calls it)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemzoo.config import load_ablation
from gemzoo.errors import ConfigError
from gemzoo.testing.timeouts import hang_guard

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


PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
def test_ablate_writes_table_plots_and_report(tmp_path):
    """Two plugin sets train, one fails while training (its loss diverges): every row, every file."""
    ablation = tmp_path / "tiny.toml"
    ablation.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\n'
                        'runs = ["cpu,fp32", { plugins = "cpu,fp32", set = ["optim.lr=1e30", "optim.grad_clip=0"], '
                        'name = "diverges" }, "cpu,bf16"]\n'
                        'steps = 3\nwarmup = 1\nset = ["run.device=cpu", "data.batch_size=8", "eval.batches=1"]\n')
    out = tmp_path / "abl"
    proc = subprocess.run([sys.executable, "-m", "gemzoo.cli", "ablate", str(ablation), "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=hang_guard(1200))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((out / "ablation.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["cpu,fp32", "diverges", "cpu,bf16"]
    for name in ("cpu,fp32", "cpu,bf16"):
        r = rows[name]
        assert r["status"] == "ok" and r["steps"] == 3 and r["samples_per_s"] > 0 and r["tflops"] > 0
        assert set(r["eval"]) >= {"eval/auc_click"} and 0 < r["eval"]["eval/auc_click"] < 1
        assert r["peak_mem_source"] == "peak RSS of the run's process" and 0.05 < r["peak_mem_gib"] < 20
        assert (out / r["run_dir"] / "metrics.jsonl").is_file()  # each set has its own run folder
        # the mean over wall-clock time after warm-up, as the run's own end event recorded it
        end = [json.loads(line) for line in (out / r["run_dir"] / "metrics.jsonl").read_text().splitlines()][-1]
        assert end["event"] == "end" and r["measured_steps"] == 2
        for key in ("mean_samples_per_s", "mean_mfu", "mean_step_s", "max_step_s"):
            assert r[key] == pytest.approx(end[key]) and r[key] > 0
        assert r["max_step_s"] >= r["median_step_s"] and r["max_step_s"] >= r["mean_step_s"]
    assert rows["cpu,fp32"]["run_dir"] != rows["cpu,bf16"]["run_dir"]
    failed = rows["diverges"]
    assert failed["status"] == "failed" and "loss is nan" in failed["error"]

    header = (out / "ablation.csv").read_text().splitlines()[0].split(",")
    assert {"plugins", "samples_per_s", "mfu", "peak_mem_gib", "final_loss", "error", "eval/auc_click",
            "mean_samples_per_s", "mean_mfu", "mean_step_s", "max_step_s"} <= set(header)
    for png in ("throughput.png", "memory.png", "loss.png", "eval.png"):
        blob = (out / png).read_bytes()
        assert blob.startswith(PNG) and len(blob) > 10_000, png
    report = (out / "report.md").read_text()
    assert f"gemzoo ablate {ablation} --out {out}" in report
    assert "| `cpu,fp32` |" in report and "FAILED" in report and "![loss](loss.png)" in report
    assert "| plugins | mean samples/s | mean MFU | slowest step s |" in report  # the means first
    assert "torch " in report and "Python " in report and "MFU peak: CPU" in report
    assert "| plugins |" in proc.stdout


def test_ablate_refuses_a_used_folder(tmp_path, capsys, fresh_registry):
    from gemzoo.cli import main

    ablation = tmp_path / "tiny.toml"
    ablation.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\nruns = ["cpu,fp32"]\n')
    out = tmp_path / "abl"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["ablate", str(ablation), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and "--overwrite" in capsys.readouterr().err + "--overwrite"
    assert main(["ablate", str(ablation), "--out", str(out), "--runs", "jfa,bf16"]) == 2
    assert "not in" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_peak_memory_is_per_run_not_cumulative():
    """Each run reports its own process's peak RSS: a big run does not inflate the next one, and a run does
    not inherit the size of the process that started it (which getrusage's ru_maxrss would)."""
    parent_ballast = bytearray(600 * 2**20)
    parent_ballast[::4096] = b"1" * len(parent_ballast[::4096])

    def peak(extra_mib):
        code = (f"x = bytearray({extra_mib} * 2**20); x[::4096] = b'1' * len(x[::4096]); "
                "from gemzoo.cli.ablate_run import peak_rss_bytes; print(peak_rss_bytes())")
        return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=hang_guard(300)).stdout)

    big, small = peak(400), peak(0)
    assert small < 550 * 2**20, small  # gemzoo + torch imported, not the 600 MiB of this process
    assert big > small + 350 * 2**20, (big, small)
    del parent_ballast


@pytest.mark.multiprocess
def test_e2e_script_is_a_thin_caller(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--config", str(ROOT / "configs/gem-tiny.toml"),
                           "--runs", "cpu,fp32", "--steps", "2", "--warmup", "0", "--set", "run.device=cpu", "--set", "data.batch_size=8",
                           "--set", "eval.every=0", "--out", str(tmp_path / "e2e")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=hang_guard(1200))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "e2e" / "ablation.json").read_text())["rows"]
    assert [(r["plugins"], r["status"], r["steps"]) for r in rows] == [("cpu,fp32", "ok", 2)]
    assert (tmp_path / "e2e" / "report.md").is_file()


def _children_of_ablation(out: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(out) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_sigterm_stops_the_run_process_too(tmp_path):
    import signal
    import time

    ablation = tmp_path / "long.toml"
    ablation.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\nruns = ["cpu,fp32"]\nsteps = 100000\n')
    out = tmp_path / "abl"
    parent = subprocess.Popen([sys.executable, "-m", "gemzoo.cli", "ablate", str(ablation), "--out", str(out)],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + hang_guard(900)
    while not list((out / "runs").glob(".*.spec.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    children = [p for p in _children_of_ablation(out) if p != parent.pid]
    assert children, "the run's process did not start"
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=hang_guard(300)) != 0
    deadline = time.monotonic() + hang_guard(60)  # the run's process may take a moment to exit on a loaded machine
    while [p for p in _children_of_ablation(out) if p != parent.pid] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in _children_of_ablation(out) if p != parent.pid]


def _fake_ablation(out: Path) -> dict:
    """An ablation folder as a GPU machine without matplotlib leaves it: ablation.json and run folders."""
    rows = []
    for i, (plugins, loss0) in enumerate([("a,bf16", 2.0), ("b,bf16", 1.8)], 1):
        run = out / "runs" / f"0{i}-{plugins.replace(',', '-')}"
        run.mkdir(parents=True)
        lines = [{"event": "start", "step": 0}] + [{"step": s, "loss": loss0 / s} for s in range(1, 31)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        rows.append({"plugins": plugins, "status": "ok", "run_dir": str(run.relative_to(out)), "steps": 30,
                     "samples_per_s": 100.0 * i, "tokens_per_s": 1e4 * i, "tflops": 50.0 * i, "mfu": 0.05 * i,
                     "step_s": 0.01, "wall_s": 3.0, "final_loss": loss0 / 30, "mfu_peak": "H200 bf16 dense",
                     "peak_mem_gib": 10.0 * i, "peak_mem_source": "torch.cuda.max_memory_allocated",
                     "eval": {"eval/auc_click": 0.6 + 0.01 * i}, "device": "NVIDIA H200", "device_memory_gib": 139.8})
    rows.append({"plugins": "c,bf16", "status": "failed", "error": "OutOfMemoryError: CUDA out of memory",
                 "run_dir": "runs/03-c-bf16", "log_tail": "torch.OutOfMemoryError: CUDA out of memory"})
    data = {"ablation": "configs/ablations/x.toml", "config": "configs/x.toml", "steps": 30, "warmup": 5,
            "overrides": [], "command": "gemzoo ablate configs/ablations/x.toml --out /out", "started": 0.0,
            "machine": {"platform": "Linux", "python": "3.12", "cpu": "cpu", "cpu_count": 16, "memory_gib": 128,
                        "gpu": "NVIDIA H200", "gpu_memory_gib": 139.8}, "versions": {"torch": "2.11"}, "rows": rows}
    (out / "ablation.json").write_text(json.dumps(data))
    return data


@pytest.mark.slow
def test_report_without_matplotlib_then_redrawn_elsewhere(tmp_path, monkeypatch, capsys, fresh_registry):
    from gemzoo.cli import ablate_report, main, plot

    data = _fake_ablation(tmp_path)

    def no_matplotlib(*a, **k):
        raise ConfigError("plots need matplotlib: pip install matplotlib")

    with monkeypatch.context() as m:
        m.setattr(plot, "_figure", no_matplotlib)
        assert ablate_report.write_report(data, tmp_path, echo=lambda s: None) == []
    report = (tmp_path / "report.md").read_text()
    assert "No plots" in report and "gemzoo ablate --report DIR" in report and not list(tmp_path.glob("*.png"))
    assert "NVIDIA H200 (139.8 GiB)" in report and "OutOfMemoryError" in report

    assert main(["ablate", "--report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "No plots" not in report and "![throughput](throughput.png)" in report
    assert {p.name for p in tmp_path.glob("*.png")} == {"throughput.png", "memory.png", "loss.png", "eval.png"}
    assert "| `b,bf16` |  |  |  | 200.0 |" in capsys.readouterr().out  # means blank here; ratio vs the first
    assert "2.00x" in report


def test_runs_may_change_options_for_themselves(tmp_path):
    """A run given as a table adds overrides of its own; names are unique and what --runs, rows and plots use."""
    f = tmp_path / "a.toml"
    f.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\n'
                 'runs = ["cpu,fp32", { plugins = "cpu,fp32", set = ["model.d_model=32"] },\n'
                 '        { plugins = "cpu,fp32", set = ["model.num_heads=1"], name = "one head" }]\n')
    runs = load_ablation(f).runs
    assert [(r.name, r.plugins, r.set) for r in runs] == [
        ("cpu,fp32", "cpu,fp32", []), ("cpu,fp32 + model.d_model=32", "cpu,fp32", ["model.d_model=32"]),
        ("one head", "cpu,fp32", ["model.num_heads=1"])]
    for text, match in [('runs = ["cpu,fp32", { plugins = "cpu,fp32" }]', "'cpu,fp32' appear more than once"),
                        ('runs = [{ plugins = "cpu,fp32", set = ["model.d_modle=3"], name = "x" }]',
                         "run 'x'.*d_modle"),
                        ('runs = [{ plugin = "cpu,fp32" }]', "unknown key runs\\[0\\].plugin"),
                        ('runs = [3]', "runs\\[0\\] must be a plugin set")]:
        f.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\n{text}\n')
        with pytest.raises(ConfigError, match=match):
            load_ablation(f)


@pytest.mark.multiprocess
def test_a_run_with_its_own_overrides_trains_them(tmp_path):
    from gemzoo.cli.ablate import make_plan, run_ablation

    f = tmp_path / "a.toml"
    f.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\nsteps = 2\nwarmup = 0\n'
                 'set = ["run.device=cpu", "data.batch_size=8", "eval.every=0"]\n'
                 'runs = ["cpu,fp32", { plugins = "cpu,fp32", set = ["model.d_model=32"], name = "narrow" },'
                 ' { plugins = "cpu,fp32", set = ["model.d_model=48"], name = "wider" }]\n')
    plan = make_plan(str(f), out=str(tmp_path / "abl"), runs=["narrow", "cpu,fp32"])
    assert [r.name for r in plan.runs] == ["narrow", "cpu,fp32"]
    import signal

    before = signal.getsignal(signal.SIGTERM)
    data = run_ablation(plan, echo=lambda *a: None)
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back
    rows = {r["name"]: r for r in data["rows"]}
    assert [r["status"] for r in rows.values()] == ["ok", "ok"]
    assert rows["narrow"]["set"] == ["model.d_model=32"] and rows["narrow"]["run_dir"].endswith("01-narrow")
    assert rows["narrow"]["final_loss"] != rows["cpu,fp32"]["final_loss"]  # d_model 32 is another model
    assert "`narrow`" in (tmp_path / "abl" / "report.md").read_text()
    with pytest.raises(ConfigError, match="--runs nope: not in .*'narrow'"):
        make_plan(str(f), runs=["nope"])


def test_ablate_checks_every_entry_before_the_first_run(tmp_path):
    """A set that config validate would refuse (flex has no CPU backward; heads that do not divide d_model)
    stops the ablation before anything trains, naming its entry; so does a bad --set for every run."""
    ablation = tmp_path / "a.toml"
    ablation.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\nruns = ["cpu,fp32", "cpu,bf16", "flex,fp32"]\n'
                        'set = ["run.device=cpu"]\n')
    out = tmp_path / "abl"
    proc = subprocess.run([sys.executable, "-m", "gemzoo.cli", "ablate", str(ablation), "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "runs[2] ('flex,fp32')" in proc.stderr and "backward" in proc.stderr
    assert not out.exists()
    from gemzoo.cli.ablate import make_plan

    ablation.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\n'
                        'runs = ["cpu,fp32", { plugins = "cpu,fp32", set = ["model.num_heads=3"], name = "three" }]\n')
    with pytest.raises(ConfigError, match=r"runs\[1\] \('three'\).*num_heads=3"):
        make_plan(str(ablation))
    ablation.write_text(f'config = "{ROOT}/configs/gem-tiny.toml"\nruns = ["cpu,fp32"]\n')
    with pytest.raises(ConfigError, match=r"runs\[0\] \('cpu,fp32'\).*num_heads=5"):
        make_plan(str(ablation), overrides=["model.num_heads=5"])
