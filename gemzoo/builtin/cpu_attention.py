"""Built-in attention kernel ``cpu``: the C++ CPU jagged attention of gemzoo._C (csrc/attention/).

Full attention semantics (every activation with norm; causal bottom-right, window, block; Lq != Lk; the
fused relative bias, a RelativeAttentionBias looked up per (query, key) pair inside the tiles), forward and
backward (gradients for q, k, v and both bias tables), grouped k/v (GQA/MQA: k and v with a divisor of q's
heads; the backward sums each group's dK/dV in one work item), fp32/bf16/fp16 inputs computed in fp32. GEM attention plugins dispatch to it for
CPU tensors. Without the extension (or for tensors on another device) it runs the ``reference`` oracle.
"""

from __future__ import annotations

import torch

from gemzoo import ops
from gemzoo.attention import FunctionKernel, check_inputs
from gemzoo.interfaces.attention import ACTIVATIONS, AttentionCapabilities
from gemzoo.plugins import hookimpl


def cpu_attention(q, k, v, q_offsets, k_offsets=None, **kw):
    check_inputs(q, k, v, q_offsets, k_offsets, capabilities=CPU.capabilities, kernel=CPU, **kw)
    return ops.jagged_attention(q, k, v, q_offsets, k_offsets, **kw)


CPU = FunctionKernel(
    cpu_attention,
    AttentionCapabilities(
        activations=frozenset(ACTIVATIONS), window=True, block=True, relative_bias=True, grouped_kv=True,
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        devices=frozenset({"cpu"}), backward_devices=frozenset({"cpu"}),
    ),
    "C++ blocked jagged attention with online softmax (gemzoo._C); torch reference when not built",
)


@hookimpl
def gemzoo_register_attention(register):
    register("cpu", CPU)
