"""docs/: the generated parts are current, and every relative link in the docs and the README resolves."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gemzoo.testing.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[1]
# Pages other issues write; a link to them is fine before they land.
PENDING = {ROOT / "docs" / "attention.md", ROOT / "docs" / "architecture.md", ROOT / "docs" / "plugins.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.multiprocess
def test_generated_docs_are_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=hang_guard(900))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_config_reference_lists_every_core_key():
    from dataclasses import fields

    from gemzoo import config

    text = (ROOT / "docs" / "config.md").read_text()
    for name, cls in config.SECTIONS.items():
        section = text.split(f"## [{name}]", 1)[1].split("\n## ", 1)[0]
        for f in fields(cls):
            assert f"| `{f.name}` |" in section, f"[{name}] {f.name} missing from docs/config.md"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists() and path not in PENDING:
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"
