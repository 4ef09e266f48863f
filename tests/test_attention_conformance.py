"""Shared attention conformance suite over every registered kernel that runs on CPU."""

import pytest
import torch

import gemzoo
from gemzoo.testing import attention_cases, check_attention


def _cpu_cases():
    out = []
    for name in gemzoo.registry.names("attention"):
        kernel = gemzoo.registry.get("attention", name)
        caps = kernel.capabilities
        if "cpu" not in caps.devices:
            continue
        backward = "cpu" in caps.backward_devices
        for case in attention_cases(caps):
            out.append(pytest.param(name, case, backward, id=f"{name}-{case}"))
    return out


@pytest.mark.parametrize("name,case,backward", _cpu_cases())
def test_kernel_matches_reference(name, case, backward):
    kernel = gemzoo.registry.get("attention", name)
    dtype = torch.float64 if torch.float64 in kernel.capabilities.dtypes else torch.float32
    # a kernel approximate by design (jfa-fp8) declares its bound as forward_tolerance
    check_attention(kernel, case, device="cpu", dtype=dtype, backward=backward,
                    tol=getattr(kernel, "forward_tolerance", None))


@pytest.mark.parametrize("name", ["reference", "sdpa-padded"])
def test_bf16_inputs(name):
    kernel = gemzoo.registry.get("attention", name)
    from gemzoo.testing.attention import AttentionCase

    check_attention(kernel, AttentionCase(seed=7), dtype=torch.bfloat16)


def test_reference_hand_computed():
    """Two queries, causal: the first sees only key 0, the second averages by softmax."""
    q = torch.tensor([[[0.0]], [[1.0]]])
    k = torch.tensor([[[0.0]], [[1.0]]])
    v = torch.tensor([[[1.0]], [[3.0]]])
    off = torch.tensor([0, 2])
    out = gemzoo.registry.get("attention", "reference")(q, k, v, off, scale=1.0)
    w = torch.softmax(torch.tensor([0.0, 1.0]), 0)
    torch.testing.assert_close(out[:, 0, 0], torch.stack([torch.tensor(1.0), w[0] * 1 + w[1] * 3]))
