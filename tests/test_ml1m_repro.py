"""bench/ml1m_repro.py in bounded pieces: the plan and its indices, --only and --shard, a run's JSON written when
it finishes and skipped when a later call finds it complete, --max-wall-s (runs not started, runs cut off),
--merge of several folders into table.md / table.json (mean ± std, the paper's mark, kernel and precision
deltas), and bad arguments. Trains on tiny MovieLens-format files written here, a couple of steps."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gemzoo.testing.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ml1m_repro.py"
TINY = ["--set", "data.batch_size=8", "--set", "eval.batches=2"]


def _module():
    spec = importlib.util.spec_from_file_location("gemzoo_ml1m_repro", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


repro = _module()


def write_movielens(folder: Path, users: int = 12, items: int = 20, seed: int = 0) -> Path:
    """ratings.dat (UserID::MovieID::Rating::Timestamp, 6..10 distinct movies a user, increasing timestamps
    with varied gaps) and movies.dat (MovieID::Title::Genres, two movies nobody rated)."""
    rng = random.Random(seed)
    lines = []
    for u in range(1, users + 1):
        t = 978_300_000 + rng.randrange(10_000)
        for movie in rng.sample(range(1, items + 1), rng.randrange(6, 11)):
            t += rng.choice([0, 1, 30, 3600, 86_400, 2_000_000])
            lines.append(f"{u}::{movie}::{rng.randrange(1, 6)}::{t}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ratings.dat").write_text("\n".join(lines) + "\n")
    (folder / "movies.dat").write_text("".join(f"{m}::Movie {m} (1999)::Drama|Comedy\n" for m in range(1, items + 3)))
    return folder


def _main(capsys, *argv) -> tuple[int, str, str]:
    code = repro.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


class InProcess:
    """The script's launch of a child: trains the run in this process at once."""

    launched: list[list[str]] = []

    def __init__(self, cmd):
        assert Path(cmd[1]) == SCRIPT
        InProcess.launched.append(cmd)
        self.returncode = repro.main(cmd[2:])

    def poll(self):
        return self.returncode


class Never:
    """A launch that must not happen."""

    def __init__(self, cmd):
        raise AssertionError(f"nothing should be launched: {cmd}")


# -- the plan --------------------------------------------------------------------------------------------------
def test_list_gives_every_planned_run_an_index_and_only_and_shard_select(capsys, tmp_path):
    code, out, _ = _main(capsys, "--seeds", 0, 1, "--variant", "reference=reference@300", "--list", "--out", tmp_path)
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:-1]]
    assert [int(r[0]) for r in rows] == list(range(12)) and "(12 of 12 planned runs" in out
    assert rows[0][:7] == ["0", "sasrec", "0", "shipped", "-", "test", "4767"]
    assert rows[5][:7] == ["5", "hstu-large", "1", "shipped", "-", "test", "4767"]
    assert rows[9][:7] == ["9", "hstu", "1", "reference", "reference", "test", "300"]
    assert all(r[-2:] == ["to", "train"] for r in rows)

    args = repro.parser().parse_args(["--seeds", "0", "1", "2"])
    runs = repro.plan(args)
    pieces = []
    for k in (1, 2, 3):
        args.shard = f"{k}/3"
        pieces.append([r["index"] for r in repro.select(runs, args)])
    assert sorted(sum(pieces, [])) == list(range(9)) and all(len(p) == 3 for p in pieces)
    assert {runs[i]["model"] for i in pieces[1]} == set(repro.CONFIGS)  # each piece: one run of each model
    args.shard, args.only = None, "0,4-6"
    assert [r["index"] for r in repro.select(runs, args)] == [0, 4, 5, 6]
    args.shard = "2/2"
    assert [r["index"] for r in repro.select(runs, args)] == [4, 6]


@pytest.mark.parametrize("argv,problem", [
    (["--variant", "bf16"], "must be NAME=PLUGINS"),
    (["--variant", "a b=bf16"], "use letters, digits"),
    (["--variant", "shipped=bf16"], "taken by the configs as shipped"),
    (["--variant", "r=reference@0"], "whole number > 0"),
    (["--shard", "0/3"], "1 <= K <= N"),
    (["--shard", "4/3"], "1 <= K <= N"),
    (["--only", "3,x"], "expected indices and ranges"),
    (["--only", "7"], r"\[7\] not in the plan's indices 0..2"),
    (["--split", "test", "test"], "names a split twice"),
    (["--select-by", "ndcg@10"], "add --eval-every N"),
])
def test_bad_arguments_name_the_problem_and_the_fix(capsys, tmp_path, argv, problem):
    code, _, err = _main(capsys, *argv, "--list", "--out", tmp_path)
    assert code == 2 and err.startswith("ml1m_repro: ")
    assert re.search(problem, err), err


