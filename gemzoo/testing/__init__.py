"""Conformance suites, parametrised over every registered entry of a kind.

A third-party plugin gets the same checks by calling these from its own tests::

    from gemzoo.testing import attention_cases, check_attention
    @pytest.mark.parametrize("case", attention_cases(MY_KERNEL.capabilities), ids=str)
    def test_conformance(case):
        check_attention(MY_KERNEL, case, device="cpu")
"""

from gemzoo.testing.attention import AttentionCase, attention_cases, check_attention, random_jagged_lengths
from gemzoo.testing.precision import check_precision_linear

__all__ = ["AttentionCase", "attention_cases", "check_attention", "random_jagged_lengths", "check_precision_linear"]
