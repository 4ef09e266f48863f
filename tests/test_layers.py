"""Layers that hold, checked on the import statements themselves (ast), so a new violation
fails here by file and line:

- no core module imports gemzoo.builtin (built-ins are plugins: core reaches them through the registry);
- no model family imports gemzoo.train (models count their FLOPs and costs with gemzoo.flops);
- no plugin (its package, tests/ or bench/) imports gemzoo.builtin or the gemzoo.models.common internals
  (the public homes: gemzoo.attention for the reference, the mask rule and the attention sites,
  gemzoo.interfaces.precision for swap_linears/adopt_linear/BF16Linear, all re-exported by gemzoo.api);
- ``import gemzoo.jagged`` (and ``gemzoo.interfaces``, the kinds table, the registry and config, which derive
  from it) loads no gemzoo.builtin module;
- no import cycle inside gemzoo/ (imports inside functions count; ``if TYPE_CHECKING:`` blocks do not), and
  gemzoo/interfaces and gemzoo/errors.py import nothing of gemzoo above them.

A violation that must stay for a while is listed below with its issue (none are left); a fixed entry must be
removed from its set (the test says so), so the lists stay true.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from gemzoo.cli.new_plugin import KINDS as TEMPLATE_KINDS
from gemzoo.cli.new_plugin import render
from gemzoo.testing.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[1]

# file -> the forbidden modules it imports (none are allowed)
KNOWN_CORE_BUILTIN: dict[str, set[str]] = {}
KNOWN_PLUGIN_INTERNALS: dict[str, set[str]] = {}


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names (``from a import b`` gives a and a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _hits(paths, forbidden, root: Path = ROOT) -> dict[str, set[str]]:
    found = {}
    for path in paths:
        bad = {m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in forbidden)}
        bad = {m for m in bad if not any(b != m and m.startswith(b + ".") for b in bad)}  # a.b covers a.b.c
        if bad:
            found[path.relative_to(root).as_posix()] = bad
    return found


def _compare(found: dict[str, set[str]], known: dict[str, set[str]], what: str) -> None:
    new = {f: sorted(m - known.get(f, set())) for f, m in found.items() if m - known.get(f, set())}
    fixed = sorted(f for f in known if f not in found or not (known[f] & found[f]))
    assert not new, f"{what}: new violations {new}; import the public API instead (gemzoo.interfaces, the registry)"
    assert not fixed, f"{what}: {fixed} no longer violate: remove them from this test's known set"


def test_core_does_not_import_builtin():
    core = [p for p in (ROOT / "gemzoo").rglob("*.py") if "builtin" not in p.relative_to(ROOT / "gemzoo").parts]
    _compare(_hits(core, {"gemzoo.builtin"}), KNOWN_CORE_BUILTIN, "core modules importing gemzoo.builtin")


def test_models_do_not_import_train():
    found = _hits((ROOT / "gemzoo" / "models").rglob("*.py"), {"gemzoo.train"})
    assert not found, f"model families import gemzoo.train: {found}; use gemzoo.flops"


@pytest.mark.slow
def test_plugins_use_public_api_only():
    paths = [p for pkg in ROOT.glob("plugins/gemzoo-*")
             for sub in [*pkg.glob("gemzoo_*"), pkg / "tests", pkg / "bench"]
             if sub.is_dir() for p in sub.rglob("*.py")]
    assert paths, "no plugin sources found"
    _compare(_hits(paths, {"gemzoo.builtin", "gemzoo.models.common"}), KNOWN_PLUGIN_INTERNALS,
             "plugins importing gemzoo internals")


@pytest.mark.parametrize("kind", TEMPLATE_KINDS)
def test_new_plugin_templates_use_public_api_only(kind, tmp_path):
    """What ``gemzoo new-plugin --kind KIND`` writes (its package and tests) obeys the same rule."""
    paths = []
    for rel, text in render("layers-check", kind).items():
        if rel.endswith(".py"):
            paths.append(tmp_path / rel)
            paths[-1].parent.mkdir(parents=True, exist_ok=True)
            paths[-1].write_text(text)
    assert paths, f"the {kind} template rendered no Python file"
    found = _hits(paths, {"gemzoo.builtin", "gemzoo.models.common"}, root=tmp_path)
    assert not found, f"the {kind} plugin template imports gemzoo internals: {found}"


def test_public_api_holds_the_objects_the_builtins_register():
    """gemzoo.api re-exports the very objects the built-ins use: the reference, its capabilities, BF16Linear
    and the attention sites."""
    import gemzoo.api as api
    import gemzoo.attention as attention
    import gemzoo.builtin.attention as builtin_attention
    import gemzoo.builtin.precision as builtin_precision

    assert builtin_attention.reference_attention is api.reference_attention is attention.reference_attention
    assert builtin_attention.REFERENCE.capabilities is attention.REFERENCE_CAPABILITIES
    assert builtin_precision.BF16Linear is api.BF16Linear
    assert api.JaggedAttention is attention.JaggedAttention and api.attention_sites is attention.attention_sites


def test_the_scanner_sees_every_import_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import gemzoo.builtin.memory\nfrom gemzoo import builtin\nfrom gemzoo.builtin.x import y\n"
                 "def g():\n    from gemzoo.train import trainer\n")
    mods = imported_modules(f)
    assert {"gemzoo.builtin.memory", "gemzoo.builtin", "gemzoo.builtin.x", "gemzoo.train"} <= mods


@pytest.mark.multiprocess
@pytest.mark.parametrize("module", ["gemzoo.jagged", "gemzoo.interfaces", "gemzoo.kinds", "gemzoo.registry",
                                    "gemzoo.config", "gemzoo.attention", "gemzoo.api"])
def test_import_loads_no_builtin(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('gemzoo.builtin')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=hang_guard(300)).stdout.strip()
    assert out == "[]", f"import {module} loaded {out}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def gemzoo_import_graph() -> dict[str, set[str]]:
    """gemzoo module -> the gemzoo modules it imports (anywhere but under ``if TYPE_CHECKING:``); an import of
    the top-level package ``gemzoo`` itself is how a package is used, not an edge."""
    paths = {_module_name(p): p for p in (ROOT / "gemzoo").rglob("*.py")}
    graph = {}
    for mod, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # drop TYPE_CHECKING blocks
            test = getattr(node, "test", None)
            if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
                node.body = []
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                         for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in paths:
                    name = name.rpartition(".")[0]
                if name and name != mod and "." in name:
                    edges.add(name)
        graph[mod] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_gemzoo():
    cycles = set(_cycles(gemzoo_import_graph()))
    assert not cycles, f"import cycles in gemzoo/: {[sorted(c) for c in cycles]}"


def test_declarations_import_no_layer_above():
    graph = gemzoo_import_graph()
    for mod in [m for m in graph if m.startswith("gemzoo.interfaces") or m == "gemzoo.errors"]:
        above = {t for t in graph[mod] if not (t.startswith("gemzoo.interfaces") or t == "gemzoo.errors")}
        assert not above, f"{mod} is a declaration module but imports {sorted(above)}"


def test_the_cycle_check_sees_a_cycle_through_a_function_local_import():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert _cycles(graph) == [frozenset({"a.x", "a.y", "a.z"})]
