// gemzoo-ncclx: reduce-scatter's reduction, the one step of its collectives that needs arithmetic.
//
// A grid-stride loop over `blocks` thread blocks (so it occupies at most that many SMs, whatever the size),
// four elements per thread per iteration. Each element folds the chunks in the order given (the ring order of
// gemzoo_ncclx.schedule.ring_order), rounding to the storage dtype after every step like the CPU path does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ncclx_ce.h"

namespace ncclx {
namespace {

template <typename T> struct Arith {  // integers and fp32/fp64: the type itself
  using A = T;
  __device__ static A load(const T& v) { return v; }
  __device__ static T store(A v) { return v; }
  __device__ static bool isnan(A) { return false; }
};
template <> struct Arith<float> {
  using A = float;
  __device__ static A load(const float& v) { return v; }
  __device__ static float store(A v) { return v; }
  __device__ static bool isnan(A v) { return v != v; }
};
template <> struct Arith<double> {
  using A = double;
  __device__ static A load(const double& v) { return v; }
  __device__ static double store(A v) { return v; }
  __device__ static bool isnan(A v) { return v != v; }
};
template <> struct Arith<__half> {
  using A = float;
  __device__ static A load(const __half& v) { return __half2float(v); }
  __device__ static __half store(A v) { return __float2half_rn(v); }
  __device__ static bool isnan(A v) { return v != v; }
};
template <> struct Arith<__nv_bfloat16> {
  using A = float;
  __device__ static A load(const __nv_bfloat16& v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(A v) { return __float2bfloat16_rn(v); }
  __device__ static bool isnan(A v) { return v != v; }
};

template <typename T, int OP>
__device__ __forceinline__ T combine(T a, T b) {
  using R = Arith<T>;
  auto x = R::load(a), y = R::load(b);
  if (OP == 0 || OP == 4) return R::store(x + y);
  if (OP == 1) return R::store(x * y);
  if (R::isnan(x) || R::isnan(y)) return R::store(R::isnan(x) ? x : y);  // torch.minimum/maximum keep NaN
  if (OP == 2) return R::store(y < x ? y : x);
  return R::store(y > x ? y : x);
}

template <typename T, int OP>
__global__ void reduce_kernel(T* __restrict__ out, Sources src, int n_src, int64_t n, int world) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * 4;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x) * 4 + threadIdx.x; base < n; base += stride) {
    T acc[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < n) acc[u] = static_cast<const T*>(src.p[0])[i];
    }
    for (int k = 1; k < n_src; ++k) {
      const T* s = static_cast<const T*>(src.p[k]);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
        if (i < n) acc[u] = combine<T, OP>(acc[u], s[i]);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < n) {
        if (OP == 4) {
          using R = Arith<T>;
          acc[u] = R::store(R::load(acc[u]) / static_cast<typename R::A>(world));
        }
        out[i] = acc[u];
      }
    }
  }
}

template <typename T>
bool launch_op(void* out, const Sources& src, int n_src, int64_t n, int op, int world, int blocks, cudaStream_t st) {
  const int threads = 512;
  int64_t need = (n + threads * 4 - 1) / (threads * 4);
  int grid = static_cast<int>(need < blocks ? (need > 0 ? need : 1) : blocks);
  T* o = static_cast<T*>(out);
  switch (op) {
    case 0: reduce_kernel<T, 0><<<grid, threads, 0, st>>>(o, src, n_src, n, world); return true;
    case 1: reduce_kernel<T, 1><<<grid, threads, 0, st>>>(o, src, n_src, n, world); return true;
    case 2: reduce_kernel<T, 2><<<grid, threads, 0, st>>>(o, src, n_src, n, world); return true;
    case 3: reduce_kernel<T, 3><<<grid, threads, 0, st>>>(o, src, n_src, n, world); return true;
    case 4: reduce_kernel<T, 4><<<grid, threads, 0, st>>>(o, src, n_src, n, world); return true;
    default: return false;
  }
}

}  // namespace

bool launch_reduce(void* out, const Sources& src, int n_src, int64_t n, int dtype, int op, int world, int blocks,
                   cudaStream_t stream) {
  if (n <= 0) return true;
  if (blocks < 1) blocks = 1;
  switch (dtype) {
    case 0: return launch_op<float>(out, src, n_src, n, op, world, blocks, stream);
    case 1: return launch_op<double>(out, src, n_src, n, op, world, blocks, stream);
    case 2: return launch_op<__half>(out, src, n_src, n, op, world, blocks, stream);
    case 3: return launch_op<__nv_bfloat16>(out, src, n_src, n, op, world, blocks, stream);
    case 4: return op == 4 ? false : launch_op<int64_t>(out, src, n_src, n, op, world, blocks, stream);
    case 5: return op == 4 ? false : launch_op<int32_t>(out, src, n_src, n, op, world, blocks, stream);
    case 6: return op == 4 ? false : launch_op<int16_t>(out, src, n_src, n, op, world, blocks, stream);
    case 7: return op == 4 ? false : launch_op<int8_t>(out, src, n_src, n, op, world, blocks, stream);
    case 8: return op == 4 ? false : launch_op<uint8_t>(out, src, n_src, n, op, world, blocks, stream);
    default: return false;
  }
}

}  // namespace ncclx
