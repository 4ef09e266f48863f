"""Every run folder says how the run was made (config.toml, command.txt, provenance.json) and keeps what the
terminal showed (train.log); metrics rows hold lr and grad_norm; ``gemzoo runs`` lists run folders."""

import copy
import json
import math

import pytest
import tomllib
from toy_plugin import TOY_CONFIG

from gemzoo.cli import main
from gemzoo.config import load_config
from gemzoo.distributed.launch import launch_command
from gemzoo.train.provenance import git_state, read_provenance, toml_text
from gemzoo.train.trainer import train


def _cfg(out, **run):
    raw = copy.deepcopy(TOY_CONFIG)
    raw["run"].update(out_dir=str(out), **run)
    return load_config(raw=raw)


def test_toml_text_round_trips_a_config_s_plain_types():
    data = {"a": 1, "b": -2.5, "c": "x \"q\" \\ \n\t\u0001 é", "d": True, "e": [1, 2.0, "s"], "f": [],
            "weird key": 1e-9, "n": None, "inf": math.inf,
            "t": {"x": [[1, 2], [3]], "inline": [{"k": 1}], "sub": {"deep": {"z": False}}, "empty": {}}}
    back = tomllib.loads(toml_text(data))
    expected = copy.deepcopy(data)
    del expected["n"]
    assert back == expected


def test_toml_text_refuses_what_toml_cannot_hold():
    with pytest.raises(TypeError, match=r"run\.when: a object has no TOML form"):
        toml_text({"run": {"when": object()}})


def test_a_run_folder_holds_config_command_provenance_and_log(toy, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = _cfg(out, steps=6, log_every=2)
    train(cfg, progress=True, command="gemzoo train --config toy.toml --steps 6")
    shown = capsys.readouterr().out
    assert (out / "command.txt").read_text() == "gemzoo train --config toy.toml --steps 6\n"
    written = tomllib.loads((out / "config.toml").read_text())
    assert written == json.loads(json.dumps(cfg.to_dict()), object_hook=lambda d: {k: v for k, v in d.items()
                                                                                  if v is not None})
    assert load_config(out / "config.toml").to_dict() == cfg.to_dict()  # takes itself back
    (entry,) = read_provenance(out)
    assert entry["event"] == "start" and entry["command"].startswith("gemzoo train")
    assert {"gemzoo", "torch", "triton", "cuda", "plugins", "installed_plugins"} <= set(entry["versions"])
    from importlib import metadata

    installed = {ep.dist.name for ep in metadata.entry_points(group="gemzoo") if ep.dist is not None}
    assert set(entry["versions"]["installed_plugins"]) == installed
    assert entry["hardware"]["cpus"] and entry["hardware"]["device"] == "cpu"
    assert entry["git"] == git_state()  # None outside a checkout
    log = (out / "train.log").read_text()
    assert "gemzoo train: " in log and "parameters" in log and "step 6/6" in log
    assert "step 6/6" in shown  # the terminal showed it too (stdout is not a TTY here: plain lines)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r and "event" not in r]
    assert steps and all(r["lr"] == cfg.optim.lr and r["grad_norm"] > 0 for r in steps)


def test_resume_appends_to_the_log_and_the_provenance(toy, tmp_path, capsys):
    out = tmp_path / "run"
    train(_cfg(out, steps=4), progress=False)
    train(_cfg(out, steps=6), resume=True, progress=False)
    entries = read_provenance(out)
    assert [e["event"] for e in entries] == ["start", "resume"] and entries[1]["step"] == 4
    assert "--- resumed" in (out / "train.log").read_text()
    assert tomllib.loads((out / "config.toml").read_text())["run"]["steps"] == 6


def test_overwrite_clears_the_provenance_files(toy, tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, steps=2), progress=False, command="first")
    train(_cfg(out, steps=2), progress=False, overwrite=True, command="second")
    assert (out / "command.txt").read_text() == "second\n"
    assert [e["command"] for e in read_provenance(out)] == ["second"]


