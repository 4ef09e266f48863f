"""The suite's own machinery: hang guards scale, interpreter subprocesses start only when tests run and never
outlive the process that started them, and collecting starts no subprocess (docs/testing.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gemzoo.testing.timeouts import SCALE_VAR, hang_guard, timeout_scale

ROOT = Path(__file__).resolve().parents[1]


def test_hang_guards_scale_with_the_environment(monkeypatch):
    monkeypatch.delenv(SCALE_VAR, raising=False)
    assert timeout_scale() == 1.0 and hang_guard(300) == 300
    monkeypatch.setenv(SCALE_VAR, "2.5")
    assert hang_guard(300) == 750
    for bad, problem in (("fast", "is not a number"), ("0", "must be positive"), ("-1", "must be positive")):
        monkeypatch.setenv(SCALE_VAR, bad)
        with pytest.raises(ValueError, match=problem):
            hang_guard(300)


def test_markers_follow_the_tier_rules(request):
    """multiprocess implies slow, interpreter modules are multiprocess, and gpu tests skip without CUDA (the root
    conftest's rules), seen on the items of this run."""
    import torch

    for item in request.session.items:
        if item.get_closest_marker("multiprocess"):
            assert item.get_closest_marker("slow"), item.nodeid
        if getattr(getattr(item, "module", None), "INTERPRETER_GROUPS", None):
            assert item.get_closest_marker("multiprocess"), item.nodeid
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            assert any(m.name in ("skip", "skipif") for m in item.iter_markers()), item.nodeid


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + hang_guard(seconds)
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _gone(pid)


# A case script whose group writes its pid and then sleeps: it stands for a long interpreter group.
SLEEPER = "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
PARENT = textwrap.dedent("""
    import os, sys, time
    from gemzoo.testing.interpreter import live_pids, start_groups, stop_all
    from gemzoo.testing.timeouts import hang_guard
    script, pid_file, mode = sys.argv[1:]
    start_groups(script, [pid_file])
    deadline, seen = time.monotonic() + hang_guard(300), False
    while not os.path.exists(pid_file) or not open(pid_file).read():
        seen = seen or bool(live_pids())
        if time.monotonic() > deadline or (seen and not live_pids()):
            sys.exit("the group did not start, or ended early")
        time.sleep(0.05)
    print("STARTED", flush=True)
    if mode == "stop":
        stop_all()
        print("LIVE", live_pids(), flush=True)
    else:
        time.sleep(600)
""")


def _start_parent(tmp_path: Path, mode: str):
    script = tmp_path / "sleeper_cases.py"
    script.write_text(SLEEPER)
    pid_file = tmp_path / "group.pid"  # the group's name is the file it writes
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(script), str(pid_file), mode], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = parent.stdout.readline()
    assert line.startswith("STARTED"), parent.stderr.read()[-2000:] if parent.poll() is not None else line
    return parent, int(pid_file.read_text())


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_an_interpreter_group_dies_with_the_process_that_started_it(tmp_path, how):
    """pytest killed (no atexit, no finalizer runs): the group's watcher sees its parent gone and kills its
    process group."""
    parent, child = _start_parent(tmp_path, "sleep")
    try:
        assert not _gone(child)
        parent.send_signal(getattr(signal, how))
        parent.wait(timeout=hang_guard(60))
        assert _wait_gone(child, 30), f"interpreter group {child} outlived its parent"
    finally:
        parent.kill()
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_stop_all_kills_the_running_groups(tmp_path):
    """What the run's finalizer (and atexit) call: every running group is killed and none is left live."""
    parent, child = _start_parent(tmp_path, "stop")
    try:
        out, err = parent.communicate(timeout=hang_guard(120))
        assert parent.returncode == 0, err[-2000:]
        assert "LIVE []" in out
        assert _wait_gone(child, 10)
    finally:
        parent.kill()
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


PROBE = textwrap.dedent("""
    import os, subprocess, multiprocessing.process
    LOG = os.environ["GEMZOO_PROBE_LOG"]
    def _record(what):
        with open(LOG, "a") as f:
            f.write(repr(what) + "\\n")
    _popen_init = subprocess.Popen.__init__
    def _popen(self, args, *a, **kw):
        _record(args)
        _popen_init(self, args, *a, **kw)
    subprocess.Popen.__init__ = _popen
    _start = multiprocessing.process.BaseProcess.start
    def _mp_start(self):
        _record(("multiprocessing", self.name))
        _start(self)
    multiprocessing.process.BaseProcess.start = _mp_start
""")


def _root_conftest(config):
    return next(m for m in config.pluginmanager.get_plugins() if getattr(m, "__file__", None) == str(ROOT / "conftest.py"))


@pytest.mark.multiprocess
def test_collect_only_starts_no_subprocess(tmp_path, request):
    """Collecting the interpreter modules and spawning modules (``--collect-only``) starts no Python process;
    every case the root conftest marks slow by name is collected (a renamed test would silently be quick)."""
    (tmp_path / "gemzoo_subprocess_probe.py").write_text(PROBE)
    log = tmp_path / "started.txt"
    env = {**os.environ, "GEMZOO_PROBE_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    slow_cases = _root_conftest(request.config).SLOW_CASES
    files = sorted({str(p.relative_to(ROOT)) for p in ROOT.glob("plugins/*/tests/test_interpreter.py")}
                   | {"tests/test_distributed.py", "tests/test_ablation.py"} | {c.split("::")[0] for c in slow_cases})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "gemzoo_subprocess_probe",
                           *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard(600))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tests collected" in proc.stdout
    assert not slow_cases - set(proc.stdout.splitlines()), "SLOW_CASES names tests that no longer exist"
    started = log.read_text().splitlines() if log.exists() else []
    python = [line for line in started if "python" in line or "multiprocessing" in line]
    assert not python, f"collection started Python processes: {python}"
