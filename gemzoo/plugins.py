"""The plugin manager: built-ins, installed entry points (group ``gemzoo``), blocking and load errors.

Block a plugin with ``--plugins no:NAME`` or ``GEMZOO_DISABLE_PLUGINS=name1,name2`` (distribution or
plugin names). ``GEMZOO_DISABLE_PLUGIN_AUTOLOAD=1`` loads built-ins only.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass, field
from pathlib import Path

import pluggy

from gemzoo import hookspecs

hookimpl = pluggy.HookimplMarker("gemzoo")

ENTRY_POINT_GROUP = "gemzoo"

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
        import importlib

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
                self.pm.register(plugin, name=ep.name)
            except Exception as exc:  # a broken plugin must not take the others down
                self.infos[ep.name] = PluginInfo(
                    ep.name, dist, version, error=f"{type(exc).__name__}: {exc}"
                )
                continue
            self.infos[ep.name] = PluginInfo(ep.name, dist, version, _hook_names(self.pm, plugin))

    def register(self, plugin, name: str, distribution: str = "<local>", version: str = "0") -> None:
        """Register a plugin object by hand (tests, notebooks, third parties without packaging)."""
        self.pm.register(plugin, name=name)
        self.infos[name] = PluginInfo(name, distribution, version, _hook_names(self.pm, plugin))

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
            except Exception as exc:
                errors[impl.plugin_name] = f"{hook_name} raised {type(exc).__name__}: {exc}"
                info = self.infos.get(impl.plugin_name)
                if info is not None:
                    info.error = errors[impl.plugin_name]
        return errors

    def failed(self) -> dict[str, PluginInfo]:
        return {n: i for n, i in self.infos.items() if i.error}


# Registered names of the first-party plugin distributions (DESIGN.md), for install hints when gemzoo is
# not run from its source tree; a source tree's plugins/*/ folders are read instead (see first_party_plugins).
FIRST_PARTY = {
    "jfa": "gemzoo-jfa", "gdpa": "gemzoo-gdpa", "block-attention": "gemzoo-block-attention",
    "mxfp8": "gemzoo-mxfp8", "fp8-rowwise": "gemzoo-mxfp8", "sharding-2d": "gemzoo-sharding-2d",
    "ncclx": "gemzoo-ncclx", "auto-ac": "gemzoo-auto-ac", "act-quant": "gemzoo-act-quant",
    "base-batch-shuffle": "gemzoo-base-batch-shuffle",
}


def source_tree_plugins_dir() -> Path | None:
    """``plugins/`` of the gemzoo source checkout this package runs from, if it does."""
    folder = Path(__file__).resolve().parent.parent / "plugins"
    return folder if (folder.parent / "pyproject.toml").is_file() and folder.is_dir() else None


def first_party_plugins() -> dict[str, tuple[str, Path | None]]:
    """Registered name -> (distribution, local folder or None) of gemzoo's own plugin distributions.

    Read from the source tree's ``plugins/gemzoo-*/`` (the names each plugin.py passes to ``register``),
    falling back to :data:`FIRST_PARTY` outside a checkout. Install hints use it: never a name guessed
    from user input, since such a name could be registered by anyone on a package index."""
    import re

    found: dict[str, tuple[str, Path | None]] = {}
    root = source_tree_plugins_dir()
    for folder in sorted(root.glob("gemzoo-*")) if root else ():
        for py in folder.glob("gemzoo_*/plugin.py"):
            for name in re.findall(r"""\bregister\(\s*["']([\w.-]+)["']""", py.read_text(errors="replace")):
                found.setdefault(name, (folder.name, folder))
    for name, dist in FIRST_PARTY.items():
        folder = root / dist if root and (root / dist).is_dir() else None
        found.setdefault(name, (dist, folder))
    return found


def install_hint(name: str) -> str | None:
    """How to install the first-party plugin that registers ``name``, or None for any other name."""
    hit = first_party_plugins().get(name)
    if hit is None:
        return None
    dist, folder = hit
    if folder is not None:
        return (f"{name!r} comes with the first-party plugin {dist}: install it with "
                f"pip install --no-deps --no-build-isolation -e {folder}")
    if source_tree_plugins_dir() is not None:
        return f"{name!r} belongs to the first-party plugin {dist}, which this source tree does not contain yet"
    return (f"{name!r} comes with the first-party plugin {dist}, which lives in gemzoo's source tree under "
            f"plugins/{dist}: install it from there with pip install -e plugins/{dist}")


def _hook_names(pm: pluggy.PluginManager, plugin) -> list[str]:
    return sorted(h.name for h in (pm.get_hookcallers(plugin) or []))
