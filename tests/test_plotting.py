"""``gemzoo plot`` and the one metrics.jsonl reader the plots use."""

import json

import pytest

from gemzoo.cli import main
from gemzoo.cli.plot import plot_runs, read_metrics
from gemzoo.errors import ConfigError

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def steps(a, b, loss=1.0, **extra):
    return [{"step": s, "loss": loss / s, "samples_per_s": 100.0 + s, **extra} for s in range(a, b + 1)]


def test_resumed_rows_supersede_the_earlier_ones(tmp_path):
    """A run killed at step 7 after checkpointing at 5, resumed at 5: steps 6-7 of the first process go."""
    rows = [{"event": "start", "step": 0}, *steps(1, 7, loss=2.0), {"event": "resume", "step": 5},
            *steps(6, 9, loss=1.0), {"event": "end", "step": 9}]
    run = write_run(tmp_path / "run", rows)
    got = read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, 10))
    assert got[4]["loss"] == 2.0 / 5 and got[5]["loss"] == 1.0 / 6  # before the resume point: first process


def test_a_line_cut_short_at_the_end_is_ignored_elsewhere_an_error(tmp_path):
    run = write_run(tmp_path / "run", steps(1, 3))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n{"step": 2, "loss": 1}\n')
    with pytest.raises(ConfigError, match="metrics.jsonl:2 is not JSON"):
        read_metrics(run)
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        read_metrics(tmp_path / "nothing")


@pytest.mark.slow
def test_plot_runs_and_cli(tmp_path, capsys):
    a = write_run(tmp_path / "a", steps(1, 30) + [{"step": 30, "loss": 0.1, "eval/auc": 0.7}])
    b = write_run(tmp_path / "b", steps(1, 20, loss=2.0))
    out = plot_runs([a, b], tmp_path / "both.png")
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 10_000
    assert main(["plot", str(a)]) == 0
    assert (a / "curves.png").read_bytes().startswith(PNG)
    assert capsys.readouterr().out.strip().endswith("curves.png")
    assert main(["plot", str(a), str(b), "--labels", "only-one"]) == 2
    assert "--labels has 1 names for 2 runs" in capsys.readouterr().err


def test_y_range_has_a_floor_on_its_span():
    from gemzoo.cli.plot import MIN_SPAN, y_range

    lo, hi = y_range([0.701, 0.702, 0.7035])  # AUC noise in the third digit: a flat line, not a trend
    assert hi - lo == pytest.approx(MIN_SPAN) and lo < 0.701 and hi > 0.7035
    lo, hi = y_range([0.99, 0.995])  # near 1: the span stays inside [0, 1]
    assert hi == 1.0 and hi - lo == pytest.approx(MIN_SPAN)
    lo, hi = y_range([100.0, 101.0])  # samples/s: at least 10% of the value
    assert hi - lo == pytest.approx(10.1) and lo < 100 < 101 < hi
    lo, hi = y_range([0.2, 0.9])  # a real spread is shown whole, with margins
    assert lo < 0.2 and hi > 0.9
    assert y_range([]) is None and y_range([float("nan")]) is None


def test_auc_and_logloss_get_their_own_panels(tmp_path, monkeypatch):
    from gemzoo.cli import plot

    a = write_run(tmp_path / "a", steps(1, 30) + [{"step": 30, "loss": 0.1, "eval/auc_click": 0.7,
                                                    "eval/auc_conversion": 0.6, "eval/logloss_click": 0.5}])
    made = []
    real = plot._figure

    def spy(*args):
        fig = real(*args)
        made.append(fig)
        return fig

    monkeypatch.setattr(plot, "_figure", spy)
    plot.plot_runs([a], tmp_path / "c.png")
    titles = [ax.get_title() for ax in made[0].axes]
    assert titles == ["Training loss (faint: per step)", "Throughput", "Eval: auc", "Eval: logloss"]
    loss_ax = made[0].axes[0]
    assert any("EMA" in line.get_label() for line in loss_ax.get_lines())  # the smoothed trend
    auc_ax = made[0].axes[2]
    assert auc_ax.get_ylim()[1] - auc_ax.get_ylim()[0] >= plot.MIN_SPAN - 1e-9
