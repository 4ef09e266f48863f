#!/usr/bin/env bash
# The test suite on a GPU machine, in one process, every test's outcome (and every failure with its captured
# output) written to the output folder the moment it is known, so a run that is cut off still says how far it got.
set -uo pipefail

usage() {
  cat <<'USAGE'
usage: bash bench/gpu_suite.sh --out DIR [--cache DIR] [--setup] [--offline] [--timeout S] [--test-timeout S]
                               [--python PY] [-- PYTEST_ARGS...]

Run pytest over core and plugin tests (or PYTEST_ARGS) from the checkout that holds this script.

  --out DIR          written as the run goes: progress.txt (one line a test: seconds since start, outcome,
                     phase, duration, node id), failures.txt (each failure's report and captured output),
                     pytest.log, and summary.txt (counts) at the end
  --cache DIR        before the run, restore Triton's compile cache from DIR (bench/triton_cache.py) and take a
                     prebuilt gemzoo/_C*.so from it; after the run, pack the cache back into DIR, so the next
                     run on the same GPU and software skips those compiles
  --setup            install first with bench/gpu_setup.sh (add --offline for an install without an index)
  --timeout S        stop the whole run after S seconds (default: no limit)
  --test-timeout S   per-test limit, a guard against hangs (default 300; needs pytest-timeout)
  --python PY        interpreter (default: $PYTHON or python3)
  -h, --help         this text

The extension's tests run when gemzoo._C loads (built by bench/gpu_setup.sh --extension or taken from
--cache); otherwise gemzoo runs without it (GEMZOO_NO_EXTENSION=1). The exit status is pytest's.
Examples:
  bash bench/gpu_suite.sh --out runs/suite --setup
  bash bench/gpu_suite.sh --out runs/suite-jfa --cache ~/gemzoo-cache -- plugins/gemzoo-jfa -x
USAGE
}

out_dir="" cache="" setup=0 offline=0 suite_s="" test_s=300 py=${PYTHON:-python3} pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out_dir=${2:?--out needs a folder}; shift ;;
    --cache) cache=${2:?--cache needs a folder}; shift ;;
    --setup) setup=1 ;;
    --offline) offline=1 ;;
    --timeout) suite_s=${2:?--timeout needs seconds}; shift ;;
    --test-timeout) test_s=${2:?--test-timeout needs seconds}; shift ;;
    --python) py=${2:?--python needs an interpreter}; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "gpu_suite.sh: unknown argument '$1' (pytest arguments go after --; see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out_dir" ] || { echo "gpu_suite.sh: --out DIR is required (see --help)" >&2; exit 2; }
mkdir -p "$out_dir" && out_dir=$(cd "$out_dir" && pwd)
[ -z "$cache" ] || { mkdir -p "$cache" && cache=$(cd "$cache" && pwd); }
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/.."
export PYTHONUNBUFFERED=1
# One Triton cache for the whole run: Inductor points TRITON_CACHE_DIR at its own folder the first time it
# compiles (when the variable is unset), and every Triton kernel compiled later in the process lands there,
# where a pack of Triton's default folder would miss it. Set it once here, and Inductor keeps it.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
t0=$(date +%s)

if [ "$setup" = 1 ]; then
  setup_args=(--python "$py" --log "$out_dir/install.log")
  [ "$offline" = 1 ] && setup_args+=(--offline)
  bash "$here/gpu_setup.sh" "${setup_args[@]}" || exit 1
fi
if [ -n "$cache" ]; then
  "$py" "$here/triton_cache.py" unpack "$cache"
  for so in "$cache"/_C.*.so; do
    if [ -f "$so" ] && ! compgen -G "gemzoo/_C.*.so" > /dev/null; then
      cp "$so" gemzoo/ && echo "gemzoo/$(basename "$so") taken from $cache"
    fi
  done
fi
if [ -z "${GEMZOO_NO_EXTENSION:-}" ]; then
  GEMZOO_NO_EXTENSION=1; compgen -G "gemzoo/_C.*.so" > /dev/null && GEMZOO_NO_EXTENSION=0
fi
export GEMZOO_NO_EXTENSION
"$py" -c "from gemzoo import ops; print('gemzoo._C loaded:', ops.extension_available())"

timeout_opt=()
"$py" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout="$test_s")
limit=()
[ -n "$suite_s" ] && limit=(timeout "$suite_s")
rm -f "$out_dir/progress.txt" "$out_dir/failures.txt"
GEMZOO_TEST_LOG=$out_dir "${limit[@]}" "$py" -m pytest -q -c pyproject.toml -p gemzoo.testing.eager_log \
  "${timeout_opt[@]}" -rfE "${pytest_args[@]}" > "$out_dir/pytest.log" 2>&1
rc=$?
count() { grep -c " $1 " "$out_dir/progress.txt" 2>/dev/null; }
summary="$(count passed) passed, $(count failed) failed, $(count skipped) skipped in $(( $(date +%s) - t0 )) s (pytest rc=$rc)"
echo "$summary" | tee "$out_dir/summary.txt"
[ -z "$cache" ] || "$py" "$here/triton_cache.py" pack "$cache" 2>&1 | tail -3
tail -15 "$out_dir/pytest.log"
exit $rc
