"""The test suite itself: it must pass in one process on a GPU machine as well as on a CPU one.

Two things broke that before: a helper module that switched the Triton interpreter on at import (every
later launch in the process then ran interpreted), and helper modules of different plugins sharing a
bare name on ``sys.path`` (the first one imported wins for every plugin).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gemzoo.testing.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[1]
TEST_DIRS = [ROOT / "tests", *sorted((ROOT / "plugins").glob("*/tests"))]


def _module_level_statements(tree: ast.Module):
    """Top-level statements, skipping the bodies of ``if __name__ == "__main__":`` guards."""
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            continue
        yield node


def test_no_test_module_switches_the_interpreter_on_at_import():
    offenders = []
    for d in TEST_DIRS:
        for path in d.rglob("*.py"):
            if path.name == "conftest.py" and path.parent == ROOT:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in _module_level_statements(tree):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                    continue
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # a docstring
                    continue
                if "TRITON_INTERPRET" in ast.unparse(node) and "environ" in ast.unparse(node):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, (
        "only the root conftest.py may set TRITON_INTERPRET in the pytest process (and only without CUDA); "
        f"run interpreter cases in a subprocess instead: {offenders}")


def test_interpreter_is_off_in_process_on_a_gpu_machine():
    if torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET", "0") != "1", "the interpreter is on in a CUDA test process"
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1", "select_triton_backend should switch the interpreter on"


def test_plugin_test_helper_modules_have_unique_names():
    seen: dict[str, list[str]] = {}
    for d in TEST_DIRS:
        for path in d.glob("*.py"):
            if path.name.startswith("test_") or path.name in ("conftest.py", "__init__.py"):
                continue
            seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"helper modules share a name on sys.path; give each a plugin-specific name: {clashes}"
    generic = sorted(n for n in seen if n in {"cases", "helpers", "utils", "common", "support"})
    assert not generic, f"give these helper modules plugin-specific names: {generic}"


@pytest.mark.multiprocess
def test_a_plugin_runs_its_own_tests_from_its_folder():
    """``pytest`` inside a plugin's folder (its own pyproject the config, no root conftest) loads
    gemzoo.testing.pytest_plugin, which picks Triton's backend and registers gemzoo's markers: a Triton cast runs
    (under the interpreter on a CPU), and a module marked ``multiprocess`` collects under --strict-markers."""
    def pytest_in(plugin: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a fresh shell has it
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                              cwd=ROOT / "plugins" / plugin, env=env, capture_output=True, text=True,
                              timeout=hang_guard(600))
        assert proc.returncode == 0, f"pytest {' '.join(args)} in plugins/{plugin}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"

    pytest_in("gemzoo-mxfp8", "tests/test_cast.py", "-k", "test_triton_rowwise_casts")
    pytest_in("gemzoo-ncclx", "--collect-only", "tests/test_ncclx.py")
