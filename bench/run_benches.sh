#!/usr/bin/env bash
# Every plugin's benchmark and the end-to-end ablation on one CUDA machine, each result written into the output
# folder as soon as its benchmark finishes. docs/benchmarks.md lists what each one measures and its last figures.
set -uo pipefail

STEPS=(jfa jfa-short jfa-d256 jfa-gqa jfa-fp8 gdpa relative-bias block-attention host mxfp8 auto-ac act-quant
       step-profile gem-bench-300 fp8-gem1b batch-shuffle ncclx sharding-2d e2e)

usage() {
  cat <<'USAGE'
usage: bash bench/run_benches.sh --out DIR [--cache DIR] [--only a,b] [--step-timeout S] [--python PY] [--list]

Run the benchmarks from the checkout that holds this script (gemzoo and the plugins installed, e.g. by
bench/gpu_setup.sh), one after another, each under a time limit. Results (JSON) go into DIR as each step
ends; each step's output goes to DIR/logs/NAME.log, and DIR/steps.txt gets one line a step (name, exit
status, seconds).

  --out DIR          output folder (made if missing)
  --cache DIR        restore Triton's compile cache from DIR first and pack it back there at the end
                     (bench/triton_cache.py), so a machine with the same GPU and software skips the compiles
  --only a,b         run only these steps (names below), in the order listed here
  --step-timeout S   limit of each step in seconds (default 1800)
  --python PY        interpreter (default: $PYTHON or python3)
  --list             print the steps and exit
  -h, --help         this text

