"""After warm-up, batches of other token totals and item counts compile no jfa kernel again (skipped without
CUDA). Triton specialises integer arguments on divisibility by 16 and on == 1, so without ``do_not_specialize``
each new residue of a batch-varying count compiled the kernel again, for seconds, in the middle of training."""

from __future__ import annotations

import pytest
import torch
from gemzoo_jfa import jfa_triton

from gemzoo.api import lengths_to_offsets
from gemzoo.testing import CompileWatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _step(lengths: list[int], heads: int = 2, dim: int = 64) -> None:
    offsets = lengths_to_offsets(torch.tensor(lengths)).cuda()
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    jfa_triton(q, k, v, offsets).float().square().sum().backward()


def test_batch_varying_counts_compile_nothing_after_warm_up():
    gen = torch.Generator().manual_seed(0)
    # warm-up: total 1600 (divisible by 16), four items. Every batch here averages over the short-batch threshold
    # (family.SHORT_AVERAGE tokens a sequence): a short batch launches other tile configurations, compiled once
    # each the first time one comes, which is a configuration and not a batch-varying count.
    watch = CompileWatch().start()
    try:
        _step([350, 450, 400, 400])
        watch.arm()
        for batch in range(6):  # totals and item counts with every residue the specialisation keys on
            n = 3 + batch
            lengths = torch.randint(300, 500, (n,), generator=gen).tolist()
            lengths[0] += 1 - sum(lengths) % 2  # odd totals, then even ones below
            if batch % 2:
                lengths[0] += 16 - sum(lengths) % 16
            _step(lengths)
        torch.cuda.synchronize()
        assert watch.after_warmup == 0, watch.new_events()
    finally:
        watch.close()
