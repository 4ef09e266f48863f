#!/usr/bin/env bash
# Create .venv (if missing) and install gemzoo, its C++ extension and every plugin under plugins/.
# CPU machines: the pinned set in requirements/cpu-lock.txt (torch 2.13 CPU, torchrec 1.8, fbgemm-gpu-cpu 1.8).
# The C++ build (about 100 s on 2 cores) is skipped when csrc/, setup.py, Python and torch are what the last
# build saw: scripts/extension_stamp.py hashes them into .venv/.gemzoo-extension-stamp (delete it to rebuild).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
T0=$SECONDS
phase() { echo "[install $1/4, $((SECONDS - T0)) s] $2"; }
if [ -x .venv/bin/python ]; then
    phase 1 "reusing .venv"
else
    phase 1 "creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
fi
# torchrec must come in with --no-deps (it would pull the CUDA fbgemm-gpu); the lock pins everything.
phase 2 "installing the $(grep -c '^[A-Za-z]' requirements/cpu-lock.txt) pinned packages of requirements/cpu-lock.txt (torch, torchrec, ...; several minutes on a first install)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/cpu-lock.txt
plugins=()
for p in plugins/gemzoo-*/; do [ -f "$p/pyproject.toml" ] && plugins+=(-e "$p"); done
STAMP=.venv/.gemzoo-extension-stamp
build=1
skipped=0
if [ "${GEMZOO_NO_EXTENSION:-0}" != "0" ] && [ -n "${GEMZOO_NO_EXTENSION:-}" ]; then
    build=0  # asked for no extension: nothing to build, nothing to remember
    rm -f "$STAMP"
else
    stamp=$(.venv/bin/python scripts/extension_stamp.py)
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp" ] && compgen -G "gemzoo/_C*.so" > /dev/null; then
        echo "gemzoo._C is up to date (csrc/, setup.py, Python and torch unchanged): skipping the C++ build"
        build=0
        skipped=1
        export GEMZOO_NO_EXTENSION=1  # setup.py then builds nothing; the built gemzoo/_C*.so stays in place
    else
        rm -f "$STAMP"
    fi
fi
if [ "$build" = 1 ]; then
    phase 3 "installing gemzoo and $(( ${#plugins[@]} / 2 )) plugins in editable mode, building the C++ extension (about 100 s on 2 cores)"
else
    phase 3 "installing gemzoo and $(( ${#plugins[@]} / 2 )) plugins in editable mode (no C++ build)"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . "${plugins[@]}"
if [ "$build" = 1 ]; then echo "$stamp" > "$STAMP"; fi
if [ "$skipped" = 1 ]; then unset GEMZOO_NO_EXTENSION; fi
phase 4 "checking the install"
.venv/bin/python -c "import gemzoo, gemzoo.ops as o; print('gemzoo', gemzoo.__version__, '| C++ extension:', o.extension_available())"
echo "installed in $((SECONDS - T0)) s; next: .venv/bin/gemzoo train --config configs/gem-tiny.toml"
