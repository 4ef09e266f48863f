"""Every gemzoo hook. Plugins implement them with ``@gemzoo.hookimpl``.

Registration hooks receive a ``register(name, obj)`` callback (simonw/llm style). Lifecycle hooks are
called with keywords, so new arguments can be added later without breaking existing plugins.
``gemzoo.kinds`` is the table of registration hooks: each hook's kind, Protocol, one-or-a-list, default and
conformance suite (``gemzoo.testing.<kind>``).
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("gemzoo")


@hookspec
def gemzoo_register_attention(register):
    """Register attention kernels: ``register(name, kernel)``; see gemzoo.interfaces.attention."""


@hookspec
def gemzoo_register_precision(register):
    """Register precision policies: ``register(name, policy)``; see gemzoo.interfaces.precision."""


@hookspec
def gemzoo_register_planners(register):
    """Register embedding sharding planners: ``register(name, planner)``."""


@hookspec
def gemzoo_register_comms(register):
    """Register communication backends: ``register(name, backend)``."""


@hookspec
def gemzoo_register_memory(register):
    """Register memory policies (activation checkpointing, saved-activation compression)."""


@hookspec
def gemzoo_register_batching(register):
    """Register batching policies that rebalance samples across data-parallel ranks."""


@hookspec
def gemzoo_register_models(register):
    """Register model families: ``register(name, ModelSpec(...))``."""


@hookspec
def gemzoo_register_datasets(register):
    """Register datasets: ``register(name, DatasetSpec(...))``."""


@hookspec
def gemzoo_configure(config):
    """Called once with the validated run config, before anything is built."""


@hookspec
def gemzoo_model_built(model, config):
    """Called after the model is built and its attention kernels are chosen."""


@hookspec
def gemzoo_step_end(trainer, step, metrics):
    """Called for every training step, in order, with that step's metrics dict: right after it with
    ``run.sync = "step"``; with ``"log"`` once its numbers are read, at the next step that writes a row,
    evaluates, checkpoints or stops (the steps queued before it are called first)."""


@hookspec
def gemzoo_register_commands(cli):
    """Add sub-commands to the ``gemzoo`` CLI: ``cli`` is the argparse sub-parsers object."""
