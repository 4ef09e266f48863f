#!/usr/bin/env bash
# The README's test command on a GPU machine (the device tool's H200), in one process: install core + every plugin
# from this checkout without network, then pytest with a per-test timeout, every outcome and failure written as
# it happens (gemzoo.testing.eager_log), so a run cut off by its time limit still says how far it got.
#   bash bench/h200_suite.sh                      # the whole suite, in this call
#   bash bench/h200_suite.sh plugins/ -x          # any pytest arguments instead
# The whole suite takes longer than one device call (600 s). A process that starts a new session outlives the
# call while the machine stays warm (the next call within its idle window), so one pytest process can span calls:
#   DETACH=1 bash bench/h200_suite.sh             # call 1: start pytest under setsid, wait up to WAIT_S, report
#   bash bench/h200_suite.sh --collect            # call 2, 3, ...: wait up to WAIT_S more; logs to $OUT when done
# Triton's compile cache can travel between sessions (bench/gpu_cache.py): a run packs it into $OUT when pytest is
# done (triton.tgz.NN); copy those to .bench/gpu-cache/, carry that folder, and set GPU_CACHE=<its path from here>
# for the next run, which unpacks it before pytest starts, so most kernel variants need no compile.
# The C++ extension: the install never builds it (a minute). bench/h200_extension.sh returns one built on this
# image (_C.cpython-*.so); put it in the GPU_CACHE folder too, and it is copied into gemzoo/ before pytest, which
# then runs the extension's tests as well. Without one (or with GEMZOO_NO_EXTENSION=1) pytest runs without it.
# Env: OUT (default /tmp/h200_suite), SUITE_S (overall pytest limit; default 540, or 1700 detached),
#      TEST_S (per test, default 300: a hang, not a slow test on the 16-core host), WAIT_S (how long a detached call waits, default 540).
set -o pipefail
export PYTHONUNBUFFERED=1
TEST_NO_EXTENSION=${GEMZOO_NO_EXTENSION:-auto}
export GEMZOO_NO_EXTENSION=1  # for the install; pytest gets TEST_NO_EXTENSION
OUT=${OUT:-/tmp/h200_suite}; mkdir -p "$OUT"
RUN=/tmp/gemzoo_h200_suite  # a detached run's logs: $OUT is emptied before every device call
HERE=$(cd "$(dirname "$0")" && pwd)
t0=$(date +%s)

report() {  # $1: the log folder
  echo "$(grep -c ' passed ' "$1/progress.txt" 2>/dev/null) passed, $(grep -c ' failed ' "$1/progress.txt" 2>/dev/null)" \
       "failed, $(grep -c ' skipped ' "$1/progress.txt" 2>/dev/null) skipped so far; last: $(tail -1 "$1/progress.txt" 2>/dev/null)"
}

wait_detached() {
  local deadline=$(( $(date +%s) + ${WAIT_S:-540} ))
  while [ ! -f "$RUN/rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  cp "$RUN"/*.txt "$RUN"/*.log "$OUT"/ 2>/dev/null
  if [ -f "$RUN/rc" ]; then
    python3 "$HERE/gpu_cache.py" pack "$OUT" 2>&1 | tail -3
    echo "pytest finished: rc=$(cat "$RUN/rc") after $(cat "$RUN/wall_s") s in one process"; report "$RUN"
    tail -15 "$RUN/pytest.log"; exit "$(cat "$RUN/rc")"
  fi
  echo "pytest still running (pid $(cat "$RUN/pid")); $(report "$RUN")"
  echo "call again within the machine's idle window: bash bench/h200_suite.sh --collect"
  exit 0
}

if [ "${1:-}" = "--collect" ]; then
  [ -f "$RUN/pid" ] || { echo "no detached run on this machine (it went back, or DETACH=1 never ran here)"; exit 1; }
  wait_detached
fi

# shellcheck source=bench/device_install.sh
source "$HERE/device_install.sh"; install_checkout "$OUT/install.log" || exit 1
echo "installed in $(( $(date +%s) - t0 )) s"
if [ -n "${GPU_CACHE:-}" ]; then
  python3 "$HERE/gpu_cache.py" unpack "$GPU_CACHE"
  for so in "$GPU_CACHE"/_C.*.so; do [ -f "$so" ] && cp "$so" gemzoo/ && echo "gemzoo/$(basename "$so") from $GPU_CACHE"; done
fi
if [ "$TEST_NO_EXTENSION" = auto ]; then
  TEST_NO_EXTENSION=1; compgen -G "gemzoo/_C.*.so" > /dev/null && TEST_NO_EXTENSION=0
fi
timeout_opt=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_S:-300}")
export GEMZOO_NO_EXTENSION=$TEST_NO_EXTENSION
python3 -c "from gemzoo import ops; print('gemzoo._C loaded:', ops.extension_available())"

if [ -n "${DETACH:-}" ]; then
  rm -rf "$RUN"; mkdir -p "$RUN"
  # shellcheck disable=SC2086
  setsid bash -c 'start=$(date +%s); GEMZOO_TEST_LOG="$0" timeout "$1" python3 -m pytest -q -c pyproject.toml \
      -p gemzoo.testing.eager_log $2 -rfE "${@:3}" > "$0/pytest.log" 2>&1; rc=$?; \
      echo $(( $(date +%s) - start )) > "$0/wall_s"; echo $rc > "$0/rc"' \
    "$RUN" "${SUITE_S:-1700}" "$timeout_opt" "$@" < /dev/null > /dev/null 2>&1 &
  echo $! > "$RUN/pid"
  echo "pytest started detached (pid $!), logs in $RUN"
  wait_detached
fi

GEMZOO_TEST_LOG=$OUT timeout "${SUITE_S:-540}" python3 -m pytest -q -c pyproject.toml -p gemzoo.testing.eager_log \
  $timeout_opt -rfE "$@" > "$OUT/pytest.log" 2>&1
rc=$?
python3 "$HERE/gpu_cache.py" pack "$OUT" 2>&1 | tail -3
echo "pytest rc=$rc after $(( $(date +%s) - t0 )) s; $(report "$OUT") (progress.txt, failures.txt in $OUT)"
tail -15 "$OUT/pytest.log"
exit $rc
