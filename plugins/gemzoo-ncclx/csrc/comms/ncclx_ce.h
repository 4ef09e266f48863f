// gemzoo-ncclx copy-engine part: shared declarations of ncclx_ce.cpp and ncclx_reduce.cu.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace ncclx {

constexpr int kMaxRanks = 64;  // reduce-scatter reads at most this many chunks in one kernel

struct Sources {
  const void* p[kMaxRanks];
};

// out[i] = src[0][i] (op) src[1][i] (op) ... (op) src[n_src-1][i], rounded to the dtype after every step
// (the CPU path's order and arithmetic); AVG divides by `world` at the end. dtype codes follow
// gemzoo_ncclx.schedule.DTYPES (0 f32, 1 f64, 2 f16, 3 bf16, 4 i64, 5 i32, 6 i16, 7 i8, 8 u8); op codes follow
// schedule.REDUCE_CODES (0 sum, 1 product, 2 min, 3 max, 4 avg). `blocks` thread blocks: at most that many SMs.
// Returns false for a dtype/op it does not handle (the caller reduces another way).
bool launch_reduce(void* out, const Sources& src, int n_src, int64_t n, int dtype, int op, int world, int blocks,
                   cudaStream_t stream);

}  // namespace ncclx
