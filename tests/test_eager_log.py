"""gemzoo.testing.eager_log: outcomes and failures are on disk as each test ends (for device runs cut off by a
time limit)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gemzoo.testing.timeouts import hang_guard


@pytest.mark.multiprocess
def test_each_outcome_and_failure_is_written_as_it_happens(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_ok():\n    assert True\n\n"
                                          "def test_bad():\n    import os\n"
                                          "    os.write(2, b'a child wrote this\\n')\n"  # as a spawned rank does
                                          "    assert 1 == 2, 'the reason'\n")
    log = tmp_path / "log"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gemzoo.testing.eager_log", "-p",
                           "no:cacheprovider", "test_two.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=hang_guard(600), env=dict(os.environ, GEMZOO_TEST_LOG=str(log)))
    assert proc.returncode == 1, proc.stdout[-2000:]
    lines = (log / "progress.txt").read_text().splitlines()
    assert [ln.split()[1] for ln in lines] == ["passed", "failed"] and lines[1].endswith("test_two.py::test_bad")
    failures = (log / "failures.txt").read_text()
    assert "the reason" in failures and "a child wrote this" in failures  # with the captured output
