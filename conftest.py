"""Root conftest: tests run with --import-mode=importlib (plugins may reuse test file names), so
each plugin's tests/ folder goes on sys.path for its helper modules."""

import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for tests_dir in sorted(glob.glob(os.path.join(HERE, "plugins", "*", "tests"))):
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)

# Triton runs on a CPU only under its interpreter, which must be switched on before any kernel is
# defined; set it here, before any test module imports triton.
if os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    pass  # a GPU machine: compile kernels for real
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
