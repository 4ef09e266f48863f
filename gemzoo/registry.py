"""One typed registry per kind, filled from plugin hooks on first use (timm-style listing).

    >>> import gemzoo
    >>> gemzoo.registry.names("attention")          # sorted names
    >>> gemzoo.registry.names("attention", "j*")    # fnmatch filter
    >>> kernel = gemzoo.registry.get("attention", "reference")

The kinds, and the hook that fills each, are ``gemzoo.kinds``'s table. Plugin names are unique across
kinds, so ``find("jfa")`` tells which kind ``jfa`` belongs to. The one
exception is a name one distribution gives to several kinds (gemzoo's own ``none`` for memory and
batching); ``find`` then needs ``kind:name``.
"""

from __future__ import annotations

import fnmatch
import threading
from dataclasses import dataclass
from typing import Any

from gemzoo import kinds as kinds_table
from gemzoo.errors import PluginError
from gemzoo.plugins import PluginHost, first_party_plugins, install_hint


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
        self._clashes: list[str] = []  # names registered twice: every lookup raises the first
        self._lock = threading.RLock()

    # -- loading -----------------------------------------------------------------------------
    @property
    def host(self) -> PluginHost:
        with self._lock:
            if self._host is None:
                self._host = PluginHost()
            return self._host

    def _load(self, strict: bool = True) -> dict[str, dict[str, Entry]]:
        entries = self._entries
        if entries is not None and not (strict and self._clashes):
            return entries  # loaded: no lock (a lookup inside a torch.compile graph cannot enter one)
        with self._lock:
            if self._entries is None:
                self._clashes = []
                self._entries = self._collect()
            if strict and self._clashes:
                raise PluginError(self._clashes[0])
            return self._entries

    def clashes(self) -> list[str]:
        """Loads every plugin without raising on names registered twice; returns those errors (for
        ``gemzoo plugins``, which must work while a clash is being diagnosed)."""
        self._load(strict=False)
        return list(self._clashes)

    def _collect(self) -> dict[str, dict[str, Entry]]:
        host = self.host
        hooks = kinds_table.hooks()
        entries: dict[str, dict[str, Entry]] = {k: {} for k in hooks}
        by_name: dict[str, Entry] = {}  # first entry of each name, for clash detection
        for kind, hook_name in hooks.items():
            hook = getattr(host.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                info = host.infos.get(impl.plugin_name)
                dist = info.distribution if info else "<local>"
                version = info.version if info else "0"

                def register(name: str, obj: Any, *, _kind=kind, _impl=impl, _dist=dist, _ver=version,
                             _info=info) -> None:
                    if not isinstance(name, str) or not name:
                        raise PluginError(f"plugin {_impl.plugin_name!r} registered a {_kind} with an empty name")
                    problem = kinds_table.conformance_problem(_kind, obj)
                    if problem is not None:
                        raise PluginError(f"registered {_kind} {name!r}, but {problem}")
                    old = entries[_kind].get(name) or by_name.get(name)
                    if old is not None and (old.kind == _kind or old.distribution != _dist):
                        msg = (
                            f"{_kind} name {name!r} is registered twice: by distribution {old.distribution!r} "
                            f"(plugin {old.plugin!r}, as a {old.kind}) and by {_dist!r} (plugin {_impl.plugin_name!r}). "
                            f"Uninstall one of them or block it with GEMZOO_DISABLE_PLUGINS={_impl.plugin_name}."
                        )
                        self._clashes.append(msg)
                        if _info is not None:
                            _info.error = msg
                        return
                    entry = Entry(_kind, name, obj, _impl.plugin_name, _dist, _ver)
                    entries[_kind][name] = entry
                    by_name.setdefault(name, entry)

                try:
                    impl.function(register=register)
                except (Exception, SystemExit, KeyboardInterrupt) as exc:  # one plugin's failure, not the run's
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
            self._clashes = []

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
        if kind not in kinds_table.names():
            raise PluginError(f"unknown registry kind {kind!r}; the kinds are: {', '.join(kinds_table.names())}")

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
        if kind:
            self._check_kind(kind)
        loaded = self._load()
        wanted = [kind] if kind else kinds_table.names()
        return [e for k in wanted for _, e in sorted(loaded[k].items())]

    def _unknown_message(self, kind: str, name: str) -> str:
        import difflib

        existing = self.names(kind)
        msg = f"unknown {kind} {name!r}. Registered {kind} names: {', '.join(existing) or '(none)'}."
        others = [k for k, es in self._load().items() if name in es and k != kind]
        if others:
            return msg + f" ({name!r} exists, but as a {others[0]}.)"
        blocked = self.host.blocked_by(name)
        if blocked is not None:
            return msg + f" {name!r} is disabled by {blocked}; lift that to use it."
        failed = self.host.failed()
        dist = first_party_plugins().get(name, (None, None))[0]
        for pname, info in failed.items():
            if name in (pname, info.distribution) or info.distribution == dist:
                return msg + f" Plugin {pname!r} from {info.distribution!r} failed to load: {info.error}"
        hint = install_hint(name)
        if hint is not None:
            msg += f" {hint}."
        else:  # a typo, or a third-party plugin: suggest close names, never an install name built from it
            known = sorted({e.name for e in self.entries()} | set(first_party_plugins()))
            close = difflib.get_close_matches(name, existing, n=1) or difflib.get_close_matches(name, known, n=1)
            if close:
                msg += f" Did you mean {close[0]!r}?"
        if failed:
            msg += " Plugins that failed to load: " + "; ".join(
                f"{p} ({i.distribution}): {i.error}" for p, i in failed.items()
            )
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
clashes = _default.clashes


def host() -> PluginHost:
    return _default.host
