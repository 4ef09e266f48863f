#!/usr/bin/env bash
# Install gemzoo and every plugin under plugins/ into the current Python, editable, on a machine that already
# has torch (with CUDA) and triton. The C++ extension is not built unless asked (it takes about a minute, and
# every code path has a torch fallback).
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: bash bench/gpu_setup.sh [--offline] [--extension] [--cache DIR] [--log FILE] [--python PY]

Install gemzoo (this checkout) and every plugin under plugins/ into PY (default: python3), editable, with
no build isolation, so the torch and triton already installed are the ones used.

  --offline      no package index: install without dependencies (--no-deps --no-index); everything gemzoo
                 needs (torch, triton, pluggy, safetensors, rich, numpy; pytest for the suite) must be there
  --extension    also build the gemzoo._C C++/CUDA extension (csrc/), then import it to check it loads
  --cache DIR    with --extension: copy the built library (gemzoo/_C*.so) into DIR, where
                 bench/gpu_suite.sh --cache DIR finds it on a machine with the same image
  --log FILE     pip's output goes here (default: a temporary file, shown when pip fails)
  --python PY    the interpreter to install into (default: $PYTHON or python3)
  -h, --help     this text

Run from anywhere; it works on the checkout that holds this script. Examples:
  bash bench/gpu_setup.sh
  bash bench/gpu_setup.sh --offline --extension --cache ~/gemzoo-cache
USAGE
}

offline=0 extension=0 cache="" log="" py=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) offline=1 ;;
    --extension) extension=1 ;;
    --cache) cache=${2:?--cache needs a folder}; shift ;;
    --log) log=${2:?--log needs a file}; shift ;;
    --python) py=${2:?--python needs an interpreter}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_setup.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$cache" ] && [ "$extension" = 0 ]; then
  echo "gpu_setup.sh: --cache keeps the built extension, so it needs --extension" >&2; exit 2
fi

cd "$(dirname "$0")/.."
"$py" -c "import torch" 2>/dev/null || { echo "gpu_setup.sh: $py cannot import torch; install torch first" >&2; exit 1; }
[ -n "$log" ] || log=$(mktemp -t gemzoo-setup.XXXXXX)
plugins=()
for p in plugins/gemzoo-*/; do [ -f "$p/pyproject.toml" ] && plugins+=(-e "${p%/}"); done
flags=(-q --disable-pip-version-check --no-build-isolation)
[ "$offline" = 1 ] && flags+=(--no-deps --no-index)
if [ "$extension" = 1 ]; then
  export GEMZOO_NO_EXTENSION=0 MAX_JOBS=${MAX_JOBS:-$(nproc)}
else
  export GEMZOO_NO_EXTENSION=1
fi
t0=$(date +%s)
if ! "$py" -m pip install "${flags[@]}" -e . "${plugins[@]}" > "$log" 2>&1; then
  tail -30 "$log"; echo "gpu_setup.sh: pip failed (full log: $log)" >&2; exit 1
fi
echo "installed gemzoo and ${#plugins[@]} plugin(s) in $(( $(date +%s) - t0 )) s (pip log: $log)"
if [ "$extension" = 1 ]; then
  GEMZOO_NO_EXTENSION=0 "$py" -c "from gemzoo import ops; assert ops.extension_available(), 'gemzoo._C did not load'; print(ops.extension_info())"
  if [ -n "$cache" ]; then
    mkdir -p "$cache" && cp gemzoo/_C*.so "$cache"/ && echo "extension library copied to $cache"
  fi
fi
