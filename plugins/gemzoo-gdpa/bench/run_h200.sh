#!/usr/bin/env bash
# One device call: install, the bench, then the GPU tests; in parallel on the CPU cores (GPU hidden) the CPU and
# interpreter tests. Logs and JSON go to $OUT. On the H200: bash plugins/gemzoo-gdpa/bench/run_h200.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gdpa_out}; mkdir -p "$OUT"
GEMZOO_NO_EXTENSION=1 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  -e plugins/gemzoo-jfa -e plugins/gemzoo-gdpa > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
(CUDA_VISIBLE_DEVICES= timeout "${CPU_TESTS_S:-400}" python3 -m pytest -q -m "not gpu" plugins/gemzoo-gdpa \
  plugins/gemzoo-jfa tests/test_attention_conformance.py > "$OUT/pytest_cpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_cpu.log") &
cpu=$!
timeout "${BENCH_S:-290}" python3 plugins/gemzoo-gdpa/bench/bench_gdpa.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench.log" | tail -45
timeout "${GPU_TESTS_S:-170}" python3 -m pytest -q -m gpu plugins/gemzoo-gdpa plugins/gemzoo-jfa \
  2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
wait $cpu
tail -6 "$OUT/pytest_cpu.log"
