"""Triton interpreter cases run in a subprocess, for plugins with Triton kernels.

TRITON_INTERPRET=1 must be set before Triton is first imported, and never in the pytest process (on a GPU
machine every later launch would run in the interpreter), so each plugin keeps a script that sets it,
runs a group of cases and prints one ``RESULT {json}`` line; its tests read that line through
:func:`interpreter_results` (one subprocess per group, cached for the session)::

    _results = lambda group: interpreter_results(Path(__file__).with_name("my_interp_cases.py"), group)

and the script may run the shared conformance suite on its Triton path with :func:`conformance_results`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_cache: dict[tuple[str, str], dict] = {}


def interpreter_results(script: str | Path, group: str, timeout: float = 900) -> dict:
    """The JSON a case script prints (``RESULT {...}``) for ``group``, run under TRITON_INTERPRET=1 in a
    subprocess; fails with the script's output tail when it exits non-zero or prints no result."""
    key = (str(script), group)
    if key not in _cache:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, str(script), group], capture_output=True, text=True, env=env,
                              timeout=timeout)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise AssertionError(f"interpreter run of {script} {group} failed (exit {proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        _cache[key] = json.loads(line[len("RESULT "):])
    return _cache[key]


def conformance_results(fn, capabilities, **case_kw) -> dict[str, dict]:
    """The attention conformance suite (gemzoo.testing.attention) on ``fn`` with ``capabilities``, on CPU
    tensors: {case: {"ok": bool, errors... or "error": message}} (for a script's RESULT line)."""
    from gemzoo.interfaces.attention import FunctionKernel
    from gemzoo.testing.attention import attention_cases, check_attention

    kernel = FunctionKernel(fn, capabilities)
    results = {}
    for case in attention_cases(capabilities, **case_kw):
        try:
            results[str(case)] = {"ok": True, **check_attention(kernel, case, device="cpu")}
        except AssertionError as exc:
            results[str(case)] = {"ok": False, "error": str(exc)}
    return results
