import json
import subprocess
import sys

import pytest

from gemzoo.cli import main
from toy_plugin import install


def test_plugins_json_lists_every_builtin(capsys, fresh_registry):
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    registered = {}
    for row in rows:
        for kind, names in row["registered"].items():
            registered.setdefault(kind, set()).update(names)
    assert {"reference", "sdpa-padded", "flex"} <= registered["attention"]
    assert {"fp32", "bf16"} <= registered["precision"]
    assert {"none", "full-ac"} <= registered["memory"]
    assert {"torchrec"} <= registered["planner"] and {"torch"} <= registered["comms"]
    assert {"none"} <= registered["batching"]
    assert all(row["version"] for row in rows)


def test_list_with_pattern(capsys, fresh_registry):
    assert main(["list", "attention", "s*"]) == 0
    out = capsys.readouterr().out
    assert "sdpa-padded" in out and "reference" not in out


def test_unknown_plugin_exits_nonzero_naming_kernels(tmp_path, capsys, fresh_registry):
    install(fresh_registry)
    cfg = tmp_path / "toy.toml"
    cfg.write_text('[model]\nfamily = "toy"\n[data]\nsource = "toy-data"\n')
    code = main(["train", "--config", str(cfg), "--plugins", "nosuch", "--quiet"])
    err = capsys.readouterr().err
    assert code != 0
    assert "nosuch" in err and "reference" in err and "sdpa-padded" in err


def test_config_validate_and_bad_key(tmp_path, capsys, fresh_registry):
    install(fresh_registry)
    good = tmp_path / "good.toml"
    good.write_text('[model]\nfamily = "toy"\n[data]\nsource = "toy-data"\n')
    assert main(["config", "validate", str(good)]) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nfamily = "toy"\nwidth = 3\n[data]\nsource = "toy-data"\n')
    assert main(["config", "validate", str(bad)]) == 2
    assert "model.width" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "gemzoo.cli", "list", "precision"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "bf16" in out.stdout