def test_training_needs_the_data_files(capsys, tmp_path):
    code, _, err = _main(capsys, "--out", tmp_path)
    assert code == 2 and "--data is needed" in err
    (tmp_path / "ml").mkdir()
    (tmp_path / "ml" / "ratings.dat").write_text("1::1::5::978300000\n")
    code, _, err = _main(capsys, "--data", tmp_path / "ml", "--out", tmp_path)
    assert code == 2 and "movies.dat is missing" in err and "grouplens" in err


# -- runs, skipping, time ----------------------------------------------------------------------------------------
def test_each_run_writes_its_json_and_a_later_call_skips_it(capsys, tmp_path, monkeypatch):
    data, out = write_movielens(tmp_path / "ml"), tmp_path / "out"
    common = ["--data", data, "--models", "hstu", "--steps", 2, *TINY, "--out", out]
    InProcess.launched = []
    monkeypatch.setattr(repro, "launch", InProcess)
    code, text, _ = _main(capsys, *common, "--seeds", 0, 1, "--only", 1)
    assert code == 0 and len(InProcess.launched) == 1 and InProcess.launched[0][-2:] == ["--one", "1"]
    rec = json.loads((out / "hstu_shipped_test_2steps_seed1.json").read_text())
    assert rec["kind"] == "ml1m-repro-run" and rec["complete"] and rec["steps"] == 2 and rec["seed"] == 1
    assert rec["attention"] == ["gdpa"] and rec["precision"] == "fp32" and rec["jobs"] == 1  # 1 on CPU
    assert set(rec["metrics"]) == set(repro.METRICS) and all(0 <= v <= 1 for v in rec["metrics"].values())
    assert rec["wall_s"] > 0 and rec["key"]["set"] == TINY[1::2]
    assert not (out / "hstu_shipped_test_2steps_seed0.json").exists()
    table = json.loads((out / "table.json").read_text())
    assert [r["seeds"] for r in table["rows"]] == [[1]] and "| hstu | shipped | gdpa, fp32 |" in text

    monkeypatch.setattr(repro, "launch", Never)  # the same call again: nothing left to train
    code, text, _ = _main(capsys, *common, "--seeds", 0, 1, "--only", 1)
    assert code == 0 and "[1] hstu_shipped_test_2steps_seed1 already complete" in text
    code, text, _ = _main(capsys, *common, "--seeds", 0, 1, "--list")
    assert "   1  hstu" in text and "done (" in text and "to train" in text  # seed 0 is still to train

    # the same file name with other settings is refused, not overwritten or taken for this run
    code, _, err = _main(capsys, "--data", data, "--models", "hstu", "--steps", 2, "--out", out, "--seeds", 1)
    assert code == 2 and "holds a run with other settings" in err and "use another --out" in err


def test_max_wall_starts_no_run_that_would_not_finish(capsys, tmp_path, monkeypatch):
    data, out = write_movielens(tmp_path / "ml"), tmp_path / "out"
    monkeypatch.setattr(repro, "launch", Never)
    code, _, err = _main(capsys, "--data", data, "--models", "sasrec", "--out", out, "--max-wall-s", 60,
                         "--run-budget-s", 45, "--grace-s", 20)
    assert code == repro.EXIT_LEFT and "1 runs left (0)" in err and "call again" in err
    # a measured run of the same model and plugins is the estimate (scaled to the steps), not the budget
    args = repro.parser().parse_args(["--seeds", "0", "1", "--models", "sasrec", "--run-budget-s", "5"])
    runs = repro.plan(args)
    done = [dict(runs[0], wall_s=400.0, steps=4767)]
    assert repro.expected_s(runs[1], done, args, out) == pytest.approx(400.0)
    assert repro.expected_s(dict(runs[1], steps=300), done, args, out) == pytest.approx(400.0 * 300 / 4767)
    assert repro.expected_s(dict(runs[1], plugins="bf16"), done, args, out) == 5.0
    # a run cut off at a checkpoint needs only the rest
    (out / runs[1]["tag"] / "checkpoints" / "step-00003000").mkdir(parents=True)
    assert repro.checkpointed_step(runs[1], out) == 3000
    assert repro.expected_s(runs[1], done, args, out) == pytest.approx(400.0 * (1 - 3000 / 4767))

    # --partial starts a run that cannot finish (it will stop at --max-wall-s with a checkpoint)
    launched = []

    def finishes_at_once(cmd):
        launched.append(cmd)
        return type("Done", (), {"poll": lambda self: 1})()

    monkeypatch.setattr(repro, "launch", finishes_at_once)
    code, text, err = _main(capsys, "--data", data, "--models", "sasrec", "--out", out, "--max-wall-s", 120,
                            "--run-budget-s", 500, "--grace-s", 20, "--partial")
    assert len(launched) == 1 and "--partial trains it until --max-wall-s" in text
    assert code == 1 and "failed: sasrec_shipped_test_4767steps_seed0" in err  # it exited 1 with no record
    launched.clear()
    _main(capsys, "--data", data, "--models", "sasrec", "--out", out, "--max-wall-s", 70, "--run-budget-s", 500,
          "--grace-s", 20, "--partial")
    assert not launched  # under a minute to spare: not worth a start
    code, text, _ = _main(capsys, "--data", data, "--models", "sasrec", "--out", out, "--max-wall-s", 70,
                          "--grace-s", 20)
    assert not launched and code == repro.EXIT_LEFT and re.search(r"needs an unknown time and (49|50) s are left", text)


