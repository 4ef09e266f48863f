"""Plugins reach gemzoo only through its public API.

Every module under ``plugins/`` imports gemzoo only as ``gemzoo.api``; a plugin's tests and benchmarks may also
import the conformance harness ``gemzoo.testing`` (and its submodules). No distribution imports another one's
private names (a module or name starting with ``_``), and every entry-point module declares the API range it
was written for.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
HARNESS_FOLDERS = {"tests", "bench"}


def _distributions() -> dict[str, Path]:
    """Top-level package name -> distribution folder, for every plugin distribution."""
    found = {}
    for folder in sorted(PLUGINS.iterdir()):
        for package in folder.iterdir():
            if package.is_dir() and (package / "__init__.py").exists():
                found[package.name] = folder
    return found


DISTRIBUTIONS = _distributions()


def _imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) for every import in ``tree``, function-local ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return out


def _owner(path: Path) -> str:
    """The top-level package of the distribution that holds ``path``."""
    folder = path.relative_to(PLUGINS).parts[0]
    return next(pkg for pkg, dist in DISTRIBUTIONS.items() if dist.name == folder)


def _gemzoo_allowed(module: str, names: list[str], harness: bool) -> bool:
    if module == "gemzoo.api":
        return True
    if harness and (module == "gemzoo.testing" or module.startswith("gemzoo.testing.")):
        return True
    # ``from gemzoo import api`` (or ``testing`` in harness code) names the public module itself
    allowed = {"api", "testing"} if harness else {"api"}
    return module == "gemzoo" and bool(names) and set(names) <= allowed


def violations(path: Path) -> list[str]:
    """Every import in ``path`` that breaks the rules, as ``file:line: message``."""
    rel = path.relative_to(ROOT)
    harness = bool(HARNESS_FOLDERS & set(path.relative_to(PLUGINS).parts[1:-1]))
    owner = _owner(path)
    out = []
    for line, module, names in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        top = module.split(".")[0]
        if top == "gemzoo" and not _gemzoo_allowed(module, names, harness):
            shown = f"from {module} import {', '.join(names)}" if names else f"import {module}"
            where = "gemzoo.api (or gemzoo.testing in tests and benchmarks)" if harness else "gemzoo.api"
            out.append(f"{rel}:{line}: `{shown}` reaches gemzoo's internals; import it from {where}")
        elif top in DISTRIBUTIONS and top != owner:
            private = [part for part in module.split(".")[1:] + names if part.startswith("_")]
            if private:
                out.append(f"{rel}:{line}: imports {', '.join(private)} from {module}, private to "
                           f"{DISTRIBUTIONS[top].name}; use that distribution's public names")
    return out


def _sources() -> list[Path]:
    return sorted(p for p in PLUGINS.rglob("*.py") if "build" not in p.relative_to(PLUGINS).parts)


def test_plugins_import_gemzoo_only_through_its_public_api():
    found = [v for path in _sources() for v in violations(path)]
    assert not found, "\n".join(found)


def test_gemzoo_attribute_access_stays_public():
    """``import gemzoo`` then ``gemzoo.registry`` would bypass the check above: plugins use ``gemzoo.api``."""
    found = []
    for path in _sources():
        for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"^\s*import gemzoo\s*(#.*)?$", text):
                found.append(f"{path.relative_to(ROOT)}:{line}: `import gemzoo`; use `from gemzoo import api`")
    assert not found, "\n".join(found)


def test_the_check_catches_internal_and_private_imports(tmp_path, monkeypatch):
    plugin = tmp_path / "plugins" / "gemzoo-x"
    (plugin / "gemzoo_x").mkdir(parents=True)
    (plugin / "gemzoo_x" / "__init__.py").write_text("")
    (plugin / "tests").mkdir()
    bad = plugin / "gemzoo_x" / "ops.py"
    bad.write_text("from gemzoo.jagged import positions\nfrom gemzoo_jfa.ops import _launch_fwd\n"
                   "from gemzoo.testing import attention_cases\nfrom gemzoo.api import hookimpl\n")
    harness = plugin / "tests" / "test_x.py"
    harness.write_text("from gemzoo.testing.attention import AttentionCase\nfrom gemzoo import api, testing\n"
                       "from gemzoo_jfa.family import KernelOptions\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PLUGINS", tmp_path / "plugins")
    monkeypatch.setattr(sys.modules[__name__], "DISTRIBUTIONS",
                        {"gemzoo_x": plugin, "gemzoo_jfa": tmp_path / "plugins" / "gemzoo-jfa"})
    found = violations(bad)
    assert [v.split(":")[1] for v in found] == ["1", "2", "3"], found
    assert "_launch_fwd" in found[1]
    assert violations(harness) == []


def _entry_points(folder: str) -> list[str]:
    text = (PLUGINS / folder / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.entry-points.gemzoo]", 1)
    assert len(section) == 2, f"plugins/{folder}/pyproject.toml declares no [project.entry-points.gemzoo]"
    modules = re.findall(r'^\S+\s*=\s*"([\w.]+)"', section[1].split("\n[", 1)[0], flags=re.M)
    assert modules, f"plugins/{folder}/pyproject.toml names no entry-point module"
    return modules


def _package_modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of a plugin's package."""
    root = DISTRIBUTIONS[package]
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


