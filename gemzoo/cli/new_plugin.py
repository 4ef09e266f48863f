"""``gemzoo new-plugin NAME --kind KIND``: write a plugin distribution that installs and passes its tests.

    gemzoo new-plugin myattn --kind attention            # -> ./gemzoo-myattn/
    pip install -e gemzoo-myattn && pytest gemzoo-myattn/tests

The distribution follows plugins/gemzoo-jfa: ``pyproject.toml`` (``[build-system]``, ``version``, the
``gemzoo`` entry point), ``gemzoo_<name>/plugin.py`` with the hookimpl and its ``GEMZOO_API`` range, one module
holding the implementation the author fills in, ``tests/`` that run the kind's conformance checks against the
*installed* entry point, and a README. The generated code imports gemzoo only through ``gemzoo.api`` (its tests
also use ``gemzoo.testing``). Every kind starts from a working default (the attention kernel calls the
``reference`` kernel, the precision policy runs fp32, the planner keeps tables whole, ...), so the tests pass as
generated and keep passing while the author replaces the default.

The files are templates shipped with gemzoo (``gemzoo/cli/templates``): the shared ones at the top, and per kind
a folder with ``template.json`` (the README's fields and what ``plugin.py`` registers), the implementation
module and the test module. ``string.Template`` fills ``$name``, ``$mod``, ``$cls``, ``$func`` and friends.
"""

from __future__ import annotations

import json
import keyword
import re
from importlib.resources import files
from pathlib import Path
from string import Template

from gemzoo import kinds, registry
from gemzoo.errors import ConfigError, PluginError

NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
TEMPLATES = files("gemzoo.cli") / "templates"

_template_kinds = {p.name for p in TEMPLATES.iterdir() if p.is_dir() and (p / "template.json").is_file()}
_stale = _template_kinds - set(kinds.names())
assert not _stale, f"scaffold templates for kinds that gemzoo.kinds does not have: {sorted(_stale)}"
# The kinds `new-plugin --kind` offers: those of the kinds table (in its order) that have a template. A kind added
# to the table without one is simply not offered yet.
KINDS = tuple(name for name in kinds.names() if name in _template_kinds)


def _text(*parts: str) -> str:
    return TEMPLATES.joinpath(*parts).read_text(encoding="utf-8")


def template(kind: str) -> dict:
    """The ``template.json`` of ``kind``: impl, summary, protocol, use, fill, tests and plugin fields."""
    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
    return json.loads(_text(kind, "template.json"))


def module_name(name: str) -> str:
    return "gemzoo_" + name.replace("-", "_")


def check_name(name: str, *, registry=None) -> None:
    if not NAME.match(name):
        raise ConfigError(f"plugin name {name!r}: use lower-case letters and digits, words joined by '-' "
                          "(e.g. myattn, my-fp8)")
    if keyword.iskeyword(name.replace("-", "_")):
        raise ConfigError(f"plugin name {name!r} is a Python keyword; choose another")
    if registry is not None:
        entry = registry.find(name)
        if entry is not None:
            raise PluginError(f"the name {name!r} is taken: {entry.kind} {name!r} of distribution "
                              f"{entry.distribution}. Plugin names are unique across kinds; choose another")


def render(name: str, kind: str) -> dict[str, str]:
    """Relative path -> file text of the distribution ``gemzoo-<name>`` for ``kind``."""
    t = template(kind)
    mod = module_name(name)
    words = re.split(r"[-_]", name)
    values = {"name": name, "mod": mod, "kind": kind, "func": "_".join(words),
              "cls": "".join(w[:1].upper() + w[1:] for w in words), "impl": t["impl"],
              "summary": f"{t['summary']} ({name})", "hook": kinds.kind(kind).hook,
              "tiny_run": _text("tiny_run.py.tmpl")}

    def sub(text: str, **more: str) -> str:
        return Template(text).substitute(values, **more)

    # Fields of template.json refer to $name etc. themselves: substitute them first.
    plugin = {k: sub(v) for k, v in t["plugin"].items()}
    api_imports = ", ".join(filter(None, [plugin.pop("core", None), "hookimpl"]))
    readme = {k: sub(t[k]) for k in ("protocol", "use", "fill", "tests")}
    return {
        "pyproject.toml": sub(_text("pyproject.toml.tmpl")),
        f"{mod}/__init__.py": sub(_text("__init__.py.tmpl")),
        f"{mod}/plugin.py": sub(_text("plugin.py.tmpl"), api_imports=api_imports, **plugin),
        f"{mod}/{t['impl']}.py": sub(_text(kind, f"{t['impl']}.py.tmpl")),
        f"tests/test_{mod}.py": sub(_text(kind, "test.py.tmpl")),
        "README.md": sub(_text("README.md.tmpl"), **readme),
    }


def write_plugin(name: str, kind: str, dest: str | Path = ".", *, registry=None) -> Path:
    """Write ``dest/gemzoo-<name>/``; refuses an existing folder and a name already registered."""
    check_name(name, registry=registry)
    rendered = render(name, kind)
    root = Path(dest) / f"gemzoo-{name}"
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another --dir or name")
    for rel, text in rendered.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def cmd_new_plugin(args) -> int:
    root = write_plugin(args.name, args.kind, args.dir, registry=registry)
    print(f"wrote {root}/ ({args.kind} plugin {args.name!r}). Next:\n"
          f"  pip install -e {root}\n  gemzoo list {args.kind} {args.name}\n  pytest {root}/tests")
    return 0
