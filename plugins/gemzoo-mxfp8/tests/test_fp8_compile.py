"""fp8-rowwise and fp8-tensorwise inside one compiled graph, as in a compiled transformer block: two fp8 linears,
dynamic shapes from the first call (torch.compile(dynamic=True); auto-ac's dynamic = true sets the same), token
counts that change between calls. Each linear's autograd Function is then a subgraph of one Dynamo graph, and
nothing one Function's trace creates may reach the next: a float module global read in the casts became a graph
input read with .item() inside the first Function's subgraph, and the second fp8 linear reusing it stopped
tracing ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer", the compiled gem-1b rows
of fp8-rowwise and fp8-tensorwise)."""

import pytest
import torch
import torch.nn.functional as F
from gemzoo_mxfp8 import rowwise, tensorwise
from gemzoo_mxfp8.rowwise import FP8RowwiseLinear, quantize_rowwise, quantize_rowwise_t
from gemzoo_mxfp8.tensorwise import E4M3, FP8TensorwiseLinear, quantize_tensorwise
from torch import nn

MAKERS = {
    "fp8-rowwise": lambda lin: FP8RowwiseLinear.from_linear(lin, out_dtype=torch.bfloat16),
    "fp8-tensorwise": lambda lin: FP8TensorwiseLinear.from_linear(lin, out_dtype=torch.bfloat16),
}


class Block(nn.Module):
    """Two fp8 linears with a high-precision one between them (selective precision keeps some): fp32 master
    weights and bf16 activations, as the fp8 policies run a gem block. The second fp8 linear is where tracing
    stopped."""

    def __init__(self, make, d=64, hidden=96):
        super().__init__()
        self.fc1, self.mid, self.fc2 = make(nn.Linear(d, hidden)), nn.Linear(hidden, hidden), make(nn.Linear(hidden, d))

    def forward(self, x):
        h = F.gelu(self.fc1(x)).to(x.dtype)
        return x + self.fc2(self.mid(h.float()).to(x.dtype)).to(x.dtype)


def _step(block, fn, x, g):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.float().backward(g)
    return {"y": y.detach().float(), "dx": x.grad.float(),
            **{name: p.grad.float() for name, p in block.named_parameters()}}


@pytest.mark.slow  # 3-5 s a case: one dynamic-shape compile each
@pytest.mark.parametrize("precision", list(MAKERS))
def test_block_compiles_with_dynamic_shapes(precision, monkeypatch):
    """fullgraph, dynamic shapes from the first call, the CUDA GEMM path where CPU has it (torch._scaled_mm):
    forward and backward over two token counts (one not a multiple of the wgrad padding), equal to eager."""
    monkeypatch.setattr(tensorwise, "SCALED_MM_ON_CPU", True)
    torch.manual_seed(0)
    block = Block(MAKERS[precision])
    inputs = {t: (torch.randn(t, 64).bfloat16(), torch.randn(t, 64)) for t in (45, 80)}
    want = {t: _step(block, block, *xg) for t, xg in inputs.items()}
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=True)
    try:
        got = {t: _step(block, compiled, *xg) for t, xg in inputs.items()}
    finally:
        torch._dynamo.reset()
    for t in inputs:
        for name, w in want[t].items():
            assert torch.allclose(got[t][name], w, rtol=1e-5, atol=1e-5), (t, name)


def test_cast_literals_are_the_documented_constants():
    """The casts spell EPS and E4M3_MAX as literals (no float global under Dynamo): an all-zero row takes the
    scale EPS / E4M3_MAX and a tensor's inverse scale is max(amax, EPS) / fp8_max, as the constants say."""
    zeros = torch.zeros(3, 32)
    floor = torch.zeros(()).clamp_min(rowwise.EPS) / rowwise.E4M3_MAX  # in fp32, as the casts compute it
    assert torch.equal(quantize_rowwise(zeros)[1], floor.expand(3, 1))
    assert torch.equal(quantize_rowwise_t(zeros, 16)[1], floor.expand(32, 1))
    assert torch.equal(quantize_rowwise_t(zeros[:0], 16)[1], torch.full((32, 1), rowwise.EPS / rowwise.E4M3_MAX))
    assert torch.all(quantize_rowwise(torch.randn(2, 16))[0].float().abs().amax(1) == rowwise.E4M3_MAX)
    assert rowwise.E4M3_MAX == torch.finfo(E4M3).max
    inv = quantize_tensorwise(zeros)[2]
    assert torch.equal(inv, (torch.tensor(torch.finfo(E4M3).max) / torch.tensor(tensorwise.EPS)).reciprocal())
