"""A pytest plugin that writes each test's outcome, and each failure's text, the moment it is known.

For runs that may be cut off (a job's time limit, a hang): what finished is on disk, not only in a
summary that never prints. Enable it with ``-p gemzoo.testing.eager_log`` and a folder in ``GEMZOO_TEST_LOG``::

    GEMZOO_TEST_LOG=results/ python -m pytest -q -p gemzoo.testing.eager_log --timeout 90

``progress.txt`` gets one line per test (seconds since start, outcome, phase, duration, node id) and
``failures.txt`` the report of each failure with its captured output, both flushed at every line.
"""

from __future__ import annotations

import os
import time

_files: dict[str, object] = {}
_t0 = time.time()


def _open(name: str):
    if name not in _files:
        folder = os.environ.get("GEMZOO_TEST_LOG")
        if not folder:
            return None
        os.makedirs(folder, exist_ok=True)
        _files[name] = open(os.path.join(folder, name), "a", buffering=1)
    return _files[name]


def pytest_runtest_logreport(report) -> None:
    progress = _open("progress.txt")
    if progress is None:
        return
    if report.when == "call" or report.outcome != "passed":
        progress.write(f"{time.time() - _t0:8.1f} {report.outcome:7s} {report.when:8s} {report.duration:7.2f} "
                       f"{report.nodeid}\n")
    if report.outcome == "failed":
        # the captured output too: a spawned rank's traceback is only there (it writes to the test's stderr)
        captured = "".join(f"----- {title}\n{text[-4000:]}\n" for title, text in report.sections if text.strip())
        _open("failures.txt").write(f"===== {report.nodeid} [{report.when}]\n{report.longreprtext[-6000:]}\n"
                                    f"{captured}")


def pytest_unconfigure(config) -> None:
    for f in _files.values():
        f.close()
    _files.clear()
