"""gdpa's Triton kernels on CPU tensors under TRITON_INTERPRET=1 (run in a subprocess: the variable must be
set before Triton is imported, and other tests in this process may import it first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gemzoo.testing.interpreter import assert_conformance, interpreter_results

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("gdpa_interp_cases.py")
INTERPRETER_GROUPS = ("cases", "conformance", "misc", "gqa")  # started in the background when collection ends (gemzoo.testing.interpreter)
sys.path.insert(0, str(SCRIPT.parent))
from gdpa_interp_cases import CASES, GQA_CASES  # noqa: E402


def _results(group: str) -> dict:
    return interpreter_results(SCRIPT, group)


@pytest.mark.parametrize("name", list(CASES) + ["tma-silu-asym-window", "tma-gelu-full-bf16",
                                                 "fused-dq-silu-asym-window", "fused-dq-split-gelu-cross"])
def test_fwd_bwd_poisoned_against_reference(name):
    errors = _results("cases")[name]
    for key in ("out", "dq", "dk", "dv"):
        assert errors[f"{key}_finite"], f"{name}: {key} has NaN/Inf (unwritten elements stay NaN)"
        assert errors[key] <= errors["tol"], f"{name}: {key} relative error {errors[key]:.2e} > {errors['tol']}"


def test_every_pointwise_activation_is_covered():
    from gdpa_interp_cases import POINTWISE

    assert {CASES[n][0] for n in CASES} >= set(POINTWISE)


@pytest.mark.parametrize("path", ["plain", "split", "tma"])
def test_nan_stays_in_its_sequence(path):
    res = _results("misc")["nan"][path]
    assert res["others_finite"], "a NaN in one sequence reached another sequence's outputs or gradients"
    assert res["own_nan"], "the NaN should propagate within its own sequence"


@pytest.mark.parametrize("kernel", ["jfa", "gdpa"])
def test_strided_offsets_view(kernel):
    res = _results("misc")["strided"][kernel]
    assert res["contiguous"] < 1e-5 and res["strided"] < 1e-5, res


def test_torch_compile_traces_custom_op_and_opcheck():
    res = _results("misc")["compile"]
    assert res["compile"], "torch.compile(fullgraph=True) result differs from eager"
    assert res["opcheck"]


def test_shared_conformance_suite_on_triton_path():
    assert_conformance(_results("conformance"), at_least=16)


@pytest.mark.parametrize("name", list(GQA_CASES))
def test_grouped_query_against_fp64_reference(name):
    """k/v with fewer heads than q (GQA, MQA), head dims 256 and 50: forward and every gradient within 2e-3."""
    errors = _results("gqa")[name]
    for key in [k for k in errors if not k.endswith("_finite")]:
        assert errors[f"{key}_finite"], f"{name}: {key} has NaN/Inf"
        assert errors[key] < 2e-3, f"{name}: {key} relative error {errors[key]:.2e}"
