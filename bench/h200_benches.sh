#!/usr/bin/env bash
# The benchmarks still to run on the H200, each written to $OUT as it goes, in order of need. A step starts only
# while time is left (LIMIT_S); ONLY="name ..." runs just those steps. GPU_CACHE=<folder> unpacks a Triton cache
# first (bench/gpu_cache.py, as h200_suite.sh does); PACK=1 packs this machine's Triton cache into $OUT at the end.
#   gpu_tests   the GPU tests of the jfa kernel family (jfa, gdpa, block-attention), which share the launchers,
#               and the sync-free step's (SparseAdagrad; launch_step under torch's sync debug mode: issue 17)
#   jfa         bench_jfa.py: gem_lognormal, uniform_8k and short against Flex, FA varlen, NJT and padded SDPA,
#               and the fused-dQ and length-bucket sweeps (issue 17)
#   profile     a compiled jfa,bf16 gem-bench step under torch.profiler: kernel groups, and where the GPU waits
#               (gemzoo.profiling.gpu_idle); the chrome trace comes back gzipped (issue 17)
#   e2e         the README's end-to-end table: gemzoo ablate configs/ablations/gem-bench.toml (compiled since
#               2026-12-02), every row in this one step (issue 17)
#   bucket_tests, mxfp8_tests: the family's GPU tests with length buckets on; mxfp8's tests (fp8-rowwise's cast)
#   short_sweep the short workload against FA varlen / Flex, and its bucket tiles swept (SHORT_S seconds)
#   host        where the ~1 ms of host time per attention call goes: torch.profiler and cProfile over the
#               block-attention and gdpa cross64 cases (issues 11 follow-up, 17)
#   shuffle     batch-shuffle's per-step overhead, 45 steps, with each step's wait for its prefetched batch (16)
#   shuffle8k_d1, shuffle8k_d2: the same at 8192 ranks, one step ahead and two (overlap_depth = 2, two workers)
#   gdpa, cross50, ncclx, memory, aq_profile: the runs of 2026-12-02 (issues 11, 14, 15), kept for reruns
#   LIMIT_S=560 bash bench/h200_benches.sh                   # from the repository root on the device machine
#   ONLY="host shuffle" LIMIT_S=300 bash bench/h200_benches.sh
set -o pipefail
export PYTHONUNBUFFERED=1 GEMZOO_NO_EXTENSION=1
OUT=${OUT:-/tmp/h200_benches}; mkdir -p "$OUT"
LOGS=/tmp/h200_bench_logs; rm -rf "$LOGS"; mkdir -p "$LOGS"  # one logs.tgz in $OUT: the device tool returns 8 files
t0=$(date +%s)
left() { echo $(( ${LIMIT_S:-560} - ($(date +%s) - t0) )); }
step() {  # step NAME MAX_S CMD...: runs CMD under min(MAX_S, time left) if at least 40 s are left
  local name=$1 max=$2; shift 2; local l; l=$(left)
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  [ "$l" -lt 40 ] && { echo "$name skipped: ${l} s left"; return; }
  [ "$l" -lt "$max" ] && max=$l
  timeout "$max" "$@" > "$LOGS/$name.log" 2>&1; echo "$name rc=$? at $(( $(date +%s) - t0 )) s"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}
# shellcheck source=bench/device_install.sh
source "$(dirname "$0")/device_install.sh"; install_checkout "$LOGS/install.log" || exit 1
echo "installed at $(( $(date +%s) - t0 )) s"
[ -n "${GPU_CACHE:-}" ] && python3 "$(dirname "$0")/gpu_cache.py" unpack "$GPU_CACHE"
# the GPU tests spend most of their time compiling Triton kernels on the CPU: spread them over pytest-xdist's
# workers (in the image) when it is there, all on the one GPU
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${XDIST_N:-8}")
# shellcheck disable=SC2086
step gpu_tests 420 python3 -m pytest -q -c pyproject.toml -rfE $XDIST plugins/gemzoo-jfa/tests/test_gpu.py \
  plugins/gemzoo-gdpa/tests/test_gpu.py plugins/gemzoo-block-attention/tests/test_gpu.py \
  tests/test_sparse_adagrad.py "tests/test_trainer.py::test_a_gem_step_queues_on_cuda_without_a_host_sync"
tail -8 "$LOGS/gpu_tests.log" 2>/dev/null
# the same GPU tests with the length buckets on by default (GEMZOO_JFA_BUCKETS=1): every short test batch of
# jfa, gdpa, block attention and RoPE runs its bucketed launches (issue 17); and mxfp8's GPU tests (fp8-rowwise)
# shellcheck disable=SC2086
GEMZOO_JFA_BUCKETS=1 step bucket_tests 420 python3 -m pytest -q -c pyproject.toml -rfE $XDIST \
  plugins/gemzoo-jfa/tests/test_gpu.py plugins/gemzoo-gdpa/tests/test_gpu.py plugins/gemzoo-block-attention/tests/test_gpu.py
