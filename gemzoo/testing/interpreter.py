"""Triton interpreter cases run in a subprocess, for plugins with Triton kernels.

TRITON_INTERPRET=1 must be set before Triton is first imported, and never in the pytest process on a GPU
machine (every later launch would run in the interpreter), so each plugin keeps a script that sets it,
runs a group of cases and prints one ``RESULT {json}`` line; its tests read that line through
:func:`interpreter_results` (one subprocess per group, cached for the session, with :func:`fix_interpreter`
applied first)::

    SCRIPT = Path(__file__).with_name("my_interp_cases.py")
    INTERPRETER_GROUPS = ("cases", "conformance")  # started in the background when the first test runs
    _results = lambda group: interpreter_results(SCRIPT, group)

Groups run concurrently (up to one subprocess per spare core): gemzoo's pytest plugin starts every group that a
selected test module names in ``INTERPRETER_GROUPS`` when the first test of the run starts (never while
collecting: ``--collect-only`` starts no subprocess), so they run while other tests do, and
:func:`interpreter_results` waits for the one asked for.

Lifecycle: each subprocess leads a process group of its own; :func:`stop_all` kills those groups (the pytest
plugin calls it when the pytest run ends, Ctrl-C included, and ``atexit`` does for any other exit), and a watcher
thread in each subprocess kills its group when the parent process is gone (pytest killed by SIGTERM or SIGKILL).
Each run has a hang guard (:func:`gemzoo.testing.timeouts.hang_guard`).

The script may run the shared conformance suite on its Triton path with :func:`conformance_results`, and
check that ``torch.compile`` traces its custom op with :func:`compiled_matches_eager`.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from gemzoo.testing.timeouts import hang_guard

_runs: dict[tuple[str, str], _GroupRun] = {}
_live: set[subprocess.Popen] = set()
_lock = threading.Lock()
_stopping = threading.Event()
_slots = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) - 1))
GROUP_TIMEOUT_S = 1200  # one group takes 1-4 minutes on a loaded 2-core CPU

# The subprocess (argv: the parent's pid, the script, the group): a watcher that ends its process group once the
# parent is gone, the interpreter fix below, then the case script as __main__ (its folder on sys.path, as for
# ``python script.py``).
_BOOT = ("import os, runpy, signal, sys, threading, time\n"
         "def _watch(parent=int(sys.argv[1])):\n"
         "    while os.getppid() == parent:\n"
         "        time.sleep(0.5)\n"
         "    os.killpg(0, signal.SIGKILL)\n"
         "threading.Thread(target=_watch, daemon=True).start()\n"
         "from gemzoo.testing.interpreter import fix_interpreter; fix_interpreter()\n"
         "sys.argv = sys.argv[2:]; sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))\n"
         "runpy.run_path(sys.argv[0], run_name='__main__')\n")


class _GroupRun:
    """One case script's group in a subprocess, on a daemon thread that waits for a free slot first."""

    def __init__(self, script: str, group: str, timeout: float):
        self.script, self.group, self.timeout = script, group, timeout
        self.done = threading.Event()
        self.result: dict | None = None
        self.error: str | None = None
        threading.Thread(target=self._run, name=f"interpreter {group}", daemon=True).start()

    def _run(self) -> None:
        try:
            with _slots:
                if _stopping.is_set():
                    raise RuntimeError("the pytest run ended before this group started")
                # one intra-op thread: the groups run side by side, one per spare core, beside the other tests
                env = {"OMP_NUM_THREADS": "1", **os.environ, "TRITON_INTERPRET": "1"}
                with _lock:  # no start after stop_all() took the set of live processes
                    if _stopping.is_set():
                        raise RuntimeError("the pytest run ended before this group started")
                    proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(os.getpid()), self.script, self.group],
                                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            start_new_session=True)
                    _live.add(proc)
                try:
                    out, err = proc.communicate(timeout=self.timeout)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    out, err = proc.communicate()
                    err += f"\n(killed after {self.timeout:.0f} s; raise GEMZOO_TEST_TIMEOUT_SCALE on a slow machine)"
                finally:
                    with _lock:
                        _live.discard(proc)
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                self.error = (f"interpreter run of {self.script} {self.group} failed (exit {proc.returncode}):\n"
                              f"{out[-3000:]}\n{err[-3000:]}")
            else:
                self.result = json.loads(line[len("RESULT "):])
        except Exception as exc:  # noqa: BLE001 - reported by the test that asks for this group
            self.error = f"interpreter run of {self.script} {self.group} could not start: {exc!r}"
        finally:
            self.done.set()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (it and anything it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


@atexit.register
def stop_all() -> None:
    """Kill every running interpreter subprocess with its process group, and start no more; waits for them."""
    with _lock:
        _stopping.set()
        procs = list(_live)
    for proc in procs:
        _kill_group(proc)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        with _lock:
            _live.discard(proc)


def live_pids() -> list[int]:
    """The process ids of the interpreter subprocesses running now."""
    with _lock:
        return sorted(p.pid for p in _live)


def start_groups(script: str | Path, groups, timeout: float | None = None) -> None:
    """Start ``groups`` of a case script in the background (each once per process); ``timeout``: the hang
    guard of one group in seconds (default :data:`GROUP_TIMEOUT_S`, scaled by ``GEMZOO_TEST_TIMEOUT_SCALE``)."""
    limit = hang_guard(GROUP_TIMEOUT_S) if timeout is None else timeout
    for group in groups:
        key = (str(script), group)
        if key not in _runs:
            _runs[key] = _GroupRun(str(script), group, limit)


def select_triton_backend() -> bool:
    """The one GPU-or-not switch of a test session; returns whether CUDA is there.

    Triton runs on a CPU only under its interpreter, which must be on before triton is imported, so on a machine
    without CUDA this sets ``TRITON_INTERPRET=1`` (unless already set) and patches the interpreter
    (``fix_interpreter``). gemzoo's root ``conftest.py`` and ``gemzoo.testing.pytest_plugin`` (which each plugin's
    pytest config loads with ``-p``, so ``pytest`` inside a plugin's folder behaves as the whole suite) call it
    before any test module is imported. On a GPU machine the interpreter stays off for the whole process:
    interpreter cases there run in subprocesses that set it themselves."""
    import torch

    if torch.cuda.is_available():
        return True
    os.environ.setdefault("TRITON_INTERPRET", "1")
    fix_interpreter()
    return False


def fix_interpreter() -> None:
    """Make Triton 3.6's interpreter take shape-[1] scalars as loop bounds and indices.

    Its tensors' ``__index__`` is ``int(handle.data)``, and numpy >= 2.4 refuses that for an array of shape
    [1] (triton-lang/triton#9171, fixed in Triton 3.7 by squeezing first). Every kernel whose ``range()``
    bounds come from loads then fails under TRITON_INTERPRET=1 with "only 0-dimensional arrays can be
    converted to Python scalars". This wraps the interpreter's tensor patch to squeeze, as 3.7 does; it is
    idempotent and changes nothing where Triton already squeezes or the interpreter is missing."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "gemzoo_squeezes", False):
        return

    def index(self):
        return int(self.handle.data.squeeze())

    def patch_lang_tensor(tensor, *args, **kwargs):
        original(tensor, *args, **kwargs)
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None and hasattr(scope, "set_attr"):
            scope.set_attr(tensor, "__index__", index)  # restored with the interpreter's own patches
        else:
            tensor.__index__ = index

    patch_lang_tensor.gemzoo_squeezes = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def interpreter_results(script: str | Path, group: str, timeout: float | None = None) -> dict:
    """The JSON a case script prints (``RESULT {...}``) for ``group``, run under TRITON_INTERPRET=1 in a
    subprocess (started here unless :func:`start_groups` already did); fails with the script's output tail
    when it exits non-zero or prints no result."""
    start_groups(script, [group], timeout)
    run = _runs[(str(script), group)]
    run.done.wait()
    if run.error is not None:
        raise AssertionError(run.error)
    return run.result


def print_group(groups: dict, which: str) -> None:
    """A case script's main: run ``groups[which]()`` and print its ``RESULT {json}`` line."""
    if which not in groups:
        raise SystemExit(f"unknown group {which!r}; choose one of {', '.join(groups)}")
    print("RESULT " + json.dumps(groups[which]()))


def assert_conformance(results: dict[str, dict], at_least: int) -> None:
    """In a plugin's test: every case of :func:`conformance_results` passed, and at least ``at_least`` ran."""
    assert len(results) >= at_least, f"too few conformance cases ran: {sorted(results)}"
    bad = {k: v for k, v in results.items() if not v["ok"]}
    assert not bad, bad


def conformance_results(fn, capabilities, **case_kw) -> dict[str, dict]:
    """The attention conformance suite (gemzoo.testing.attention) on ``fn`` with ``capabilities``, on CPU
    tensors: {case: {"ok": bool, errors... or "error": message}} (for a script's RESULT line)."""
    # in the interpreter subprocess, after fix_interpreter has patched Triton: the suite imports torch and Triton
    from gemzoo.attention import FunctionKernel
    from gemzoo.testing.attention import attention_cases, check_attention

    kernel = FunctionKernel(fn, capabilities)
    results = {}
    for case in attention_cases(capabilities, **case_kw):
        try:
            results[str(case)] = {"ok": True, **check_attention(kernel, case, device="cpu")}
        except AssertionError as exc:
            results[str(case)] = {"ok": False, "error": str(exc)}
    return results


def compiled_matches_eager(loss_fn, *inputs, atol: float = 1e-5) -> bool:
    """Whether ``torch.compile(loss_fn, backend="aot_eager", fullgraph=True)`` traces (a graph break is an
    error) and gives eager's scalar loss and the same gradients of every input (leaf tensors that require
    grad; their ``.grad`` is left as the compiled run set it)."""
    import torch

    eager = loss_fn(*inputs)
    eager.backward()
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)(*inputs)
    compiled.backward()
    return bool(torch.allclose(eager, compiled, atol=atol)
                and all(torch.allclose(g, t.grad, atol=atol) for g, t in zip(grads, inputs, strict=True)))
