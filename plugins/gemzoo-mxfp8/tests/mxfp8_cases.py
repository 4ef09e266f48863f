"""Inputs for the cast tests: random data plus every edge case the MX rule has."""

import torch

ELEMS = [torch.float8_e4m3fn, torch.float8_e5m2]


def edge_tensor(rows: int, cols: int, seed: int = 0, elem=torch.float8_e4m3fn) -> torch.Tensor:
    """[rows, cols] fp32 (rows >= 12): random data over 60 decades plus zero, tiny, boundary and NaN blocks."""
    gen = torch.Generator().manual_seed(seed)
    emax = 448.0 if elem == torch.float8_e4m3fn else 57344.0
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-30, 30, cols).view(1, -1)
    x[1] = 0.0                                                            # all-zero blocks
    x[2, : min(cols, 32)] = -0.0                                          # negative zeros
    x[3] = torch.randn(cols, generator=gen) * 1e-40                      # fp32 subnormals
    x[4] = torch.full((cols,), 1.4e-45) * torch.randint(-3, 4, (cols,), generator=gen)  # tiniest subnormals
    k = torch.arange(cols).float().remainder(60) - 30
    at = emax * 2.0**k                                                    # exactly emax * 2^k
    x[5] = at
    x[6] = torch.nextafter(at, torch.full_like(at, float("inf")))         # just above
    x[7] = torch.nextafter(at, torch.zeros_like(at))                      # just below
    x[8] = -at * 1.5                                                      # mid-binade, negative
    x[9, ::7] = float("nan")                                              # NaN blocks
    x[10] = torch.randn(cols, generator=gen) * 2.0**-130                  # scale clamps near e = 0
    x[11] = 2.0 ** torch.randint(-20, 20, (cols,), generator=gen).float()  # exact powers of two
    return x
