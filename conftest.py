"""Root conftest: tests run with --import-mode=importlib (plugins may reuse test file names), so
each plugin's tests/ folder goes on sys.path for its helper modules."""

import glob
import os
import sys

pytest_plugins = ["gemzoo.testing.pytest_plugin"]  # <kind>_name parametrisation, registry_entry

HERE = os.path.dirname(os.path.abspath(__file__))
for tests_dir in sorted(glob.glob(os.path.join(HERE, "plugins", "*", "tests"))):
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)

# The one GPU-or-not switch of the test suite. Triton runs on a CPU only under its interpreter, which must
# be on before any kernel is defined, so a machine without CUDA sets it here, before any test module
# imports triton. On a GPU machine it stays off for the whole process: interpreter cases there run in
# subprocesses that set it themselves (plugins/gemzoo-jfa/tests/interp_cases.py).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from gemzoo.testing.interpreter import fix_interpreter  # noqa: E402

    fix_interpreter()  # Triton 3.6 with numpy >= 2.4 (triton-lang/triton#9171)
