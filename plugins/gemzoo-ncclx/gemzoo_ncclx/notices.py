"""ncclx's one-per-process warnings (the transports fall back with a message, once per group and cause)."""

from __future__ import annotations

import warnings

_SAID: set[str] = set()


def say_once(key: str, message: str) -> None:
    """One RuntimeWarning per process for ``key``."""
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
