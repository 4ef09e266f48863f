"""Make fake installed distributions with ``gemzoo`` entry points, for plugin-loading tests."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path


def make_dist(monkeypatch, root: Path, dist: str, module: str, code: str, entry_name: str | None = None) -> None:
    """Write ``module.py`` and ``dist-0.1.dist-info`` with an entry point under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(code))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[gemzoo]\n{entry_name or module} = {module}\n")
    monkeypatch.syspath_prepend(str(root))  # undone after the test
    monkeypatch.delitem(sys.modules, module, raising=False)
