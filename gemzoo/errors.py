"""Errors raised on bad user input. Each message names the problem and the fix."""

from __future__ import annotations


class GemzooError(Exception):
    """Base class for every error gemzoo raises on purpose."""


class ConfigError(GemzooError, ValueError):
    """A config file, key or override is invalid."""


class DataNotFound(ConfigError):
    """A dataset's file is not there (``config show`` and ``validate`` go on without it, ``train`` cannot)."""


class PluginError(GemzooError, LookupError):
    """A plugin is unknown, failed to load, clashes with another, or lacks a capability."""


class JaggedShapeError(GemzooError, ValueError):
    """Jagged offsets or values break the layout rules (see gemzoo.jagged)."""


class CheckpointError(GemzooError, OSError):
    """A checkpoint is missing, truncated, corrupt or does not match the run."""


class TrainingError(GemzooError, RuntimeError):
    """Training cannot go on (for example the loss became NaN)."""
