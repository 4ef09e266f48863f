"""The plugin manager: built-ins, installed entry points (group ``gemzoo``), blocking, API ranges and load errors.

Block a plugin with ``--plugins no:NAME`` or ``GEMZOO_DISABLE_PLUGINS=name1,name2`` (distribution or
plugin names). ``GEMZOO_DISABLE_PLUGIN_AUTOLOAD=1`` loads built-ins only.

A plugin's entry-point module may declare the range of gemzoo API versions it was written for, as a PEP 440
specifier: ``GEMZOO_API = ">=1,<2"``. A plugin whose range excludes :data:`API_VERSION` (or whose range is not
a valid specifier) is not registered: it is recorded as a load failure naming the range, this API version and
the fix, and the other plugins keep working. A plugin that declares no range is accepted.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pluggy
import tomllib
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from gemzoo import hookspecs

hookimpl = pluggy.HookimplMarker("gemzoo")

ENTRY_POINT_GROUP = "gemzoo"

# The version of the public plugin API (gemzoo.api re-exports it): MAJOR.MINOR, where a minor release only adds
# names and a major one may change or remove them.
API_VERSION = "1.1"
API_ATTRIBUTE = "GEMZOO_API"  # the entry-point module's declared range, e.g. ">=1,<2"

BUILTIN_MODULES = (
    "gemzoo.builtin.attention",
    "gemzoo.builtin.cpu_attention",
    "gemzoo.builtin.precision",
    "gemzoo.builtin.planner",
    "gemzoo.builtin.comms",
    "gemzoo.builtin.memory",
    "gemzoo.builtin.batching",
    "gemzoo.builtin.models",
    "gemzoo.builtin.datasets",
)


@dataclass
class PluginInfo:
    """One loaded (or failed) plugin, as ``gemzoo plugins`` shows it."""

    name: str
    distribution: str
    version: str
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)  # kind -> names
    error: str | None = None


def blocked_names() -> set[str]:
    raw = os.environ.get("GEMZOO_DISABLE_PLUGINS", "")
    return {n.strip() for n in raw.split(",") if n.strip()}


def _gemzoo_version() -> str:
    try:
        return md.version("gemzoo")
    except md.PackageNotFoundError:
        return "0+unknown"


class PluginHost:
    """Owns the pluggy PluginManager and remembers where each plugin came from."""

    def __init__(self, *, autoload: bool | None = None, blocked: set[str] | None = None):
        self.pm = pluggy.PluginManager("gemzoo")
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.blocked = set(blocked_names() if blocked is None else blocked)
        self.skipped: dict[str, str] = {}  # entry-point name -> distribution, for plugins blocked by name
        if autoload is None:
            autoload = os.environ.get("GEMZOO_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
        self._load_builtins()
        if autoload:
            self._load_entry_points()

    def _load_builtins(self) -> None:
        version = _gemzoo_version()
        for modname in BUILTIN_MODULES:
            short = modname.rsplit(".", 1)[-1]
            if f"builtin.{short}" in self.blocked:
                continue
            module = importlib.import_module(modname)
            self.pm.register(module, name=modname)
            self.infos[modname] = PluginInfo(modname, "gemzoo", version, _hook_names(self.pm, module))

    def _load_entry_points(self) -> None:
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            if ep.name in self.blocked or dist in self.blocked:
                self.skipped[ep.name] = dist
                continue
            if self.pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
                refused = api_mismatch(declared_api(plugin, ep.module), ep.name, dist)
                if refused is None:
                    self.pm.register(plugin, name=ep.name)
            except (Exception, SystemExit, KeyboardInterrupt) as exc:  # a broken plugin must not take the others
                # down, nor end the process: sys.exit() or a KeyboardInterrupt at its import is its load failure
                self.infos[ep.name] = PluginInfo(
                    ep.name, dist, version, error=f"{type(exc).__name__}: {exc}"
                )
                continue
            if refused is not None:
                self.infos[ep.name] = PluginInfo(ep.name, dist, version, error=refused)
                continue
            self.infos[ep.name] = PluginInfo(ep.name, dist, version, _hook_names(self.pm, plugin))

    def register(self, plugin, name: str, distribution: str = "<local>", version: str = "0") -> bool:
        """Register a plugin object by hand (tests, notebooks, third parties without packaging). Its
        ``GEMZOO_API`` range is checked as an installed plugin's is: a plugin refused is recorded as failed
        (``failed()``, ``gemzoo plugins``) and not registered. Returns whether it was registered."""
        refused = api_mismatch(declared_api(plugin), name, distribution)
        if refused is not None:
            self.infos[name] = PluginInfo(name, distribution, version, error=refused)
            return False
        self.pm.register(plugin, name=name)
        self.infos[name] = PluginInfo(name, distribution, version, _hook_names(self.pm, plugin))
        return True

    def blocked_by(self, name: str) -> str | None:
        """What blocks ``name`` (a plugin, distribution or first-party registered name): the environment
        variable or ``--plugins no:``; None if nothing does."""
        dist = first_party_plugins().get(name, (None, None))[0]
        keys = {name} | ({dist} if dist else set())
        keys |= {ep for ep, d in self.skipped.items() if d in keys}
        hits = keys & self.blocked
        if not hits:
            return None
        return "GEMZOO_DISABLE_PLUGINS" if hits & blocked_names() else "--plugins no:" + sorted(hits)[0]

    def call_each(self, hook_name: str, **kwargs) -> dict[str, str]:
        """Call every implementation of ``hook_name`` on its own, as plugin loading is isolated: one that
        raises is recorded as that plugin's error (``gemzoo plugins`` shows it) and the others still run.
        Returns {plugin name: error} for those that raised."""
        errors = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            try:
                impl.function(**{a: kwargs[a] for a in impl.argnames})
            except (Exception, SystemExit) as exc:  # sys.exit() in a plugin's hook ends the plugin, not gemzoo
                errors[impl.plugin_name] = f"{hook_name} raised {type(exc).__name__}: {exc}"
                info = self.infos.get(impl.plugin_name)
                if info is not None:
                    info.error = errors[impl.plugin_name]
        return errors

    def failed(self) -> dict[str, PluginInfo]:
        return {n: i for n, i in self.infos.items() if i.error}


def declared_api(plugin, module: str | None = None):
    """The ``GEMZOO_API`` range a plugin declares: an attribute of the plugin object (its entry-point module,
    usually), else of ``module`` (the module an entry point such as ``pkg.mod:obj`` names); None if neither
    declares one."""
    declared = getattr(plugin, API_ATTRIBUTE, None)
    if declared is None and module is not None:
        declared = getattr(sys.modules.get(module), API_ATTRIBUTE, None)
    return declared


def api_mismatch(declared, plugin: str, distribution: str) -> str | None:
    """Why a plugin declaring the API range ``declared`` cannot load under :data:`API_VERSION`, or None when
    it can (a range that includes this version, or no range at all)."""
    if declared is None:
        return None
    fix = (f"upgrade the plugin (pip install -U {distribution}) to a release written for gemzoo API "
           f"{API_VERSION}, or install a gemzoo whose API version its range includes")
    if not isinstance(declared, str):
        return (f"plugin {plugin!r} ({distribution}) declares {API_ATTRIBUTE} = {declared!r}, which is not a "
                f"PEP 440 version specifier; write a string such as {API_ATTRIBUTE} = \">=1,<2\"")
    try:
        wanted = SpecifierSet(declared)
    except InvalidSpecifier as exc:
        return (f"plugin {plugin!r} ({distribution}) declares {API_ATTRIBUTE} = {declared!r}, which is not a "
                f"valid PEP 440 version specifier ({exc}); write a range such as {API_ATTRIBUTE} = \">=1,<2\"")
    if wanted.contains(API_VERSION, prereleases=True):
        return None
    return (f"plugin {plugin!r} ({distribution}) needs gemzoo API {declared} ({API_ATTRIBUTE}), but this gemzoo "
            f"provides API {API_VERSION}; {fix}")


def source_tree_plugins_dir() -> Path | None:
    """``plugins/`` of the gemzoo source checkout this package runs from, if it does."""
    folder = Path(__file__).resolve().parent.parent / "plugins"
    return folder if (folder.parent / "pyproject.toml").is_file() and folder.is_dir() else None


def _registered_names(source: str) -> list[str]:
    """The literal names a plugin module passes to ``register(...)``."""
    return re.findall(r"""\bregister\(\s*["']([\w.-]+)["']""", source)


def _module_file(root: Path, module: str) -> Path | None:
    """The source file of ``module`` (dotted) under ``root``: ``a/b.py`` or ``a/b/__init__.py``."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _tree_plugins(root: Path) -> dict[str, tuple[str, Path | None]]:
    """Registered name -> (distribution, folder) of each distribution under ``root`` (``plugins/``): its name
    and ``gemzoo`` entry points from its ``pyproject.toml``, the names from each entry-point module."""
    found: dict[str, tuple[str, Path | None]] = {}
    for meta in sorted(root.glob("*/pyproject.toml")):
        try:
            project = tomllib.loads(meta.read_text(encoding="utf-8")).get("project", {})
        except (OSError, tomllib.TOMLDecodeError):
            continue  # a folder that is not a plugin distribution
        dist = project.get("name")
        for ep_name, target in project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {}).items():
            path = _module_file(meta.parent, target.partition(":")[0].strip())
            names = _registered_names(path.read_text(errors="replace")) if path else []
            for name in (*names, ep_name):
                found.setdefault(name, (dist, meta.parent))
    return found


def _installed_plugins() -> dict[str, tuple[str, Path | None]]:
    """Registered name -> (distribution, None) of the installed ``gemzoo`` entry points, read from their
    distributions' files without importing them (editable installs, which list no module files, give the
    entry-point name only)."""
    found: dict[str, tuple[str, Path | None]] = {}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if ep.dist is None:
            continue
        want = ep.module.replace(".", "/")
        names: list[str] = []
        for f in ep.dist.files or ():
            if str(f) in (want + ".py", want + "/__init__.py"):
                try:
                    names = _registered_names(Path(ep.dist.locate_file(f)).read_text(errors="replace"))
                except OSError:
                    names = []
                break
        for name in (*names, ep.name):
            found.setdefault(name, (ep.dist.name, None))
    return found


def first_party_plugins() -> dict[str, tuple[str, Path | None]]:
    """Registered name -> (distribution, local folder or None) of the plugin distributions gemzoo knows
    without loading them.

    From the source tree's ``plugins/*/pyproject.toml`` (each distribution's name and ``gemzoo`` entry points,
    and the names its entry-point modules pass to ``register``), then from the installed ``gemzoo`` entry
    points. Install hints use it: never a name guessed from user input, since such a name could be
    registered by anyone on a package index."""
    root = source_tree_plugins_dir()
    found = _tree_plugins(root) if root else {}
    for name, hit in _installed_plugins().items():
        found.setdefault(name, hit)
    return found


def install_hint(name: str) -> str | None:
    """How to get the plugin distribution that registers ``name`` (one of :func:`first_party_plugins`), or
    None for any other name."""
    hit = first_party_plugins().get(name)
    if hit is None:
        return None
    dist, folder = hit
    if folder is not None:
        return (f"{name!r} comes with the first-party plugin {dist}: install it with "
                f"pip install --no-deps --no-build-isolation -e {folder}")
    return (f"{name!r} belongs to the installed plugin distribution {dist}, which did not register it this time; "
            "`gemzoo plugins` shows what each plugin registered and why one failed")


def _hook_names(pm: pluggy.PluginManager, plugin) -> list[str]:
    return sorted(h.name for h in (pm.get_hookcallers(plugin) or []))
