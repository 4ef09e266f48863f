import json
import subprocess
import sys

import pytest
from toy_plugin import install

from gemzoo.cli import main
from gemzoo.testing.timeouts import hang_guard


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


@pytest.mark.multiprocess
def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "gemzoo.cli", "list", "precision"], capture_output=True, text=True,
                         timeout=hang_guard(300))
    assert out.returncode == 0, out.stderr
    assert "bf16" in out.stdout


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
# on the CPU: the tests compare final losses bit for bit, which GPU reruns do not give (see docs/running.md on resume)
TOY_TOML = '[run]\nsteps = 10\nlog_every = 5\ndevice = "cpu"\n[model]\nfamily = "toy"\n[data]\nsource = "toy-data"\n' \
           '[checkpoint]\nevery = 5\n'


def _strict_json(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


@pytest.fixture
def toy_toml(tmp_path, fresh_registry):
    install(fresh_registry)
    path = tmp_path / "toy.toml"
    path.write_text(TOY_TOML)
    return path


@pytest.mark.slow
def test_train_twice_into_one_folder_is_refused_then_overwrite_and_resume_work(toy_toml, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--config", str(toy_toml), "--out", out, "--quiet"]) == 0
    first = _strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["train", "--config", str(toy_toml), "--out", out, "--quiet"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["train", "--config", str(toy_toml), "--out", out, "--quiet", "--overwrite"]) == 0
    assert _strict_json(capsys.readouterr().out.strip().splitlines()[-1])["final_loss"] == first["final_loss"]
    # resuming a finished run: nothing to train, the logged final loss, and valid JSON (no NaN)
    assert main(["train", "--config", str(toy_toml), "--out", out, "--quiet", "--resume"]) == 0
    stdout = capsys.readouterr().out
    assert "nothing to train" in stdout
    assert _strict_json(stdout.strip().splitlines()[-1])["final_loss"] == first["final_loss"]


@pytest.mark.slow
def test_resume_names_a_run_folder_or_says_it_does_not_exist(toy_toml, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", str(toy_toml), "--out", str(run), "--quiet", "--steps", "5"]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(toy_toml), "--resume", str(run), "--quiet"]) == 0  # continued in run/
    out = capsys.readouterr().out
    assert "at step 5" in out and _strict_json(out.strip().splitlines()[-1])["out_dir"] == str(run)
    assert main(["train", "--config", str(toy_toml), "--resume", str(tmp_path / "nope"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_with_another_model_shape_is_a_clear_error(toy_toml, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--config", str(toy_toml), "--out", out, "--quiet", "--steps", "5"]) == 0
    capsys.readouterr()
    code = main(["train", "--config", str(toy_toml), "--out", out, "--quiet", "--resume", "--set", "model.d_model=32"])
    err = capsys.readouterr().err
    assert code == 2 and "model.d_model is 16 in the checkpoint, 32 now" in err and "Traceback" not in err


@pytest.mark.parametrize("config,override,message", [
    ("gem-tiny.toml", "model.num_heads=3", "num_heads=3"),
    ("gem-tiny.toml", "data.batch_size=0", "batch_size must be >= 1"),
    # without its data file (none in the tests) the model is still built, from nominal sizes, and checked
    ("hstu-ml1m.toml", "model.relative_bias='bogus'", "relative_bias must be"),
    ("gem-tiny.toml", "plugins.attention='flex'", "lacks backward on 'cpu'"),
])
def test_config_validate_builds_the_dataset_and_the_model_on_meta(capsys, fresh_registry, config, override, message):
    path = str(ROOT / "configs" / config)
    assert main(["config", "validate", path, "--set", override, "--set", "run.device=cpu"]) == 2
    assert message in capsys.readouterr().err


def test_version_help_and_info(capsys, fresh_registry):
    import gemzoo

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"gemzoo {gemzoo.__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    assert "TOML config" in help_text and "train until step N" in help_text and "examples:" in help_text
    assert "--overwrite" in help_text
    import argparse

    from gemzoo.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("train", "plugins", "list", "config", "info"):
        bare = [a.dest for a in sub.choices[name]._actions if not a.help]
        assert not bare, f"gemzoo {name}: {bare} have no help text"
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"python", "torch", "triton", "torchrec", "fbgemm", "extension"} <= set(info)
    assert info["python"] == ".".join(map(str, sys.version_info[:3]))


def test_plugins_verbose_shows_hooks_and_names_whole(capsys, fresh_registry, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["plugins", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "hooks: register_attention" in out and "builtin.cpu_attention" in out
    assert "…" not in out


def test_plain_plugins_reads_metadata_and_names_every_builtin_whole(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "gemzoo.builtin.precision" in out and "…" not in out and "--verbose" in out


def _imported_modules(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('MODULES', *sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    return set(out.stdout.splitlines()[-1].split()[1:])


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["plugins"], ["runs", "/nonexistent"],
                                  ["train", "--help"], ["launch", "--help"]])
def test_fast_commands_import_no_torch(argv):
    code = f"from gemzoo.cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    modules = _imported_modules(code)
    assert "gemzoo.cli.main" in modules
    assert "torch" not in modules and not any(m.startswith("gemzoo_") for m in modules), argv


def test_plugins_json_into_a_closed_pipe_prints_no_traceback():
    script = ("import subprocess, sys\n"
              "p = subprocess.Popen([sys.executable, '-m', 'gemzoo.cli', 'plugins', '--json'], "
              "stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
              "p.stdout.close(); err = p.stderr.read(); p.wait()\n"  # no reader left: the first write fails
              "sys.stdout.write(err.decode())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout == "", out.stdout


def _every_command_parser(fresh_registry) -> dict:
    """gemzoo's own commands and those the installed plugins add (gemzoo plan), by name."""
    import argparse

    from gemzoo.cli import build_parser
    from gemzoo.cli.main import _add_plugin_commands

    parser = build_parser()
    _add_plugin_commands(parser)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_has_examples_in_its_help(fresh_registry):
    commands = _every_command_parser(fresh_registry)
    assert {"train", "launch", "plan"} <= set(commands)
    for name, parser in commands.items():
        assert "examples:" in (parser.epilog or ""), f"gemzoo {name} --help has no examples"


def test_every_config_an_example_names_exists(fresh_registry):
    """The examples of `gemzoo --help` and of every command's --help name files of this repository: each
    configs/*.toml they mention is there (a renamed config must take its examples along)."""
    import re

    from gemzoo.cli.main import EXAMPLES

    texts = {"gemzoo": EXAMPLES, **{name: p.epilog or "" for name, p in _every_command_parser(fresh_registry).items()}}
    named = {(name, path) for name, text in texts.items() for path in re.findall(r"configs/[\w./-]+\.toml", text)}
    assert {c for _, c in named} >= {"configs/gem-tiny.toml", "configs/gem-bench.toml",
                                     "configs/ablations/gem-tiny.toml"}
    missing = sorted(f"gemzoo {name}: {path}" for name, path in named if not (ROOT / path).is_file())
    assert not missing, f"examples name configs that do not exist: {missing}"


def test_every_gemzoo_environment_variable_is_documented():
    import re

    used = set()
    for path in [*ROOT.glob("gemzoo/**/*.py"), ROOT / "setup.py", *ROOT.glob("csrc/**/*.cpp")]:
        used |= set(re.findall(r"""(?:environ(?:\.get)?\(|\[|getenv\()\s*["'](GEMZOO_[A-Z_]+)["']""",
                               path.read_text()))
    used |= set(re.findall(r'NO_TORCHREC_ENV = "(GEMZOO_[A-Z_]+)"', (ROOT / "gemzoo" / "embedding.py").read_text()))
    readme = (ROOT / "README.md").read_text()
    assert used and not sorted(v for v in used if f"`{v}" not in readme)