def test_a_run_still_going_at_max_wall_is_cut_off_and_left_for_the_next_call(capsys, tmp_path, monkeypatch):
    signals = []

    class Hangs:
        def __init__(self, cmd):
            self.returncode = None

        def poll(self):
            return self.returncode

        def send_signal(self, sig):
            signals.append(sig)
            self.returncode = -sig

        def wait(self, timeout=None):
            return self.returncode

    data, out = write_movielens(tmp_path / "ml"), tmp_path / "out"
    monkeypatch.setattr(repro, "launch", Hangs)
    monkeypatch.setattr(repro, "MIN_PIECE_S", 0.1)  # a half-second call may start a run here
    code, _, err = _main(capsys, "--data", data, "--models", "hstu", "--out", out, "--max-wall-s", 0.5,
                         "--grace-s", 0)
    assert code == repro.EXIT_LEFT and signals == [repro.signal.SIGTERM]
    assert "no time estimate" in err and "cut off at --max-wall-s" in err and "1 runs left (0)" in err
    assert not list(out.glob("hstu_*.json"))


# -- the table ---------------------------------------------------------------------------------------------------
def _record(model, seed, metrics, variant="shipped", plugins="", steps=4767, attention=("gdpa",),
            precision="fp32", wall=300.0):
    key = {"model": model, "plugins": plugins, "seed": seed, "steps": steps, "split": "test", "items": "movies",
           "set": []}
    return {"kind": repro.RECORD, "complete": True, "key": key, "tag": f"{model}_{variant}_test_{steps}steps_seed{seed}",
            "model": model, "variant": variant, "plugins": plugins, "seed": seed, "split": "test",
            "items": "movies", "set": [], "steps": steps, "config_steps": 4767, "epochs": 101.0,
            "metrics": dict(zip(repro.METRICS, metrics, strict=True)), "attention": list(attention),
            "precision": precision, "wall_s": wall, "jobs": 3, "step_ms": 40.0, "train_s_per_epoch": 2.0,
            "device": "NVIDIA H200", "torch": "2.x", "commit": "abc1234"}


def _write(folder: Path, *recs) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for rec in recs:
        (folder / f"{rec['tag']}.json").write_text(json.dumps(rec))


