"""Hang guards for the test suite: every fixed wall-clock limit a test puts on a subprocess, a spawned rank or
the whole test goes through :func:`hang_guard`, so a correct run on a slow or loaded machine never fails on it.

A guard is set several times (at least five) above what the work takes on a loaded 2-core CPU; it exists to
end a hang with a clear failure, not to measure speed. ``GEMZOO_TEST_TIMEOUT_SCALE`` multiplies every guard
(e.g. ``4`` on an overloaded or emulated machine, ``0.25`` to find hangs faster)::

    subprocess.run(cmd, timeout=hang_guard(300))
"""

from __future__ import annotations

import os

SCALE_VAR = "GEMZOO_TEST_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """The factor of ``GEMZOO_TEST_TIMEOUT_SCALE`` (1 when unset); a clear error when it is not a positive number."""
    raw = os.environ.get(SCALE_VAR, "").strip()
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_VAR}={raw!r} is not a number; set it to a positive factor such as 2") from None
    if not scale > 0:
        raise ValueError(f"{SCALE_VAR}={raw!r} must be positive; set it to a factor such as 2, or unset it")
    return scale


def hang_guard(seconds: float) -> float:
    """``seconds`` (a limit at least five times the expected time on a loaded 2-core CPU) times the scale."""
    return seconds * timeout_scale()
