"""Registers the precision policies ``mxfp8``, ``fp8-rowwise`` and ``fp8-tensorwise``.

Options (``[plugins.options.mxfp8]``, validated by ``MXFP8Options``)::

    rht = false              # random Hadamard transform on the wgrad operands (along tokens)
    rht_block = 32           # 16 or 32
    rht_seed = 0             # one fixed sign vector per run
    grad_elem = "e4m3"       # element type of dY: "e4m3" or "e5m2"
    backend = "auto"         # CUDA GEMMs: "auto", "triton" (fused MX dequant + bf16 MMA) or "cublas"
    attention = false        # MX QK^T and PV at the attention sites matched by attention_layers
    attention_layers = ["*"] # fnmatch patterns on JaggedAttention site names
    default_keep = true      # also keep DEFAULT_KEEP (embeddings, heads, first and last blocks) in bf16
    weight_dtype = "keep"    # "bf16": store the swapped linears' master weights in bf16

Options of fp8-tensorwise (``[plugins.options.fp8-tensorwise]``, ``FP8TensorwiseOptions``)::

    default_keep = true      # also keep DEFAULT_KEEP in bf16, as mxfp8 does
    pow2_scales = false      # round each per-tensor scale down to a power of two
    fast_accum = true        # the forward GEMM with cuBLAS fast accumulation (the gradient GEMMs never)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from gemzoo.api import (
    BF16Linear,
    ConfigError,
    PrecisionCapabilities,
    PrecisionConfig,
    TakesOptions,
    attention_sites,
    hookimpl,
    swap_linears,
)
from gemzoo_mxfp8.linear import BACKENDS, MXLinear, MXLinearConfig
from gemzoo_mxfp8.rht import RHT_BLOCKS
from gemzoo_mxfp8.rowwise import FP8RowwiseLinear
from gemzoo_mxfp8.tensorwise import CAST_BACKENDS, FP8TensorwiseLinear

GEMZOO_API = ">=1,<2"

# Modules kept in bf16 by default. "{first_block}" / "{last_block}" expand to the names of the first and
# last modules that set ``is_transformer_block = True``.
DEFAULT_KEEP = ("*embed*", "head", "head.*", "*.head", "*.head.*", "{first_block}.*", "{last_block}.*")

ELEM_NAMES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
WEIGHT_DTYPES = {"keep": None, "bf16": torch.bfloat16}


def expand_keep(model: nn.Module, patterns) -> list[str]:
    """DEFAULT_KEEP-style patterns with {first_block}/{last_block} filled from the model (dropped if none)."""
    blocks = [name for name, m in model.named_modules() if getattr(m, "is_transformer_block", False) and name]
    out = []
    for p in patterns:
        if "{first_block}" in p or "{last_block}" in p:
            if blocks:
                out.append(p.format(first_block=blocks[0], last_block=blocks[-1]))
        else:
            out.append(p)
    return out


def keep_patterns(model: nn.Module, cfg: PrecisionConfig, default_keep: bool = True) -> list[str]:
    """The selective-precision rule of the fp8 policies: ``precision.keep``, plus DEFAULT_KEEP (embeddings and
    their projections, the heads, the first and last transformer blocks) when ``default_keep``. Norms and the
    sparse tables are no nn.Linear, so no policy swaps them."""
    keep = list(cfg.keep)
    if default_keep:
        keep += expand_keep(model, DEFAULT_KEEP)
    return keep


@dataclass
class MXFP8Options:
    rht: bool = False
    rht_block: int = 32
    rht_seed: int = 0
    grad_elem: str = "e4m3"
    backend: str = "auto"
    attention: bool = False
    attention_layers: list[str] = field(default_factory=lambda: ["*"])
    default_keep: bool = True
    weight_dtype: str = "keep"

    def __post_init__(self):
        if self.rht_block not in RHT_BLOCKS:
            raise ConfigError(f"plugins.options.mxfp8.rht_block must be 16 or 32, got {self.rht_block}")
        if self.grad_elem not in ELEM_NAMES:
            raise ConfigError(f"plugins.options.mxfp8.grad_elem must be one of {sorted(ELEM_NAMES)}, got {self.grad_elem!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"plugins.options.mxfp8.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"plugins.options.mxfp8.weight_dtype must be 'keep' or 'bf16', got {self.weight_dtype!r}")
        if isinstance(self.attention_layers, str) or not all(isinstance(p, str) for p in self.attention_layers):
            raise ConfigError("plugins.options.mxfp8.attention_layers must be a list of fnmatch patterns, "
                              f"e.g. [\"tower.blocks.*\"], got {self.attention_layers!r}")


class MXFP8Policy(TakesOptions):
    """Every nn.Linear not kept runs as an MXLinear; kept ones (precision.keep + DEFAULT_KEEP) in bf16."""

    options_cls = MXFP8Options
    # e4m3 keeps 3 mantissa bits: about 2-4% relative error per GEMM on Gaussian data; 6% is the promise.
    capabilities = PrecisionCapabilities(linear_rtol=0.06, compute_dtype=torch.bfloat16)

    def __init__(self, options: MXFP8Options | None = None):
        super().__init__(options)
        o = self.options
        self.linear_cfg = MXLinearConfig(grad_elem=ELEM_NAMES[o.grad_elem], rht=o.rht, rht_block=o.rht_block,
                                         rht_seed=o.rht_seed, backend=o.backend,
                                         out_dtype=torch.bfloat16)

    def keep_patterns(self, model: nn.Module, cfg: PrecisionConfig) -> list[str]:
        return keep_patterns(model, cfg, self.options.default_keep)

    def make_linear(self, linear: nn.Linear) -> nn.Module:
        wd = WEIGHT_DTYPES[self.options.weight_dtype]
        if wd is not None:
            linear.weight.data = linear.weight.data.to(wd)
            if linear.bias is not None:
                linear.bias.data = linear.bias.data.to(wd)
        return MXLinear.from_linear(linear, self.linear_cfg)

    def apply(self, model: nn.Module, cfg: PrecisionConfig) -> nn.Module:
        # kept linears (precision.keep + DEFAULT_KEEP) run in bf16, the others as MXLinear
        self.last_plan = swap_linears(model, self.make_linear, self.keep_patterns(model, cfg),
                                      kept=BF16Linear.from_linear)
        if self.options.attention:
            self.apply_attention(model)
        return model

    def apply_attention(self, model: nn.Module) -> dict[str, str]:
        """Wrap the kernel of each JaggedAttention site matched by ``attention_layers`` with MXAttention."""
        from gemzoo_mxfp8.attention import MXAttention

        done = {}
        for name, site in attention_sites(model).items():
            if any(fnmatch.fnmatchcase(name, p) for p in self.options.attention_layers):
                if isinstance(site.kernel, MXAttention):
                    continue
                inner_name = site.kernel_name
                site.set_kernel(f"mxfp8({inner_name})", MXAttention(site.kernel, inner_name))
                site.precision = "mxfp8"
                done[name] = site.kernel_name
        return done


class FP8RowwisePolicy:
    """Every nn.Linear not kept runs as an FP8RowwiseLinear (torch._scaled_mm, one scale per row)."""

    options_cls = None
    capabilities = PrecisionCapabilities(linear_rtol=0.06, compute_dtype=torch.bfloat16)

    def make_linear(self, linear: nn.Linear) -> nn.Module:
        return FP8RowwiseLinear.from_linear(linear, out_dtype=torch.bfloat16)

    def apply(self, model: nn.Module, cfg: PrecisionConfig) -> nn.Module:
        self.last_plan = swap_linears(model, self.make_linear, cfg.keep, kept=BF16Linear.from_linear)
        return model


@dataclass
class FP8TensorwiseOptions:
    default_keep: bool = True  # also keep DEFAULT_KEEP (embeddings, heads, first and last blocks) in bf16
    pow2_scales: bool = False  # round each per-tensor scale down to a power of two
    fast_accum: bool = True  # the forward GEMM with cuBLAS fast accumulation (the gradient GEMMs never)
    casts: str = "triton"  # on CUDA: "triton" (one-pass cast kernel, both layouts) or "torch" (left to Inductor)

    def __post_init__(self):
        for key in ("default_keep", "pow2_scales", "fast_accum"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ConfigError(f"plugins.options.fp8-tensorwise.{key} must be true or false, got {value!r}")
        if self.casts not in CAST_BACKENDS:
            raise ConfigError(f"plugins.options.fp8-tensorwise.casts must be one of {list(CAST_BACKENDS)}, got "
                              f"{self.casts!r}")


class FP8TensorwisePolicy(TakesOptions):
    """Every nn.Linear not kept runs as an FP8TensorwiseLinear (one dynamic scale per tensor, torch._scaled_mm);
    kept ones (precision.keep + DEFAULT_KEEP, the mxfp8 rule) in bf16."""

    options_cls = FP8TensorwiseOptions
    # e4m3 X and W (3 mantissa bits) and e5m2 dY (2): on Gaussian data 2.6-3.7% relative error on the output and
    # 5.7-5.9% on dX and dW against fp32 (e5m2's rounding dominates), so the promise is 8%, not mxfp8's 6%.
    capabilities = PrecisionCapabilities(linear_rtol=0.08, compute_dtype=torch.bfloat16)

    def keep_patterns(self, model: nn.Module, cfg: PrecisionConfig) -> list[str]:
        return keep_patterns(model, cfg, self.options.default_keep)

    def make_linear(self, linear: nn.Linear) -> nn.Module:
        o = self.options
        return FP8TensorwiseLinear.from_linear(linear, out_dtype=torch.bfloat16, pow2=o.pow2_scales,
                                               fast_accum=o.fast_accum, casts=o.casts)

    def apply(self, model: nn.Module, cfg: PrecisionConfig) -> nn.Module:
        self.last_plan = swap_linears(model, self.make_linear, self.keep_patterns(model, cfg),
                                      kept=BF16Linear.from_linear)
        return model


@hookimpl
def gemzoo_register_precision(register):
    register("mxfp8", MXFP8Policy())
    register("fp8-rowwise", FP8RowwisePolicy())
    register("fp8-tensorwise", FP8TensorwisePolicy())
