"""``gemzoo new-plugin``: for every kind, the generated distribution installs with ``pip install -e`` and its
own tests pass as generated. All kinds are installed into one throw-away environment (it sees this one's
packages through a .pth file) and their tests run in one pytest process; each kind then gets its verdict."""

import re
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import tomllib

from gemzoo.cli import main
from gemzoo.cli.new_plugin import KINDS, module_name, render, write_plugin
from gemzoo.errors import ConfigError, PluginError
from gemzoo.testing.timeouts import hang_guard


def plugin_name(kind: str) -> str:
    return f"scaffolded-{kind}"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """{kind: {test id: outcome}} from running every generated plugin's tests after an editable install."""
    root = tmp_path_factory.mktemp("scaffold")
    dists = [write_plugin(plugin_name(kind), kind, root / "src") for kind in KINDS]
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=hang_guard(300))
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]  # this environment: gemzoo (editable), torch, setuptools ...
    Path(purelib, "gemzoo-parent-env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-build-isolation", "--disable-pip-version-check",
                          *[a for d in dists for a in ("-e", str(d))]],
                         capture_output=True, text=True, timeout=hang_guard(600))
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    report = root / "junit.xml"
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                           f"--junitxml={report}", *[str(d / "tests") for d in dists]],
                          cwd=root, capture_output=True, text=True, timeout=hang_guard(900))
    outcomes: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
    for case in ET.parse(report).iter("testcase"):
        kind = next(k for k in KINDS if module_name(plugin_name(k)) in case.get("classname", ""))
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        outcome = "passed" if failed is None and skipped is None else "skipped" if failed is None else \
            f"failed: {failed.get('message', '')[:500]}"
        outcomes[kind][case.get("name")] = outcome
    outcomes["_output"] = proc.stdout[-4000:] + proc.stderr[-2000:]
    return outcomes


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_generated_plugin_installs_and_passes_its_tests(generated, kind):
    results = generated[kind]
    assert results, f"no test of the {kind} plugin ran:\n{generated['_output']}"
    bad = {name: out for name, out in results.items() if out != "passed"}
    assert not bad, f"{kind}: {bad}\n{generated['_output']}"


@pytest.mark.parametrize("kind", KINDS)
def test_distribution_layout(kind):
    name = plugin_name(kind)
    files = render(name, kind)
    mod = module_name(name)
    meta = tomllib.loads(files["pyproject.toml"])
    assert meta["build-system"]["build-backend"] == "setuptools.build_meta"
    assert meta["project"]["name"] == f"gemzoo-{name}" and meta["project"]["version"]
    assert meta["project"]["entry-points"]["gemzoo"] == {name: f"{mod}.plugin"}
    assert {f"{mod}/plugin.py", f"{mod}/__init__.py", f"tests/test_{mod}.py", "README.md"} <= set(files)
    for path, text in files.items():
        if path.endswith(".py"):
            compile(text, path, "exec")  # valid Python, every placeholder substituted
        assert "$" not in text.replace("$ ", ""), f"{path} has an unsubstituted placeholder"
    assert "@hookimpl\ndef gemzoo_register_" in files[f"{mod}/plugin.py"]
    assert 'GEMZOO_API = ">=1,<2"' in files[f"{mod}/plugin.py"]
    for path, text in files.items():  # gemzoo only through its public API (tests: also its test suites)
        if path.endswith(".py"):
            public = ("gemzoo.api", "gemzoo.testing") if path.startswith("tests/") else ("gemzoo.api",)
            used = set(re.findall(r"^\s*(?:from|import) (gemzoo\b[\w.]*)", text, re.M))
            assert used <= set(public), f"{path} imports {sorted(used - set(public))}"


def test_bad_names_taken_names_and_existing_folders(tmp_path, fresh_registry, capsys):
    for bad in ("MyAttn", "1attn", "my_attn", "my--attn", "class"):
        with pytest.raises(ConfigError, match="plugin name"):
            write_plugin(bad, "attention", tmp_path)
    with pytest.raises(PluginError, match="taken: attention 'reference'"):
        write_plugin("reference", "precision", tmp_path, registry=fresh_registry)
    assert main(["new-plugin", "myattn", "--kind", "attention", "--dir", str(tmp_path)]) == 0
    assert "pip install -e" in capsys.readouterr().out and (tmp_path / "gemzoo-myattn" / "pyproject.toml").is_file()
    assert main(["new-plugin", "myattn", "--kind", "attention", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
