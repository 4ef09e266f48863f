#!/usr/bin/env bash
# One device call (about 560 s) of the benchmarks still to run on the H200, each written to $OUT as it goes:
#   the gdpa table in one run (issue 11), where act-quant's step time goes (issue 15), ncclx's overlap (issue 14).
#   bash bench/h200_benches.sh            # from the repository root on the device machine
set -o pipefail
export PYTHONUNBUFFERED=1 GEMZOO_NO_EXTENSION=1
OUT=${OUT:-/tmp/h200_benches}; mkdir -p "$OUT"
t0=$(date +%s)
plugins=$(for p in plugins/gemzoo-*/; do printf -- '-e %s ' "${p%/}"; done)
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . $plugins > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
echo "installed at $(( $(date +%s) - t0 )) s"
timeout 240 python3 plugins/gemzoo-gdpa/bench/bench_gdpa.py --out "$OUT" > "$OUT/gdpa.log" 2>&1
echo "gdpa rc=$? at $(( $(date +%s) - t0 )) s"; grep -v -e Warning -e create_block_mask "$OUT/gdpa.log" | tail -34
timeout 150 python3 plugins/gemzoo-act-quant/bench/profile_step.py --config configs/gem-bench.toml --steps 10 \
  --profile 3 --out "$OUT/act_quant_profile.json" > "$OUT/aq_profile.log" 2>&1
echo "act-quant profile rc=$? at $(( $(date +%s) - t0 )) s"; grep -E '^\{|^    ' "$OUT/aq_profile.log" | cut -c1-1200
left=$(( 560 - ($(date +%s) - t0) ))
timeout "$left" python3 plugins/gemzoo-ncclx/bench/bench_overlap.py --out "$OUT/ncclx_overlap.json" > "$OUT/ncclx.log" 2>&1
echo "ncclx rc=$? at $(( $(date +%s) - t0 )) s"; tail -24 "$OUT/ncclx.log"
