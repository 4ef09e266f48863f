"""Conformance suites, parametrised over every registered entry of a kind.

A third-party plugin gets the same checks by calling these from its own tests::

    from gemzoo.testing import attention_cases, check_attention
    @pytest.mark.parametrize("case", attention_cases(MY_KERNEL.capabilities), ids=str)
    def test_conformance(case):
        check_attention(MY_KERNEL, case, device="cpu")
"""

from gemzoo.testing.attention import AttentionCase, attention_cases, check_attention, random_jagged_lengths
from gemzoo.testing.precision import check_precision_linear

__all__ = ["AttentionCase", "attention_cases", "check_attention", "random_jagged_lengths", "check_precision_linear",
           "skip_unless_torchrec"]


def skip_unless_torchrec() -> None:
    """Skip the calling test when the sparse side would not use torchrec (not installed, or
    ``GEMZOO_NO_TORCHREC`` set), as on the GPU image."""
    import pytest

    from gemzoo.embedding import torchrec_available

    if not torchrec_available():
        pytest.skip("needs torchrec (not installed, or GEMZOO_NO_TORCHREC is set)")
