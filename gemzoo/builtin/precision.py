"""Built-in precision policies: ``fp32`` and ``bf16`` (bf16 compute, fp32 master weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemzoo.interfaces.precision import PrecisionCapabilities, PrecisionConfig, adopt_linear, swap_linears
from gemzoo.plugins import hookimpl


class BF16Linear(nn.Linear):
    """nn.Linear whose matmul runs in bf16 with fp32 master weights; returns bf16."""

    precision = "bf16"

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "BF16Linear":
        return adopt_linear(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), bias)


class FP32Policy:
    capabilities = PrecisionCapabilities(linear_rtol=1e-6, compute_dtype=torch.float32)

    def apply(self, model: nn.Module, cfg: PrecisionConfig) -> nn.Module:
        return model

    def make_linear(self, linear: nn.Linear) -> nn.Module:
        return linear


class BF16Policy:
    """Every nn.Linear not matched by ``precision.keep`` computes in bf16."""

    capabilities = PrecisionCapabilities(linear_rtol=1e-2, compute_dtype=torch.bfloat16)

    def apply(self, model: nn.Module, cfg: PrecisionConfig) -> nn.Module:
        swap_linears(model, cfg, self.make_linear)
        return model

    def make_linear(self, linear: nn.Linear) -> nn.Module:
        return BF16Linear.from_linear(linear)


@hookimpl
def gemzoo_register_precision(register):
    register("fp32", FP32Policy())
    register("bf16", BF16Policy())