def test_merge_builds_the_table_from_several_folders(capsys, tmp_path):
    paper = repro.PAPER["hstu"]
    a, b, c, out = tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "table"
    ok = [v * 1.01 for v in paper]
    _write(a, _record("hstu", 0, ok, wall=310.0), _record("hstu", 1, [v * 0.99 for v in paper], wall=290.0))
    _write(b, _record("hstu", 2, [v * 0.95 for v in paper]), _record("hstu", 0, ok, wall=310.0),  # seed 0 again
           _record("hstu", 0, [0.2, 0.1, 0.4, 0.15], variant="short", steps=300),
           _record("hstu", 0, [0.2 * 1.004, 0.1 * 0.997, 0.4, 0.15], variant="reference", plugins="reference",
                   steps=300, attention=("reference",)),
           _record("hstu", 0, [v * 1.01 * 0.98 for v in paper], variant="bf16", plugins="bf16", precision="bf16"),
           _record("hstu", 1, [v * 0.99 for v in paper], variant="bf16", plugins="bf16", precision="bf16"),
           _record("hstu-large", 0, [0.3, 0.2, 0.6, 0.25], variant="reference", plugins="reference", steps=300,
                   attention=("reference",)))
    _write(c, _record("sasrec", 0, list(repro.PAPER["sasrec"]), attention=("sdpa-padded",)))
    (b / "notes.json").write_text('{"something": "else"}')  # other JSON in a folder is not a run
    code, text, _ = _main(capsys, "--merge", a, b, c, "--out", out)
    assert code == 0 and (out / "table.md").read_text().strip() in text
    table = json.loads((out / "table.json").read_text())
    assert table["kind"] == "ml1m-repro-table" and len(table["runs"]) == 9  # the duplicate counts once
    rows = {(r["model"], r["variant"]): r for r in table["rows"]}
    assert [k for k in rows] == [("sasrec", "shipped"), ("hstu", "shipped"), ("hstu", "bf16"), ("hstu", "short"),
                                 ("hstu", "reference"), ("hstu-large", "reference")]
    shipped = rows["hstu", "shipped"]
    assert shipped["seeds"] == [0, 1, 2] and shipped["wall_s"] == pytest.approx(300.0)
    assert shipped["wall_s_max"] == 310.0 and shipped["paper_comparable"]
    hr = shipped["metrics"]["hr@10"]
    assert hr["mean"] == pytest.approx(paper[0] * (1.01 + 0.99 + 0.95) / 3)
    assert hr["std"] == pytest.approx(paper[0] * statistics.stdev([1.01, 0.99, 0.95]))
    assert shipped["passes"]["hr@10"] is True  # mean 0.9833 of the paper: within 2%
    assert rows["sasrec", "shipped"]["passes"] == dict.fromkeys(repro.METRICS, True)
    assert rows["hstu", "short"]["passes"] == dict.fromkeys(repro.METRICS)  # 300 steps: not the paper's table
    deltas = {(d["model"], d["variant"]): d for d in table["deltas"]}
    kernel = deltas["hstu", "reference"]
    assert kernel["kind"] == "kernel" and kernel["limit"] == 0.005 and kernel["seeds"] == [0]
    assert kernel["delta"]["hr@10"] == pytest.approx(0.004) and kernel["delta"]["ndcg@10"] == pytest.approx(-0.003)
    assert kernel["within"] is True
    precision = deltas["hstu", "bf16"]
    assert precision["kind"] == "precision" and precision["limit"] == 0.01 and precision["seeds"] == [0, 1]
    assert precision["delta"]["hr@10"] == pytest.approx((1.01 * 0.98 + 0.99) / 2 - 1)  # over seeds 0 and 1 only
    assert precision["within"] is False
    assert deltas["hstu-large", "reference"]["kind"] is None and "add --variant NAME=@300" in \
        deltas["hstu-large", "reference"]["note"]
    md = (out / "table.md").read_text()
    assert "| hstu | paper | | test | 4767 | 0.3097 | 0.1720 | 0.5754 | 0.2307 |" in md
    assert " ✓ |" in md and "| kernel: gdpa → reference |" in md and "| precision: fp32 → bf16 |" in md
    assert "| 0.5% | ✓ (seeds 0) |" in md and "| 1.0% | ✗ (seeds 0, 1) |" in md

    # a table.json is a source too (its runs), and a failing row is marked with its shortfall
    _write(tmp_path / "d", _record("hstu", 3, [v * 0.5 for v in paper]))
    code, text, _ = _main(capsys, "--merge", out / "table.json", tmp_path / "d", "--out", tmp_path / "t2")
    again = json.loads((tmp_path / "t2" / "table.json").read_text())
    assert len(again["runs"]) == 10 and [r for r in again["rows"] if r["variant"] == "shipped"
                                         and r["model"] == "hstu"][0]["seeds"] == [0, 1, 2, 3]
    code, text, _ = _main(capsys, "--merge", tmp_path / "d", "--out", tmp_path / "t3")
    assert "✗ (-50.0%)" in text


def test_merge_of_nothing_or_of_a_bad_file_says_so(capsys, tmp_path):
    code, text, _ = _main(capsys, "--merge", "--out", tmp_path)  # --out itself, empty
    assert code == 1 and "0 rows" in text
    (tmp_path / "broken.json").write_text("{")
    code, _, err = _main(capsys, "--merge", tmp_path, "--out", tmp_path / "t")
    assert code == 2 and "broken.json is not JSON" in err


