"""Random Hadamard transform (RHT) helpers: H diag(signs) per block of 16 or 32 along the last dim.

The CPU path is ``gemzoo.api.hadamard_transform`` (C++ when built); the GPU path fuses the transform into the
Triton columnwise cast. ``hadamard_transform_torch`` below is the plain-torch form the GPU tests and the bench
compare that cast against.
"""

from __future__ import annotations

import functools

import torch

from gemzoo.api import ConfigError

RHT_BLOCKS = (16, 32)


@functools.cache
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(n: int, normalized: bool = True) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (+-1 entries; divided by sqrt(n) when ``normalized``)."""
    if n <= 0 or n & (n - 1):
        raise ConfigError(f"Hadamard size must be a power of two, got {n}")
    h = _sylvester(n).clone()
    return h / n**0.5 if normalized else h


def rht_signs(block: int, seed: int) -> torch.Tensor:
    """The fixed +-1 sign vector of one run (a pure function of ``seed``)."""
    if block not in RHT_BLOCKS:
        raise ConfigError(f"rht_block must be 16 or 32, got {block}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (block,), generator=gen).float() * 2 - 1


def hadamard_transform_torch(x: torch.Tensor, block: int = 32, signs: torch.Tensor | None = None,
                             inverse: bool = False) -> torch.Tensor:
    """Orthonormal H diag(signs) over consecutive blocks of the last dim (inverse: diag(signs) H^T)."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the Hadamard block {block}; pad it first")
    h = hadamard_matrix(block).to(device=x.device, dtype=torch.float32)
    s = torch.ones(block, device=x.device) if signs is None else signs.to(device=x.device, dtype=torch.float32)
    m = h * s.view(1, -1)  # H diag(s)
    m = m.t() if inverse else m  # (H diag(s))^-1 = diag(s) H^T
    xb = x.float().reshape(*x.shape[:-1], n // block, block)
    return (xb @ m.t()).reshape(x.shape).to(x.dtype)