tail -8 "$LOGS/bucket_tests.log" 2>/dev/null
# shellcheck disable=SC2086
step mxfp8_tests 240 python3 -m pytest -q -c pyproject.toml -rfE $XDIST plugins/gemzoo-mxfp8/tests
tail -8 "$LOGS/mxfp8_tests.log" 2>/dev/null
# the short workload alone against FA varlen and Flex, and the short bucket's tile sweep (bench_jfa.py sweep_short)
step short_sweep ${SHORT_S:-430} python3 plugins/gemzoo-jfa/bench/bench_jfa.py --workloads short --checks 1 \
  --methods jfa,jfa_nobuckets,fa_varlen,flex --sweep short --budget $(( ${SHORT_S:-430} - 20 )) --out "$LOGS"
cp "$LOGS/bench_jfa.json" "$OUT/bench_jfa_short.json" 2>/dev/null
grep -v -e Warning -e create_block_mask "$LOGS/short_sweep.log" 2>/dev/null | grep -e "short" -e check | tail -90 | cut -c1-260
step jfa 260 python3 plugins/gemzoo-jfa/bench/bench_jfa.py --sweep "${JFA_SWEEP-fused_dq}" --checks 2 \
  --budget 230 --methods "${JFA_METHODS:-jfa,jfa_nobuckets,flex,fa_varlen,njt_sdpa,padded_sdpa}" --out "$LOGS"
cp "$LOGS/bench_jfa.json" "$OUT/" 2>/dev/null
grep -v -e Warning -e create_block_mask "$LOGS/jfa.log" 2>/dev/null | tail -40
step profile 150 python3 plugins/gemzoo-act-quant/bench/profile_step.py --config configs/gem-bench.toml \
  --sets "jfa,bf16" --steps 8 --profile 2 --out "$OUT/step_profile.json" --trace "$OUT"
grep -E '^\{|^gpu idle|^    ' "$LOGS/profile.log" 2>/dev/null | cut -c1-1500
rm -rf /tmp/e2e; step e2e 560 gemzoo ablate configs/ablations/gem-bench.toml --out /tmp/e2e
for f in ablation.json report.md; do cp "/tmp/e2e/$f" "$OUT/e2e_$f" 2>/dev/null; done; tail -14 "$LOGS/e2e.log" 2>/dev/null
step host 120 python3 plugins/gemzoo-block-attention/bench/profile_host.py --cprofile 25 --out "$OUT"
grep -E "^==|^ +[0-9]" "$LOGS/host.log" 2>/dev/null | head -120 | cut -c1-200
step shuffle 170 python3 plugins/gemzoo-batch-shuffle/bench/overhead.py --config configs/gem-bench.toml \
  --plugins jfa,bf16 --steps 45 --warmup 5 --worlds 8,64,512 --workers process --budget-s 140 --set run.compile=false \
  --out "$OUT/overhead.json"  # eager, as the earlier runs
grep -E "CPUs|median step|assign alone|overlapped" "$LOGS/shuffle.log" 2>/dev/null | cut -c1-300
for depth in 1 2; do
  step "shuffle8k_d$depth" 150 python3 plugins/gemzoo-batch-shuffle/bench/overhead.py --config configs/gem-bench.toml \
    --plugins jfa,bf16 --steps 25 --warmup 5 --worlds 8192 --workers process --depth $depth --budget-s 120 \
    --set run.compile=false --out "$OUT/overhead_8192_d$depth.json"
  grep -E "median step|assign alone|overlapped" "$LOGS/shuffle8k_d$depth.log" 2>/dev/null | cut -c1-300
done
step gdpa 240 python3 plugins/gemzoo-gdpa/bench/bench_gdpa.py --out "$LOGS"
cp "$LOGS/bench_gdpa.json" "$OUT/" 2>/dev/null
grep -v -e Warning -e create_block_mask "$LOGS/gdpa.log" 2>/dev/null | tail -34
step cross50 100 gemzoo ablate configs/ablations/gem-bench.toml --runs "gdpa cross silu" --steps 50 \
  --warmup 10 --out /tmp/cross50
cp /tmp/cross50/ablation.json "$OUT/cross50.json" 2>/dev/null; tail -5 "$LOGS/cross50.log" 2>/dev/null
step ncclx 100 python3 plugins/gemzoo-ncclx/bench/bench_overlap.py --out "$OUT/ncclx_overlap.json"
tail -24 "$LOGS/ncclx.log" 2>/dev/null
step memory 200 python3 plugins/gemzoo-auto-ac/bench/bench_memory.py --steps 50 --warmup 10 \
  --rows bf16,act-quant,target,combo --budget-s $(( $(left) - 45 )) --json "$OUT/bench_memory.json"
tail -12 "$LOGS/memory.log" 2>/dev/null
step aq_profile 150 python3 plugins/gemzoo-act-quant/bench/profile_step.py --config configs/gem-bench.toml --steps 10 \
  --profile 3 --out "$OUT/act_quant_profile.json"
grep -E '^\{|^    ' "$LOGS/aq_profile.log" 2>/dev/null | cut -c1-1200
if [ -n "${PACK:-}" ]; then python3 "$(dirname "$0")/gpu_cache.py" pack "$OUT" 2>&1 | tail -3; fi
