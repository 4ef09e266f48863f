"""The options pair every kind shares: ``options_cls`` and ``configure``.

A registered entry that takes options from ``[plugins.options.NAME]`` declares ``options_cls``, a dataclass
whose fields are the keys allowed there (config validates the table with it, so a typo is an error), and
``configure(options) -> entry``, which returns a configured copy: the registered object itself is never
changed, so two runs in one process do not see each other's options. An entry without options has no
``options_cls`` (or ``options_cls = None``) and needs no ``configure``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Protocol, runtime_checkable

from gemzoo.errors import ConfigError, PluginError


def bounded(default, *, min: float | None = None, max: float | None = None, below: float | None = None,
            choices: tuple | None = None, pattern: str | None = None, length: int | tuple[int, int] | None = None,
            means: str = ""):
    """A dataclass field whose value a config may set only within a range: ``min`` and ``max`` (inclusive),
    ``below`` (exclusive upper bound), one of ``choices``, or a full match of the regular expression ``pattern``
    (``means`` says it in words). For a list field the bounds hold for each element, and ``length`` is its
    exact length or an inclusive ``(shortest, longest)`` range (``longest`` 0: no limit); a list default is
    copied for each instance. Config, model, dataset and plugin option dataclasses all use it; load_config
    checks it (with the element types the field's annotation names, and no NaN or infinity anywhere).

    Rules between fields (``median_len <= max_len``) are the dataclass's ``__post_init__`` raising ConfigError:
    config building runs it, so ``config validate`` and ``train`` refuse the same values."""
    meta = {"min": min, "max": max, "below": below, "choices": choices, "pattern": pattern, "length": length,
            "means": means}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@runtime_checkable
class Configurable(Protocol):
    options_cls: type | None  # a dataclass; fields = the keys of [plugins.options.NAME]

    def configure(self, options: Any) -> Any:
        """A copy of this entry configured with ``options`` (an ``options_cls`` instance)."""


class TakesOptions:
    """The pair written once: ``self.options`` (``options_cls()`` when none are given, a ConfigError naming the
    expected class for anything else) and ``configure(options)``, which returns a new instance. An entry
    that sets more up in ``__init__`` calls ``super().__init__(options)`` first."""

    options_cls: type

    def __init__(self, options: Any = None):
        if options is None:
            options = self.options_cls()
        elif not isinstance(options, self.options_cls):
            raise ConfigError(f"{type(self).__name__} options must be {self.options_cls.__name__}, got "
                              f"{type(options).__name__}")
        self.options = options

    def configure(self, options: Any) -> Any:
        return type(self)(options)


def options_cls(entry: Any) -> type | None:
    """The entry's options dataclass, or None when it takes no options."""
    return getattr(entry, "options_cls", None)


def check_configurable(entry: Any, name: str) -> None:
    """Raise PluginError when ``entry`` declares ``options_cls`` but not the rest of the pair."""
    cls = options_cls(entry)
    if cls is None:
        return
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise PluginError(f"plugin {name!r}: options_cls must be a dataclass (its fields are the keys of "
                          f"[plugins.options.{name}]), got {cls!r}")
    if not callable(getattr(entry, "configure", None)):
        raise PluginError(f"plugin {name!r} declares options_cls = {cls.__name__} but no configure(options) "
                          "method returning the configured entry; add one")