@pytest.mark.multiprocess
def test_the_script_end_to_end_in_child_processes(tmp_path):
    """Two calls of the real script: the first trains one hstu run (2 steps, its own process, gdpa's fused bias
    on the C++ cpu kernel), the second skips it; --merge of the folder gives the same table."""
    data, out = write_movielens(tmp_path / "ml"), tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--data", str(data), "--models", "hstu", "--steps", "2", *TINY,
           "--out", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_guard(300))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[0] hstu_shipped_test_2steps_seed0 done: 2 steps" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_guard(300))
    assert second.returncode == 0 and "already complete" in second.stdout and "started" not in second.stdout
    table = (out / "table.md").read_text()
    merged = subprocess.run([sys.executable, str(SCRIPT), "--merge", str(out), "--out", str(tmp_path / "m")],
                            capture_output=True, text=True, timeout=hang_guard(120))
    assert merged.returncode == 0 and (tmp_path / "m" / "table.md").read_text() == table


@pytest.mark.slow  # three short trainings in this process
def test_a_run_cut_off_continues_from_its_checkpoint_to_the_same_result(capsys, tmp_path):
    """A run stopped by SIGTERM after step 2 (as --max-wall-s stops it) keeps its checkpoint and no record; the
    next call continues it from step 2, and its metrics are those of the run trained in one go (resume is
    bit-exact on the CPU); its wall time adds both pieces."""
    import signal

    import gemzoo
    from gemzoo import registry

    data = write_movielens(tmp_path / "ml")
    common = ["--data", data, "--models", "hstu", "--steps", 4, "--checkpoint-every", 0, *TINY, "--one", 0]

    class StopAfterStep2:
        @gemzoo.hookimpl
        def gemzoo_step_end(self, trainer, step, metrics):
            if step == 2:
                signal.raise_signal(signal.SIGTERM)

    plugin = StopAfterStep2()
    registry.host().register(plugin, name=f"stop-after-2-{id(plugin)}")
    try:
        code, _, err = _main(capsys, *common, "--out", tmp_path / "cut")
    finally:
        registry.host().pm.unregister(plugin)
    assert code == 4 and "stopped by SIGTERM at step 2" in err
    run = repro.plan(repro.parser().parse_args(["--models", "hstu", "--steps", "4", *TINY]))[0]
    assert repro.checkpointed_step(run, tmp_path / "cut") == 2 and not (tmp_path / "cut" / f"{run['tag']}.json").exists()
    code, text, _ = _main(capsys, *common[:-2], "--out", tmp_path / "cut", "--list")
    assert "at step 2 (checkpoint)" in text

    code, text, _ = _main(capsys, *common, "--out", tmp_path / "cut")
    assert code == 0 and "continues from its checkpoint at step 2" in text
    resumed = json.loads((tmp_path / "cut" / f"{run['tag']}.json").read_text())
    assert [(s["from"], s["to"]) for s in resumed["segments"]] == [(0, 2), (2, 4)]
    assert resumed["wall_s"] == pytest.approx(sum(s["wall_s"] for s in resumed["segments"]))
    assert not repro.segments_path(run, tmp_path / "cut").exists()

    assert _main(capsys, *common, "--out", tmp_path / "whole")[0] == 0
    whole = json.loads((tmp_path / "whole" / f"{run['tag']}.json").read_text())
    assert len(whole["segments"]) == 1 and resumed["metrics"] == whole["metrics"]
    assert resumed["final_loss"] == whole["final_loss"]