def test_gemzoo_runs_lists_status_steps_metrics_and_plugins(toy, tmp_path, capsys):
    train(_cfg(tmp_path / "a", steps=3), progress=False)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n{"step": 1, "loss": 2.5}\n{"cut')
    capsys.readouterr()
    assert main(["runs", str(tmp_path), "--json"]) == 0
    runs = {r["run"].rsplit("/", 1)[-1]: r for r in json.loads(capsys.readouterr().out)}
    assert runs["a"]["status"] == "finished" and runs["a"]["step"] == 3 and runs["a"]["steps"] == 3
    assert runs["a"]["plugins"] and runs["a"]["loss"] is not None
    assert runs["b"]["status"] == "unfinished" and runs["b"]["loss"] == 2.5
    (tmp_path / "b" / "train.log").write_text("step 1/9 ...\ngemzoo: error: loss is nan at step 2. Lower optim.lr\n")
    assert main(["runs", str(tmp_path / "b"), "--json"]) == 0
    (failed,) = json.loads(capsys.readouterr().out)
    assert failed["status"] == "failed" and failed["error"].startswith("loss is nan")
    assert main(["runs", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "finished" in table and "failed" in table
    assert main(["runs", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(("env", "argv0", "expected"), [
    ({}, "/venv/bin/gemzoo", ["gemzoo", "train", "--resume"]),
    ({}, "/src/gemzoo/cli/__main__.py", ["python", "-m", "gemzoo.cli", "train", "--resume"]),
    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
      "GROUP_WORLD_SIZE": "1"}, "/venv/bin/gemzoo",
     ["torchrun", "--nnodes", "1", "--nproc-per-node", "4", "-m", "gemzoo.cli", "train", "--resume"]),
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2",
      "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}, "/src/gemzoo/cli/__main__.py",
     ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:1234",
      "-m", "gemzoo.cli", "train", "--resume"]),
])
def test_the_launch_command_is_rebuilt_torchrun_included(env, argv0, expected):
    assert launch_command(["train", "--resume"], environ=env, argv0=argv0) == expected


def test_known_third_party_warnings_are_silenced_and_others_are_not(monkeypatch):
    import logging
    import warnings

    from gemzoo.train.warnings_filter import quiet_known_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        warnings.warn("HeuristicalStorageReservation is known to cause issues, particularly ...", FutureWarning,
                      stacklevel=1)
        warnings.warn("something else", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]
    logger = logging.getLogger("torchrec.distributed.planner.types")
    records = []
    monkeypatch.setattr(logger, "callHandlers", records.append)
    logger.warning("The topology was constructed directly rather than via TopologyFactory")
    logger.warning("a real problem")
    assert [r.msg for r in records] == ["a real problem"]


def test_the_progress_bar_fits_80_columns_and_shows_step_loss_throughput_mfu_eta():
    import io

    from rich.console import Console

    from gemzoo.train.console import progress_bar, short_info

    buf = io.StringIO()
    bar = progress_bar(True)
    bar.live.console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    bar.add_task("run", total=100000, completed=99999,
                 info=short_info({"loss": 12.3456, "samples_per_s": 1234567.0, "mfu": 0.987}))
    bar.live.console.print(bar.make_tasks_table(bar.tasks))
    (line,) = buf.getvalue().splitlines()
    assert len(line) <= 80 and "…" not in line
    for part in ("step 99999/100000", "loss 12.3456", "1.23M sam/s", "MFU 98.7%", "eta"):
        assert part in line, line


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_only_rank_0_prints_the_torchrun_resume_command(tmp_path, monkeypatch, capsys, rank):
    import signal

    from gemzoo.cli import train as train_cmd
    from gemzoo.train.loop import TrainingInterrupted

    def interrupted(cfg, **kwargs):
        raise TrainingInterrupted(signal.SIGINT, 7, tmp_path / "checkpoints" / "step-00000007", tmp_path)

    monkeypatch.setattr(train_cmd, "train", interrupted)
    monkeypatch.setattr("sys.argv", ["/venv/bin/gemzoo"])
    for key, value in {"TORCHELASTIC_RUN_ID": "r", "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    argv = ["train", "--config", "configs/gem-tiny.toml", "--out", str(tmp_path), "--overwrite"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    if rank == "1":
        assert err == ""
    else:
        assert err.count("gemzoo: SIGINT: stopped after step 7") == 1
        assert (f"torchrun --nnodes 1 --nproc-per-node 2 -m gemzoo.cli train --config configs/gem-tiny.toml "
                f"--out {tmp_path} --resume") in err