FOLDERS = sorted({d.name for d in DISTRIBUTIONS.values()})
PACKAGES = sorted(DISTRIBUTIONS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_entry_point_module_declares_its_api_range(folder):
    for module in _entry_points(folder):
        path = PLUGINS / folder / (module.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        declared = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "GEMZOO_API" for t in node.targets)
                    and isinstance(node.value, ast.Constant)]
        assert declared == [">=1,<2"], f"{module} must declare GEMZOO_API = \">=1,<2\" at module level"


@pytest.mark.parametrize("package", PACKAGES)
def test_only_the_entry_point_module_registers(package):
    """The hook marker and the registry are imported by the entry-point module alone; the modules with the
    work import nothing from it (the package's ``__init__`` may re-export its names), so a distribution's
    import graph has no circle through it."""
    entry = set(_entry_points(DISTRIBUTIONS[package].name))
    found = []
    for module, path in _package_modules(package).items():
        if module in entry:
            continue
        for line, name, names in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if name == "gemzoo.api" and {"hookimpl", "registry"} & set(names):
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {sorted({'hookimpl', 'registry'} & set(names))}")
            if module != package and (name in entry or any(  # the package's __init__ may re-export it
                    name == e.rsplit(".", 1)[0] and e.rsplit(".", 1)[1] in names for e in entry)):
                found.append(f"{path.relative_to(ROOT)}:{line}: imports the entry-point module {name}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_plugin(package):
    """Every import counted, function-local ones included."""
    modules = _package_modules(package)
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for _, name, names in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            targets = [f"{name}.{n}" for n in names if f"{name}.{n}" in modules] or [name]
            graph[module] |= {t for t in targets if t in modules and t != module}
    done, on_path, cycles = set(), [], []

    def visit(m):
        if m in on_path:
            cycles.append(" -> ".join(on_path[on_path.index(m):] + [m]))
            return
        if m in done:
            return
        on_path.append(m)
        for t in sorted(graph[m]):
            visit(t)
        on_path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_the_cycle_and_registration_checks_can_fail(tmp_path, monkeypatch):
    plugin = tmp_path / "plugins" / "gemzoo-x"
    (plugin / "gemzoo_x").mkdir(parents=True)
    (plugin / "pyproject.toml").write_text('[project.entry-points.gemzoo]\nx = "gemzoo_x.plugin"\n')
    (plugin / "gemzoo_x" / "__init__.py").write_text("")
    (plugin / "gemzoo_x" / "plugin.py").write_text("from gemzoo.api import hookimpl\nfrom gemzoo_x.ops import f\n")
    (plugin / "gemzoo_x" / "ops.py").write_text("def f():\n    from gemzoo_x.plugin import KERNEL\n"
                                                "    from gemzoo.api import registry\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PLUGINS", tmp_path / "plugins")
    monkeypatch.setattr(sys.modules[__name__], "DISTRIBUTIONS", {"gemzoo_x": plugin})
    with pytest.raises(AssertionError, match="gemzoo_x.ops -> gemzoo_x.plugin -> gemzoo_x.ops"):
        test_no_import_cycle_inside_a_plugin("gemzoo_x")
    with pytest.raises(AssertionError, match=r"ops.py:3: imports \['registry'\]"):
        test_only_the_entry_point_module_registers("gemzoo_x")
