"""Jagged attention: semantics (:mod:`.semantics`), input checks (:mod:`.checks`) and model sites (:mod:`.sites`).

The declarations (:class:`AttentionCapabilities`, :class:`AttentionRequest`, the :class:`AttentionKernel`
Protocol) are in :mod:`gemzoo.interfaces.attention`; this package is what runs them.
"""

from gemzoo.attention.checks import check_inputs, kernels_that_serve, validated_longest
from gemzoo.attention.semantics import (
    ACTIVATION_CODES,
    REFERENCE_CAPABILITIES,
    allowed_mask,
    apply_activation,
    apply_rope,
    materialize_relative_bias,
    pair_allowed,
    reference_attention,
    relative_bias_block,
    repeat_kv,
)
from gemzoo.attention.sites import (
    FunctionKernel,
    JaggedAttention,
    attention_sites,
    check_kernel_output,
    served_request,
    site_kernels_that_serve,
    site_missing,
)

__all__ = [
    "ACTIVATION_CODES", "REFERENCE_CAPABILITIES", "FunctionKernel", "JaggedAttention", "allowed_mask",
    "apply_activation", "apply_rope", "attention_sites", "check_inputs", "check_kernel_output",
    "kernels_that_serve", "materialize_relative_bias", "pair_allowed", "reference_attention",
    "relative_bias_block", "repeat_kv", "served_request", "site_kernels_that_serve", "site_missing", "validated_longest",
]