def test_select_by_reads_the_test_curve_at_the_step_val_picks(capsys, tmp_path):
    def with_curve(split, seed, points):
        rec = _record("hstu", seed, points[-1][1])
        curve = [{"step": s, **dict(zip(repro.METRICS, m, strict=True))} for s, m in points]
        rec.update(split=split, curve=curve, tag=rec["tag"].replace("_test_", f"_{split}_"),
                   key={**rec["key"], "split": split})
        return rec

    val = with_curve("val", 0, [(47, [0.20, 0.10, 0.5, 0.2]), (94, [0.22, 0.13, 0.5, 0.2]),
                                (141, [0.23, 0.12, 0.5, 0.2]), (4767, [0.21, 0.11, 0.5, 0.2])])
    test = with_curve("test", 0, [(47, [0.25, 0.14, 0.5, 0.2]), (94, [0.31, 0.18, 0.58, 0.23]),
                                  (141, [0.30, 0.17, 0.57, 0.22]), (4767, [0.28, 0.15, 0.55, 0.21])])
    lone = with_curve("test", 1, [(47, [0.1, 0.1, 0.1, 0.1])])  # no val twin: no early-stopped row
    _write(tmp_path / "a", val, test, lone)
    by_ndcg = {r["seed"]: r for r in repro.early_stopped([val, test, lone], "ndcg@10")}
    assert list(by_ndcg) == [0]
    es = by_ndcg[0]
    assert es["selected_step"] == 94 and es["variant"] == "shipped+es" and es["split"] == "test"
    assert es["metrics"] == dict(zip(repro.METRICS, [0.31, 0.18, 0.58, 0.23], strict=True))
    assert es["epochs"] == pytest.approx(101.0 * 94 / 4767)
    assert repro.early_stopped([val, test], "hr@10")[0]["selected_step"] == 141

    code, text, _ = _main(capsys, "--merge", tmp_path / "a", "--out", tmp_path / "t", "--select-by", "ndcg@10")
    rows = {(r["model"], r["variant"], r["split"]): r for r in json.loads((tmp_path / "t" / "table.json")
                                                                           .read_text())["rows"]}
    assert rows["hstu", "shipped+es", "test"]["metrics"]["hr@10"]["mean"] == pytest.approx(0.31)
    assert rows["hstu", "shipped", "test"]["per_seed"]["0"]["hr@10"] == pytest.approx(0.28)  # the last step's
    assert "shipped+es" in text


def test_one_call_trains_each_test_run_with_its_val_twin_and_builds_the_early_stopped_rows(capsys, tmp_path,
                                                                                           monkeypatch):
    """--split test val plans the twins side by side (indices: seed, then split); both train with the split
    they name, and the call's table has the '+es' row read from the test curve where val's is best."""
    data, out = write_movielens(tmp_path / "ml"), tmp_path / "out"
    args = repro.parser().parse_args(["--models", "hstu", "--seeds", "0", "1", "--split", "test", "val"])
    assert [(r["seed"], r["split"]) for r in repro.plan(args)] == [(0, "test"), (0, "val"), (1, "test"),
                                                                   (1, "val")]
    InProcess.launched = []
    monkeypatch.setattr(repro, "launch", InProcess)
    code, text, _ = _main(capsys, "--data", data, "--models", "hstu", "--steps", 4, "--eval-every", 2,
                          "--split", "test", "val", "--select-by", "ndcg@10", *TINY, "--out", out)
    assert code == 0 and len(InProcess.launched) == 2
    test, val = (json.loads((out / f"hstu_shipped_{s}_4steps_seed0.json").read_text()) for s in ("test", "val"))
    assert (test["split"], val["split"]) == ("test", "val")
    assert "data.eval_split='val'" in val["overrides"] and "data.eval_split='test'" in test["overrides"]
    assert [p["step"] for p in val["curve"]] == [p["step"] for p in test["curve"]] == [2, 4]
    rows = {(r["variant"], r["split"]): r for r in json.loads((out / "table.json").read_text())["rows"]}
    assert set(rows) == {("shipped", "test"), ("shipped", "val"), ("shipped+es", "test")}
    best = max(val["curve"], key=lambda p: p["ndcg@10"])
    picked = next(p for p in test["curve"] if p["step"] == best["step"])
    assert rows["shipped+es", "test"]["metrics"]["hr@10"]["mean"] == pytest.approx(picked["hr@10"])
    assert "shipped+es" in text
    # merged again from that folder (its table.json beside the runs): the early-stopped row once, not twice
    code, _, _ = _main(capsys, "--merge", out, "--select-by", "ndcg@10", "--out", tmp_path / "again")
    again = {(r["variant"], r["split"]): r for r in json.loads((tmp_path / "again" / "table.json").read_text())["rows"]}
    assert code == 0 and again["shipped+es", "test"]["seeds"] == [0]


def test_a_record_names_its_commit_and_says_when_the_checkout_differs_from_it(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    monkeypatch.setattr(repro, "ROOT", tmp_path)
    assert repro.git_commit() is None  # not a checkout
    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = repro.git_commit()
    assert clean and "+" not in clean
    (tmp_path / "b.txt").write_text("untracked files are not the code that ran")
    assert repro.git_commit() == clean
    (tmp_path / "a.txt").write_text("2")
    assert repro.git_commit() == clean + "+dirty"
