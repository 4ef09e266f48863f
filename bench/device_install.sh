# Sourced by the device scripts (h200_suite.sh, h200_benches.sh, h200_extension.sh): install the core and every
# plugin from this checkout, editable, without network or build isolation. GEMZOO_NO_EXTENSION decides whether
# the C++ extension builds (1: no, about a minute saved).
#   install_checkout LOG || exit 1
# One Triton cache for the whole run: Inductor points TRITON_CACHE_DIR at its own folder the first time it compiles
# a kernel (when the variable is unset), and every Triton kernel compiled after that in the process (jfa's, mxfp8's)
# lands there, so bench/gpu_cache.py's pack of Triton's folder missed them (the 2026-12-02 suite packed the same
# 401 entries it had restored). Set once here, Inductor keeps it.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
install_checkout() {
  local plugins
  plugins=$(for p in plugins/gemzoo-*/; do printf -- '-e %s ' "${p%/}"; done)
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . $plugins > "$1" 2>&1 \
    || { tail -30 "$1"; return 1; }
}
