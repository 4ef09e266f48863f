"""What several commands share: honouring ``no:NAME`` blocks, and loading a run config from the command line."""

from __future__ import annotations

from gemzoo import registry
from gemzoo.config import Config, blocked_plugins, load_config
from gemzoo.plugins import PluginHost, blocked_names


def prepare_registry(plugins: str | None) -> None:
    """Apply ``no:NAME`` blocks before any plugin is imported."""
    blocked = blocked_plugins(plugins)
    if blocked:
        registry.reset(PluginHost(blocked=blocked | blocked_names()))


def load_run_config(args) -> Config:
    """The config of ``--config``/``config`` with ``--set``, ``--steps`` and ``--plugins`` applied."""
    prepare_registry(getattr(args, "plugins", None))
    overrides = list(args.set or [])
    if getattr(args, "steps", None) is not None:
        overrides.append(f"run.steps={args.steps}")
    return load_config(args.config, overrides=overrides, plugins=args.plugins)
