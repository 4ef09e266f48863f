#!/usr/bin/env bash
# The README's test command on a GPU machine (the device tool's H200), in one process, as one device call:
# install core + every plugin from this checkout without network, then pytest with a per-test timeout, every
# outcome and failure written to $OUT as it happens (gemzoo.testing.eager_log), so a call cut off by its time
# limit still says how far it got and what failed.
#   bash bench/h200_suite.sh                      # the whole suite
#   bash bench/h200_suite.sh plugins/ -x          # any pytest arguments instead
# Env: OUT (default /tmp/h200_suite), SUITE_S (overall limit, default 540), TEST_S (per test, default 90).
set -o pipefail
export PYTHONUNBUFFERED=1 GEMZOO_NO_EXTENSION=1
OUT=${OUT:-/tmp/h200_suite}; mkdir -p "$OUT"
t0=$(date +%s)
plugins=$(for p in plugins/gemzoo-*/; do printf -- '-e %s ' "${p%/}"; done)
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . $plugins > "$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log"; exit 1; }
echo "installed in $(( $(date +%s) - t0 )) s"
timeout_opt=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_S:-90}")
GEMZOO_TEST_LOG=$OUT timeout "${SUITE_S:-540}" python3 -m pytest -q -c pyproject.toml -p gemzoo.testing.eager_log \
  $timeout_opt -rfE "$@" > "$OUT/pytest.log" 2>&1
rc=$?
echo "pytest rc=$rc after $(( $(date +%s) - t0 )) s; $(grep -c ' passed ' "$OUT/progress.txt" 2>/dev/null) passed," \
     "$(grep -c ' failed ' "$OUT/progress.txt" 2>/dev/null) failed (progress.txt, failures.txt in $OUT)"
tail -15 "$OUT/pytest.log"
exit $rc
