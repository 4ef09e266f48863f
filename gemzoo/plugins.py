"""The plugin manager: built-ins, installed entry points (group ``gemzoo``), blocking and load errors.

Block a plugin with ``--plugins no:NAME`` or ``GEMZOO_DISABLE_PLUGINS=name1,name2`` (distribution or
plugin names). ``GEMZOO_DISABLE_PLUGIN_AUTOLOAD=1`` loads built-ins only.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass, field

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

    def failed(self) -> dict[str, PluginInfo]:
        return {n: i for n, i in self.infos.items() if i.error}

    def owner_of(self, plugin_obj) -> PluginInfo | None:
        name = self.pm.get_name(plugin_obj)
        return self.infos.get(name) if name else None


def _hook_names(pm: pluggy.PluginManager, plugin) -> list[str]:
    return sorted(h.name for h in (pm.get_hookcallers(plugin) or []))
