"""gemzoo.testing.interpreter.fix_interpreter: Triton 3.6's interpreter with numpy >= 2.4 cannot use a loaded
scalar as a ``range()`` bound (triton-lang/triton#9171); every jagged kernel's key loop does. The test puts
3.6's ``__index__`` back on whatever Triton is installed, shows the failure, then the fix (in a subprocess:
TRITON_INTERPRET must be set before Triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gemzoo.testing.timeouts import hang_guard

pytest.importorskip("triton")

SCRIPT = r'''
import torch, triton, triton.language as tl
from triton.runtime import interpreter

@triton.jit
def count(N, OUT):
    n = tl.load(N)
    acc = 0
    for i in range(0, n):
        acc += 1
    tl.store(OUT, acc)

def run():
    out = torch.zeros(1, dtype=torch.int32)
    count[(1,)](torch.tensor([5], dtype=torch.int32), out)
    return int(out)

patch = interpreter._patch_lang_tensor
def as_in_triton_36(tensor, scope):
    patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))
interpreter._patch_lang_tensor = as_in_triton_36
try:
    print("before", run())
except Exception as exc:
    print("before raised", type(exc).__name__, "0-dimensional" in repr(exc))
from gemzoo.testing.interpreter import fix_interpreter
fix_interpreter(); fix_interpreter()  # idempotent
print("after", run())
'''


@pytest.mark.multiprocess
def test_fix_interpreter_lets_a_loaded_scalar_bound_a_loop(tmp_path):
    script = tmp_path / "case.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=hang_guard(300),
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "before raised InterpreterError True" in lines  # numpy refuses int() of a shape-[1] array
    assert "after 5" in lines
