"""One typed registry per kind, filled from plugin hooks on first use (timm-style listing).

    >>> import gemzoo
    >>> gemzoo.registry.names("attention")          # sorted names
    >>> gemzoo.registry.names("attention", "j*")    # fnmatch filter
    >>> kernel = gemzoo.registry.get("attention", "reference")

Plugin names are unique across kinds, so ``find("jfa")`` tells which kind ``jfa`` belongs to. The one
exception is a name one distribution gives to several kinds (gemzoo's own ``none`` for memory and
batching); ``find`` then needs ``kind:name``.
"""

from __future__ import annotations

import fnmatch
import threading
from dataclasses import dataclass
from typing import Any

from gemzoo.errors import PluginError
from gemzoo.plugins import PluginHost

KINDS: dict[str, str] = {
    "attention": "gemzoo_register_attention",
    "precision": "gemzoo_register_precision",
    "planner": "gemzoo_register_planners",
    "comms": "gemzoo_register_comms",
    "memory": "gemzoo_register_memory",
    "batching": "gemzoo_register_batching",
    "model": "gemzoo_register_models",
    "dataset": "gemzoo_register_datasets",
}


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str
    version: str


class Registry:
    def __init__(self, host: PluginHost | None = None):
        self._host = host
        self._entries: dict[str, dict[str, Entry]] | None = None
        self._lock = threading.RLock()

    # -- loading -----------------------------------------------------------------------------
    @property
    def host(self) -> PluginHost:
        with self._lock:
            if self._host is None:
                self._host = PluginHost()
            return self._host

    def _load(self) -> dict[str, dict[str, Entry]]:
        with self._lock:
            if self._entries is None:
                self._entries = self._collect()
            return self._entries

    def _collect(self) -> dict[str, dict[str, Entry]]:
        host = self.host
        entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
        by_name: dict[str, Entry] = {}  # first entry of each name, for clash detection
        for kind, hook_name in KINDS.items():
            hook = getattr(host.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                info = host.infos.get(impl.plugin_name)
                dist = info.distribution if info else "<local>"
                version = info.version if info else "0"

                def register(name: str, obj: Any, *, _kind=kind, _impl=impl, _dist=dist, _ver=version) -> None:
                    if not isinstance(name, str) or not name:
                        raise PluginError(f"plugin {_impl.plugin_name!r} registered a {_kind} with an empty name")
                    old = entries[_kind].get(name) or by_name.get(name)
                    if old is not None and (old.kind == _kind or old.distribution != _dist):
                        raise PluginError(
                            f"{_kind} name {name!r} is registered twice: by distribution {old.distribution!r} "
                            f"(plugin {old.plugin!r}, as a {old.kind}) and by {_dist!r} (plugin {_impl.plugin_name!r}). "
                            f"Uninstall one of them or block it with GEMZOO_DISABLE_PLUGINS={_impl.plugin_name}."
                        )
                    entry = Entry(_kind, name, obj, _impl.plugin_name, _dist, _ver)
                    entries[_kind][name] = entry
                    by_name.setdefault(name, entry)

                try:
                    impl.function(register=register)
                except PluginError:
                    raise
                except Exception as exc:
                    if info is not None:
                        info.error = f"{hook_name} raised {type(exc).__name__}: {exc}"
        for entry in (e for kind_entries in entries.values() for e in kind_entries.values()):
            info = host.infos.get(entry.plugin)
            if info is not None:
                info.registered.setdefault(entry.kind, []).append(entry.name)
        return entries

    def reset(self, host: PluginHost | None = None) -> None:
        """Forget everything; the next call reloads plugins (used by tests)."""
        with self._lock:
            self._host = host
            self._entries = None

    def register(self, kind: str, name: str, obj: Any, *, distribution: str = "<local>") -> None:
        """Add one entry directly, without a plugin object (tests and notebooks)."""
        self._check_kind(kind)
        entries = self._load()
        old = entries[kind].get(name) or next((e for es in entries.values() for e in es.values() if e.name == name), None)
        if old is not None:
            raise PluginError(
                f"{kind} name {name!r} is registered twice: by {old.distribution!r} and by {distribution!r}"
            )
        entries[kind][name] = Entry(kind, name, obj, "<local>", distribution, "0")

    def unregister(self, kind: str, name: str) -> None:
        self._load()[kind].pop(name, None)

    # -- lookup ------------------------------------------------------------------------------
    def _check_kind(self, kind: str) -> None:
        if kind not in KINDS:
            raise PluginError(f"unknown registry kind {kind!r}; the kinds are: {', '.join(KINDS)}")

    def names(self, kind: str, pattern: str | None = None) -> list[str]:
        self._check_kind(kind)
        names = sorted(self._load()[kind])
        return fnmatch.filter(names, pattern) if pattern else names

    def entry(self, kind: str, name: str) -> Entry:
        self._check_kind(kind)
        entries = self._load()[kind]
        if name in entries:
            return entries[name]
        raise PluginError(self._unknown_message(kind, name))

    def get(self, kind: str, name: str) -> Any:
        return self.entry(kind, name).obj

    def find(self, name: str) -> Entry | None:
        """The entry called ``name`` (or ``kind:name``) in any kind, or None; PluginError if ambiguous."""
        if ":" in name:
            kind, _, short = name.partition(":")
            self._check_kind(kind)
            return self._load()[kind].get(short)
        hits = [entries[name] for entries in self._load().values() if name in entries]
        if len(hits) > 1:
            raise PluginError(
                f"{name!r} names a {' and a '.join(e.kind for e in hits)}; say which with "
                + " or ".join(f"{e.kind}:{name}" for e in hits)
            )
        return hits[0] if hits else None

    def entries(self, kind: str | None = None) -> list[Entry]:
        loaded = self._load()
        kinds = [kind] if kind else list(KINDS)
        return [e for k in kinds for _, e in sorted(loaded[k].items())]

    def _unknown_message(self, kind: str, name: str) -> str:
        import difflib

        existing = self.names(kind)
        msg = f"unknown {kind} {name!r}. Registered {kind} names: {', '.join(existing) or '(none)'}."
        close = difflib.get_close_matches(name, existing, n=1)
        if close:
            msg += f" Did you mean {close[0]!r}?"
        others = [k for k, es in self._load().items() if name in es and k != kind]
        if others:
            msg += f" ({name!r} exists, but as a {others[0]}.)"
        failed = self.host.failed()
        for pname, info in failed.items():
            if name in (pname, info.distribution, f"gemzoo-{name}"):
                msg += f" Plugin {pname!r} from {info.distribution!r} failed to load: {info.error}"
                break
        else:
            if failed:
                msg += " Plugins that failed to load: " + "; ".join(
                    f"{p} ({i.distribution}): {i.error}" for p, i in failed.items()
                )
        if not failed and not others:
            msg += f" If it comes from a plugin, install it: pip install gemzoo-{name}."
        return msg


_default = Registry()

get = _default.get
names = _default.names
entry = _default.entry
entries = _default.entries
find = _default.find
register = _default.register
unregister = _default.unregister
reset = _default.reset


def host() -> PluginHost:
    return _default.host
