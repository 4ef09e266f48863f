#!/usr/bin/env bash
# Build gemzoo._C (csrc/: the C++ ops and, with nvcc, the CUDA ones) on the device image, run the tests that
# need it, and return the library in $OUT. The image's other scripts install with GEMZOO_NO_EXTENSION=1 to save
# the minute of building, so the extension's tests skip there; a later session can carry the returned
# gemzoo/_C.cpython-*.so instead of building again (the image does not change between sessions).
#   bash bench/h200_extension.sh                  # from the repository root on the device machine
# Env: OUT (default /tmp/h200_ext), TEST_S (pytest limit, default 240).
set -o pipefail
export PYTHONUNBUFFERED=1 GEMZOO_NO_EXTENSION=0 MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-/tmp/h200_ext}; mkdir -p "$OUT"
t0=$(date +%s)
# shellcheck source=bench/device_install.sh
source "$(dirname "$0")/device_install.sh"; install_checkout "$OUT/ext_install.log" || exit 1
echo "installed with the extension in $(( $(date +%s) - t0 )) s"
cp gemzoo/_C*.so "$OUT/" && ls -la "$OUT"/_C*.so
python3 -c "from gemzoo import ops; print(ops.extension_info())" || exit 1
timeout "${TEST_S:-240}" python3 -m pytest -q -c pyproject.toml -rfEs \
  tests/test_cpu_attention.py tests/test_hadamard.py tests/test_ops.py > "$OUT/ext_tests.log" 2>&1
echo "extension tests rc=$? after $(( $(date +%s) - t0 )) s"; tail -12 "$OUT/ext_tests.log"
