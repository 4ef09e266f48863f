"""Triton kernels on CPU tensors under TRITON_INTERPRET=1 (run in a subprocess: the variable must be set
before Triton is imported, and other tests in this process may import it first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gemzoo.testing.interpreter import assert_conformance, interpreter_results

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("interp_cases.py")
INTERPRETER_GROUPS = ("cases", "conformance", "compile", "gqa")  # started in the background when collection ends (gemzoo.testing.interpreter)
sys.path.insert(0, str(SCRIPT.parent))
from interp_cases import CASES, GQA_CASES  # noqa: E402


def _results(group: str) -> dict:
    return interpreter_results(SCRIPT, group)


TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}


EXTRA = {"natural-order": "float32", "tma-asym-window": "float32", "tma-full": "bfloat16",
         "buckets-causal": "float32", "buckets-asym-window": "float32", "buckets-full-emptyk": "float32",
         "buckets-tma-bf16": "bfloat16", "fused-dq-causal": "float32", "fused-dq-asym-window": "float32",
         "fused-dq-full-emptyk": "float32", "fused-dq-d24-dv16": "float32",
         "fused-dq-tma-buckets-bf16": "bfloat16"}  # interp_cases.all_cases beyond CASES


@pytest.mark.parametrize("name", [c[0] for c in CASES] + list(EXTRA))
def test_fwd_bwd_against_reference(name):
    errors = _results("cases")[name]
    dtype = next((c[-1] for c in CASES if c[0] == name), EXTRA.get(name))
    assert errors["dtype_ok"], "output or gradient dtype differs from the input dtype"
    for key in ("out", "dq", "dk", "dv"):
        assert errors[f"{key}_finite"], f"{name}: {key} has NaN/Inf"
        assert errors[key] < TOL[dtype], f"{name}: {key} relative error {errors[key]:.2e} >= {TOL[dtype]}"


def test_shared_conformance_suite_on_triton_path():
    assert_conformance(_results("conformance"), at_least=6)


def test_torch_compile_traces_custom_op_and_opcheck():
    results = _results("compile")
    assert results["compile"]["ok"], "torch.compile(fullgraph=True) result differs from eager"
    assert results["opcheck"]["ok"]


@pytest.mark.parametrize("name", list(GQA_CASES))
def test_grouped_query_against_fp64_reference(name):
    """k/v with fewer heads than q (GQA, MQA), head dims 256 and 50: forward and every gradient within 2e-3."""
    errors = _results("gqa")[name]
    for key in [k for k in errors if not k.endswith("_finite")]:
        assert errors[f"{key}_finite"], f"{name}: {key} has NaN/Inf"
        assert errors[key] < 2e-3, f"{name}: {key} relative error {errors[key]:.2e}"
