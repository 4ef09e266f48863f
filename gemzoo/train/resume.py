"""What ``--resume`` may change: the checkpoint's config (its manifest) against the current one.

Keys that fix what the checkpoint holds cannot change: the model (parameter shapes), the data (the
stream and the table sizes), the plugins and their options, the precision setup, and ``run.seed``.
Resuming with any of them changed is a ConfigError naming each key with both values. Everything else
(``run.steps``, cadences, ``optim.*``, ``eval.*``, ``checkpoint.*``, the device, and the plugin options that
only choose a layout: those an ``options_cls`` lists in ``layout_fields``, since a checkpoint holds whole
tensors) may change; the trainer applies it (optimizer hyper-parameters are set on the param groups after their state is loaded) and
says in one line what changed.
"""

from __future__ import annotations

from typing import Any

from gemzoo import registry
from gemzoo.errors import ConfigError

FIXED = ("model.", "data.", "plugins.", "precision.", "run.seed")
_UNSET = "<unset>"


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay whole."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def is_fixed(key: str) -> bool:
    return any(key == p or key.startswith(p) for p in FIXED)


def layout_keys() -> set[str]:
    """``plugins.options.NAME.FIELD`` for each field a registered plugin's ``options_cls.layout_fields`` names
    (e.g. sharding-2d's group_size): options that place the same whole tensors differently."""
    return {f"plugins.options.{e.name}.{f}" for e in registry.entries()
            for f in getattr(getattr(e.obj, "options_cls", None), "layout_fields", ())}


def config_changes(saved: dict, current: dict) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(changeable, fixed): (key, checkpoint's value, current value) for every key that differs."""
    a, b = flatten(saved), flatten(current)
    layout = layout_keys() if any(k.startswith("plugins.options.") for k in set(a) | set(b)) else set()
    changeable, fixed = [], []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, _UNSET), b.get(key, _UNSET)
        if old != new:
            (fixed if is_fixed(key) and key not in layout else changeable).append((key, old, new))
    return changeable, fixed


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes)


def check_resumable(saved: dict, current: dict, where: str) -> list[tuple[str, Any, Any]]:
    """Raise ConfigError if a fixed key changed; return the changes the trainer applies."""
    changeable, fixed = config_changes(saved, current)
    if fixed:
        restore = " ".join(f"--set {key}={_toml(old)}" for key, old, _ in fixed[:3] if old is not _UNSET)
        raise ConfigError(
            f"cannot resume from {where}: these keys fix the model, data or plugins of the run and differ from "
            f"the checkpoint's: {'; '.join(f'{k} is {o!r} in the checkpoint, {n!r} now' for k, o, n in fixed)}. Resume with the checkpoint's values"
            f"{f' ({restore})' if restore else ''}, or start a new run (--out DIR, or --overwrite to replace "
            "this one)."
        )
    return changeable


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_toml(v) for v in value) + "]"
    return repr(value)
