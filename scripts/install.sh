#!/usr/bin/env bash
# Create .venv (if missing) and install gemzoo, its C++ extension and every plugin under plugins/.
# CPU machines: the pinned set in requirements/cpu-lock.txt (torch 2.13 CPU, torchrec 1.8, fbgemm-gpu-cpu 1.8).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torchrec must come in with --no-deps (it would pull the CUDA fbgemm-gpu); the lock pins everything.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/cpu-lock.txt
plugins=()
for p in plugins/gemzoo-*/; do [ -f "$p/pyproject.toml" ] && plugins+=(-e "$p"); done
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . "${plugins[@]}"
.venv/bin/python -c "import gemzoo, gemzoo.ops as o; print('gemzoo', gemzoo.__version__, '| C++ extension:', o.extension_available())"
