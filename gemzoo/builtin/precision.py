"""Built-in precision policies: ``fp32`` and ``bf16`` (bf16 compute, fp32 master weights).

``BF16Linear`` lives in the public gemzoo.interfaces.precision (re-exported here)."""

from __future__ import annotations

import torch
from torch import nn

from gemzoo.interfaces.precision import BF16Linear, PrecisionCapabilities, PrecisionConfig, swap_linears
from gemzoo.plugins import hookimpl


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
        swap_linears(model, self.make_linear, cfg.keep)
        return model

    def make_linear(self, linear: nn.Linear) -> nn.Module:
        return BF16Linear.from_linear(linear)


@hookimpl
def gemzoo_register_precision(register):
    register("fp32", FP32Policy())
    register("bf16", BF16Policy())
