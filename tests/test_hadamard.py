"""gemzoo.ops.hadamard_transform: blocked orthonormal FWHT (16/32), random signs, inverse; C++ and CUDA vs torch."""

import pytest
import torch

from gemzoo import ops

needs_ext = pytest.mark.skipif(not ops.extension_available(), reason="gemzoo._C is not built")


def _signs(block, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (block,), generator=g).float() * 2 - 1


def _explicit(x, block, signs, inverse):
    """y_blk = H diag(s) x_blk, with H built entry by entry: H[i, j] = (-1)^popcount(i & j) / sqrt(block)."""
    idx = torch.arange(block)
    parity = torch.tensor([[bin(int(i) & int(j)).count("1") % 2 for j in idx] for i in idx])
    h = (1 - 2 * parity).double() / block ** 0.5
    s = torch.ones(block, dtype=torch.float64) if signs is None else signs.double()
    m = h @ torch.diag(s) if not inverse else torch.diag(s) @ h.T
    xb = x.double().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    return (xb @ m.T).reshape(x.shape)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("with_signs", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (0, 32), (32,)])
def test_matches_explicit_matrix(block, with_signs, inverse, shape):
    x = torch.randn(*shape)
    signs = _signs(block, seed=block) if with_signs else None
    want = _explicit(x, block, signs, inverse)
    torch.testing.assert_close(ops.hadamard_transform(x, block, signs, inverse).double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.hadamard_transform_torch(x, block, signs, inverse).double(), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2),
                                       (torch.float16, 2e-3)])
def test_inverse_roundtrip_and_norm(dtype, tol):
    x = torch.randn(4, 7, 64).to(dtype)
    signs = _signs(32, seed=3)
    y = ops.hadamard_transform(x, 32, signs)
    assert y.dtype == dtype
    back = ops.hadamard_transform(y, 32, signs, inverse=True)
    assert ((back.double() - x.double()).norm() / x.double().norm()) < tol * 4
    assert abs(float(y.double().norm() / x.double().norm()) - 1) < tol * 4  # orthonormal


def test_gradients_are_the_inverse_transform():
    signs = _signs(16, seed=5).double()
    x = torch.randn(3, 48, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: ops.hadamard_transform(t, 16, signs), (x,))
    torch.autograd.gradcheck(lambda t: ops.hadamard_transform(t, 16, signs, inverse=True), (x,))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block must be one of"):
        ops.hadamard_transform(torch.randn(2, 64), 8)
    with pytest.raises(ValueError, match="multiple of block=32"):
        ops.hadamard_transform(torch.randn(2, 48), 32)
    with pytest.raises(ValueError, match="signs must be a 1-D tensor of 16"):
        ops.hadamard_transform(torch.randn(2, 32), 16, torch.ones(32))


@pytest.mark.slow
@needs_ext
def test_opcheck():
    x = torch.randn(3, 64, requires_grad=True)
    for signs in (None, _signs(32)):
        for inverse in (False, True):
            torch.library.opcheck(torch.ops.gemzoo.hadamard_transform.default, (x, 32, signs, inverse))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    x = torch.randn(37, 5, 96).to(dtype)  # 37*5*96 elements: a partial last thread block
    for block in (16, 32):
        signs = _signs(block, seed=block)
        for inverse in (False, True):
            got = ops.hadamard_transform(x.cuda(), block, signs.cuda(), inverse).cpu()
            want = ops.hadamard_transform_torch(x, block, signs, inverse)
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
