"""The relative attention bias in the jfa family's Triton kernels (gdpa's relative_bias=) on CPU tensors under
TRITON_INTERPRET=1, in a subprocess (gdpa_rb_interp_cases.py); the input check in this process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gemzoo.api import JaggedShapeError, RelativeAttentionBias, lengths_to_offsets
from gemzoo.testing.interpreter import interpreter_results

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("gdpa_rb_interp_cases.py")
INTERPRETER_GROUPS = ("cases", "entry", "entry_jfa")  # started in the background when collection ends (gemzoo.testing.interpreter)
sys.path.insert(0, str(SCRIPT.parent))
from gdpa_rb_interp_cases import CASES  # noqa: E402

GRADS = ("out", "dq", "dk", "dv", "dpos", "dtw")


def _results(group: str) -> dict:
    return interpreter_results(SCRIPT, group)


@pytest.mark.parametrize("name", list(CASES))
def test_fwd_bwd_with_relative_bias_poisoned_against_reference(name):
    errors = _results("cases")[name]
    timed = CASES[name][6]
    for key in GRADS:
        if key == "dtw" and not timed:
            assert errors["dtw_none"], f"{name}: a positions-only bias has no time_weights gradient"
            continue
        assert errors[f"{key}_finite"], f"{name}: {key} has NaN/Inf (unwritten elements stay NaN)"
        tol = 1e-5 if key in ("dpos", "dtw") else errors["tol"]  # the tables' gradients are summed in fp32
        assert errors[key] <= tol, f"{name}: {key} relative error {errors[key]:.2e} > {tol}"


def test_cases_cover_every_variant():
    acts = {c[0] for c in CASES.values()}
    assert {"silu", "softmax"} <= acts and len(acts) >= 5
    assert {c[6] for c in CASES.values()} == {True, False}  # positions only, positions + time
    assert {k for c in CASES.values() for k in c[10]} >= {"split", "fused_dq", "tma"}


def test_gdpa_triton_eager_autograd_and_no_grad():
    res = _results("entry")
    for key in GRADS:
        assert res["eager"][key] <= 1e-5, f"gdpa_triton(relative_bias=...): {key} {res['eager'][key]:.2e}"
    assert res["no_grad_out"] <= 1e-5


@pytest.mark.parametrize("group", ["entry", "entry_jfa"])
def test_torch_compile_fullgraph_and_opcheck(group):
    res = _results(group)
    assert res["compile"], "torch.compile(fullgraph=True) with relative_bias differs from eager"
    assert res["opcheck"]


def test_jfa_triton_softmax_with_relative_bias():
    res = _results("entry_jfa")
    for key in GRADS:
        assert res["eager"][key] <= 1e-5, f"jfa_triton(relative_bias=...): {key} {res['eager'][key]:.2e}"


def _inputs():
    off = lengths_to_offsets(torch.tensor([3, 0, 4]))
    q, k, v = (torch.randn(7, 1, 16) for _ in range(3))
    return q, k, v, off


@pytest.mark.parametrize("bad, message", [
    (lambda: RelativeAttentionBias(torch.zeros(4), torch.zeros(3), torch.zeros(7), torch.zeros(7, dtype=torch.long)),
     "q_times must be an int64 tensor"),
    (lambda: RelativeAttentionBias(torch.zeros(4, 2)), "positions must be a non-empty floating 1-D tensor"),
    (lambda: RelativeAttentionBias(torch.zeros(4), None, torch.zeros(7, dtype=torch.long)),
     "q_times is given without time_weights"),
])
def test_bad_relative_bias_is_a_clear_error(bad, message):
    from gemzoo_gdpa import gdpa_triton

    q, k, v, off = _inputs()
    with pytest.raises((JaggedShapeError, ValueError), match=message):
        gdpa_triton(q, k, v, off, activation="silu", relative_bias=bad())


def test_gdpa_and_jfa_declare_relative_bias():
    from gemzoo_gdpa.ops import KERNEL
    from gemzoo_jfa.ops import KERNEL as JFA

    assert KERNEL.capabilities.relative_bias and JFA.capabilities.relative_bias
