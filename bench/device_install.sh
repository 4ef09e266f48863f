# Sourced by the device scripts (h200_suite.sh, h200_benches.sh, h200_extension.sh): install the core and every
# plugin from this checkout, editable, without network or build isolation. GEMZOO_NO_EXTENSION decides whether
# the C++ extension builds (1: no, about a minute saved).
#   install_checkout LOG || exit 1
install_checkout() {
  local plugins
  plugins=$(for p in plugins/gemzoo-*/; do printf -- '-e %s ' "${p%/}"; done)
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . $plugins > "$1" 2>&1 \
    || { tail -30 "$1"; return 1; }
}