Steps:
  jfa             jagged flash attention against Flex, FA varlen, NJT SDPA and padded SDPA (gem-lognormal,
                  uniform-8k, short histories), and the fused-dQ sweep          -> jfa/bench_jfa.json
  jfa-short       the short-history workload alone with its length-bucket tile sweep -> jfa-short/bench_jfa.json
  jfa-d256        head_dim 256 on gem_lognormal against Flex and FA varlen       -> jfa/bench_jfa_d256.json
  jfa-gqa         grouped-query attention, 32 q over 8 k/v heads, gem_lognormal  -> jfa/bench_jfa_gqa.json
  jfa-fp8         jfa's fp8 forward (QK, QKV) against bf16, gem_lognormal        -> jfa-fp8/bench_jfa.json
  gdpa            GDPA activations, cross attention (also as CUDA-graph replays), short histories -> gdpa/bench_gdpa.json
  relative-bias   HSTU's relative bias fused in gdpa against the materialised bias -> gdpa/bench_relative_bias.json
  block-attention block-sparse attention against Flex (also as CUDA-graph replays), fused RoPE -> block-attention/*.json
  host            host time of one attention call (torch.profiler and cProfile)  -> host/
  mxfp8           MX casts, MX GEMM and the MXFP8 / fp8-rowwise MLP              -> mxfp8/bench_out/
  auto-ac         gem-bench compiled under the memory plugins (auto-ac, full-ac, act-quant) -> auto-ac.json
  act-quant       gem-bench step profile with and without act-quant              -> act-quant.json
  step-profile    where a compiled jfa,bf16 gem-bench step's time goes (kernels, GPU idle) -> step-profile.json
  gem-bench-300   gem-bench jfa,bf16 compiled, 300 steps after 30: mean wall-clock MFU, slowest step, compiles
                  after warm-up                                                  -> gem-bench-300/metrics.jsonl
  fp8-gem1b       gem-1b (1.16e9 dense parameters) compiled under bf16, fp8-rowwise, fp8-tensorwise and mxfp8:
                  samples/s, MFU, loss against bf16, GEMM against cast time -> fp8-gem1b/fp8_gem1b.json, .md
  batch-shuffle   base-batch-shuffle's per-step overhead, simulated 8 / 64 / 512 and 8192 ranks -> batch-shuffle*.json
  ncclx           GEMM slowdown beside copy-engine and SM copies, and the 2-process check -> ncclx.json
  sharding-2d     gemzoo plan for gem-bench at 8 to 8192 ranks (no GPU needed)   -> sharding-2d/plan-W.json
  e2e             gemzoo ablate configs/ablations/gem-bench.toml (every plugin set compiled) -> e2e/

Examples:
  bash bench/run_benches.sh --out runs/benches
  bash bench/run_benches.sh --out runs/benches --only jfa,e2e --cache ~/gemzoo-cache
USAGE
}

out_dir="" cache="" only="" step_s=1800 py=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out_dir=${2:?--out needs a folder}; shift ;;
    --cache) cache=${2:?--cache needs a folder}; shift ;;
    --only) only=${2:?--only needs step names}; shift ;;
    --step-timeout) step_s=${2:?--step-timeout needs seconds}; shift ;;
    --python) py=${2:?--python needs an interpreter}; shift ;;
    --list) printf '%s\n' "${STEPS[@]}"; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "run_benches.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out_dir" ] || { echo "run_benches.sh: --out DIR is required (see --help)" >&2; exit 2; }
for name in ${only//,/ }; do
  [[ " ${STEPS[*]} " == *" $name "* ]] || {
    echo "run_benches.sh: unknown step '$name' in --only; the steps are: ${STEPS[*]}" >&2; exit 2; }
done
mkdir -p "$out_dir/logs" && out_dir=$(cd "$out_dir" && pwd)
[ -z "$cache" ] || { mkdir -p "$cache" && cache=$(cd "$cache" && pwd); }
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/.."
export PYTHONUNBUFFERED=1 GEMZOO_NO_EXTENSION=${GEMZOO_NO_EXTENSION:-1}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}  # one cache for Triton and Inductor alike
[ -z "$cache" ] || "$py" "$here/triton_cache.py" unpack "$cache"
root=$PWD
t0=$(date +%s)
failed=0

wanted() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }
step() {  # step NAME CMD...: run CMD under the step limit, its output in logs/NAME.log
  local name=$1; shift
  wanted "$name" || return 0
  local s0; s0=$(date +%s)
  echo "== $name"
  timeout "$step_s" "$@" > "$out_dir/logs/$name.log" 2>&1
  local rc=$?
  [ "$rc" = 0 ] || failed=$((failed + 1))
  echo "$name rc=$rc $(( $(date +%s) - s0 )) s" | tee -a "$out_dir/steps.txt"
  tail -5 "$out_dir/logs/$name.log"
}

step jfa "$py" plugins/gemzoo-jfa/bench/bench_jfa.py --sweep fused_dq --checks 2 --out "$out_dir/jfa"
step jfa-short "$py" plugins/gemzoo-jfa/bench/bench_jfa.py --workloads short --checks 1 \
  --methods jfa,jfa_nobuckets,fa_varlen,flex --sweep short --out "$out_dir/jfa-short"
step jfa-d256 "$py" plugins/gemzoo-jfa/bench/bench_jfa.py --checks 1 --head-dim 256 --workloads gem_lognormal \
  --methods jfa,flex,fa_varlen --out "$out_dir/jfa"
step jfa-gqa "$py" plugins/gemzoo-jfa/bench/bench_jfa.py --checks 1 --gqa 32,8 --workloads gem_lognormal \
  --methods jfa,flex,fa_varlen --out "$out_dir/jfa"
step jfa-fp8 "$py" plugins/gemzoo-jfa/bench/bench_jfa.py --checks 1 --fp8 --workloads gem_lognormal --methods jfa \
  --out "$out_dir/jfa-fp8"
step gdpa "$py" plugins/gemzoo-gdpa/bench/bench_gdpa.py --graphs --out "$out_dir/gdpa"
step relative-bias "$py" plugins/gemzoo-gdpa/bench/bench_relative_bias.py "$out_dir/gdpa"
step block-attention "$py" plugins/gemzoo-block-attention/bench/bench_block_attention.py --graphs --out "$out_dir/block-attention"
step host "$py" plugins/gemzoo-block-attention/bench/profile_host.py --cprofile 25 --out "$out_dir/host"
# bench_mxfp8.py writes into bench_out/ under its working folder
step mxfp8 bash -c 'mkdir -p "$1" && cd "$1" && exec "$2" "$3"' _ "$out_dir/mxfp8" "$py" "$root/plugins/gemzoo-mxfp8/bench/bench_mxfp8.py"
step auto-ac "$py" plugins/gemzoo-auto-ac/bench/bench_memory.py --steps 50 --warmup 10 --json "$out_dir/auto-ac.json"
step act-quant "$py" plugins/gemzoo-act-quant/bench/profile_step.py --config configs/gem-bench.toml --steps 10 \
  --profile 3 --out "$out_dir/act-quant.json"
step step-profile "$py" plugins/gemzoo-act-quant/bench/profile_step.py --config configs/gem-bench.toml \
  --sets "jfa,bf16" --steps 8 --profile 2 --out "$out_dir/step-profile.json" --trace "$out_dir"
step gem-bench-300 "$py" -m gemzoo.cli train --config configs/gem-bench.toml --plugins jfa,bf16 --steps 330 \
  --set run.warmup=30 --set checkpoint.every=0 --overwrite --out "$out_dir/gem-bench-300"
# 115 steps a row (~2 s each on an H200, estimated) and no row started after 25 min: within the step limit
step fp8-gem1b "$py" bench/fp8_gem1b.py --out "$out_dir/fp8-gem1b" --steps 100 --warmup 15 --budget-s 1500
step batch-shuffle bash -c '
  "$1" plugins/gemzoo-batch-shuffle/bench/overhead.py --config configs/gem-bench.toml --plugins jfa,bf16 \
    --steps 45 --warmup 5 --worlds 8,64,512 --workers process --set run.compile=false --out "$2/batch-shuffle.json" &&
  for depth in 1 2; do
    "$1" plugins/gemzoo-batch-shuffle/bench/overhead.py --config configs/gem-bench.toml --plugins jfa,bf16 \
      --steps 25 --warmup 5 --worlds 8192 --workers process --depth $depth --set run.compile=false \
      --out "$2/batch-shuffle-8192-d$depth.json" || exit 1
  done' _ "$py" "$out_dir"
step ncclx "$py" plugins/gemzoo-ncclx/bench/bench_overlap.py --out "$out_dir/ncclx.json"
step sharding-2d bash -c '
  mkdir -p "$2/sharding-2d"
  for wg in 8:8 64:8 1024:64 8192:64; do
    "$1" -m gemzoo.cli plan --config configs/gem-bench.toml --world "${wg%:*}" --group "${wg#*:}" --json \
      > "$2/sharding-2d/plan-${wg%:*}.json" || exit 1
  done' _ "$py" "$out_dir"
step e2e "$py" -m gemzoo.cli ablate configs/ablations/gem-bench.toml --out "$out_dir/e2e"

[ -z "$cache" ] || "$py" "$here/triton_cache.py" pack "$cache" 2>&1 | tail -3
echo "done in $(( $(date +%s) - t0 )) s; $failed step(s) failed (see $out_dir/steps.txt and $out_dir/logs/)"
[ "$failed" = 0 ]
