"""`gemzoo config show|validate` work before the data is there; `train` still needs it."""

import json

import pytest

from gemzoo.cli import main
from gemzoo.errors import DataNotFound
from gemzoo.train.trainer import build_on_meta


@pytest.mark.parametrize("config", ["configs/hstu-ml1m.toml", "configs/sasrec-ml1m.toml"])
def test_validate_and_show_without_the_data_file(config, tmp_path, capsys):
    missing = f"data.path='{tmp_path / 'nowhere' / 'ratings.dat'}'"
    assert main(["config", "validate", config, "--set", missing]) == 0
    out = capsys.readouterr().out
    assert "OK without the data" in out and "no such file" in out and "Download MovieLens" in out
    assert main(["config", "show", config, "--set", missing]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "no such file" in shown["data_not_found"] and shown["model"]["family"] in ("hstu", "sasrec")


def test_train_and_the_plain_build_still_refuse_a_missing_file(tmp_path, capsys):
    from gemzoo.api import load_config

    cfg = load_config("configs/sasrec-ml1m.toml", overrides=[f"data.path='{tmp_path / 'ratings.dat'}'"])
    with pytest.raises(DataNotFound, match="no such file"):
        build_on_meta(cfg)
    assert main(["train", "--config", "configs/sasrec-ml1m.toml", "--steps", "1", "--out", str(tmp_path / "run"),
                 "--set", f"data.path='{tmp_path / 'ratings.dat'}'"]) != 0
    assert "no such file" in capsys.readouterr().err
