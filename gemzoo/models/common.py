"""Pieces shared by model families: the attention call site and the block marker."""

from __future__ import annotations

import torch
from torch import nn

from gemzoo.interfaces.attention import AttentionRequest


class JaggedAttention(nn.Module):
    """The one place a model calls attention. The trainer picks the kernel for each site by name.

    ``request`` says what the site needs (activation, causal, asymmetric...); the trainer checks it
    against the chosen kernel's capabilities and fails at assembly time if the kernel lacks something.
    """

    def __init__(self, request: AttentionRequest, **options):
        super().__init__()
        self.request = request
        self.options = options  # fixed keyword options: window, block_size, norm, scale...
        self.kernel_name = "reference"
        self._kernel = None

    @property
    def kernel(self):
        if self._kernel is None:
            from gemzoo import registry

            self._kernel = registry.get("attention", self.kernel_name)
        return self._kernel

    def set_kernel(self, name: str, kernel) -> None:
        self.kernel_name, self._kernel = name, kernel

    def forward(self, q, k, v, q_offsets, k_offsets=None, **overrides) -> torch.Tensor:
        kw = {"causal": self.request.causal, "activation": self.request.activation, **self.options, **overrides}
        return self.kernel(q, k, v, q_offsets, k_offsets, **kw)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel_name}, request={self.request}"


def attention_sites(model: nn.Module) -> dict[str, JaggedAttention]:
    return {name: m for name, m in model.named_modules() if isinstance(m, JaggedAttention)}
