"""The README's "Write a plugin" recipe works as written: the example distribution is built from the
README's own text, installed (offline, no dependencies) into a temporary target, found through its entry
point, and passes the conformance snippet the README shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gemzoo.testing.timeouts import hang_guard

README = Path(__file__).resolve().parents[1] / "README.md"


def recipe_files(text: str) -> dict[str, str]:
    """{path: content} of the example: every path in the layout block, its content from the code block
    whose first line is ``# <path>`` ("(empty)" files are empty)."""
    section = text.split("## Write a plugin", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.S)
    layout = next(b for b in blocks if b.lstrip().startswith("gemzoo-"))
    root, *entries = [line.strip() for line in layout.strip().splitlines()]
    by_path = {b.split("\n", 1)[0][2:].strip(): b.split("\n", 1)[1] for b in blocks if b.startswith("# ")}
    files = {}
    for entry in entries:
        path, _, note = entry.partition(" ")
        if "(empty)" in note:
            files[path] = ""
        else:
            assert path in by_path, f"README lists {path} in the layout but shows no '# {path}' block"
            files[path] = by_path[path]
    return {f"{root.rstrip('/')}/{p}": c for p, c in files.items()}


@pytest.mark.multiprocess
def test_readme_recipe_builds_installs_and_passes_conformance(tmp_path):
    files = recipe_files(README.read_text())
    assert any(p.endswith("pyproject.toml") for p in files) and any(p.endswith("plugin.py") for p in files)
    for path, content in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(content)
    dist = tmp_path / next(iter(files)).split("/")[0]
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(target), str(dist)],
                         capture_output=True, text=True, timeout=hang_guard(900))
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    listed = subprocess.run([sys.executable, "-m", "gemzoo.cli", "list", "attention"], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=hang_guard(900))
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^myattn\s+per-sequence softmax attention", listed.stdout, flags=re.M), listed.stdout
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                           capture_output=True, text=True, env=env, cwd=dist, timeout=hang_guard(1800))
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert re.search(r"(\d+) passed", tests.stdout) and " failed" not in tests.stdout, tests.stdout[-2000:]
