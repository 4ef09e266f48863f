"""Built-in memory policies: ``none`` and ``full-ac`` (recompute every transformer block in backward)."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gemzoo.interfaces.models import transformer_blocks
from gemzoo.plugins import hookimpl


class NoMemoryPolicy:
    def apply(self, model: nn.Module, cfg=None) -> nn.Module:
        return model

    def step_context(self):
        return contextlib.nullcontext()


class FullActivationCheckpointing(NoMemoryPolicy):
    """Wraps each block's forward in non-reentrant ``torch.utils.checkpoint`` (state-dict names unchanged)."""

    def apply(self, model: nn.Module, cfg=None) -> nn.Module:
        for block in transformer_blocks(model):
            if getattr(block, "_gemzoo_checkpointed", False):
                continue
            inner = block.forward

            @functools.wraps(inner)
            def forward(*args, _inner=inner, **kwargs):
                if not torch.is_grad_enabled():
                    return _inner(*args, **kwargs)
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

            block.forward = forward
            block._gemzoo_checkpointed = True
        return model


@hookimpl
def gemzoo_register_memory(register):
    register("none", NoMemoryPolicy())
    register("full-ac", FullActivationCheckpointing())
