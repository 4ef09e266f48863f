// gemzoo-ncclx: reduce-scatter's reduction, the one step of its collectives that needs arithmetic.
//
// Grid-stride loops over at most `blocks` thread blocks (so at most that many SMs, whatever the size): a
// 16-byte-vector kernel where every pointer is aligned, a scalar one (four elements per thread per iteration)
// for the tail and unaligned chunks. Each element folds the chunks in the order given (the ring order of
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
__global__ void __launch_bounds__(512) reduce_kernel(T* __restrict__ out, Sources src, int n_src, int64_t n, int world) {
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

// The same fold on 16-byte vectors (16 / sizeof(T) elements), four per thread per iteration, every source's
// four vectors loaded before they are combined: enough bytes in flight that a few blocks keep up with NVLink.
// Used when every pointer is 16-byte aligned; the scalar kernel takes the tail and unaligned calls.
constexpr int kThreads = 512;  // per block, both kernels (__launch_bounds__: the register budget fits it)

template <typename T, int OP>
__global__ void __launch_bounds__(kThreads) reduce_vec_kernel(T* __restrict__ out, Sources src, int n_src, int64_t nvec, int world) {
  constexpr int V = 16 / sizeof(T);
  constexpr int U = 4;
  using R = Arith<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * U;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * U + threadIdx.x; base < nvec; base += stride) {
    uint4 acc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < nvec) acc[u] = static_cast<const uint4*>(src.p[0])[i];
    }
    for (int k = 1; k < n_src; ++k) {
      const uint4* s = static_cast<const uint4*>(src.p[k]);
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
        if (i < nvec) v[u] = s[i];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        T* a = reinterpret_cast<T*>(&acc[u]);
        const T* b = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
        for (int e = 0; e < V; ++e) a[e] = combine<T, OP>(a[e], b[e]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < nvec) {
        if (OP == 4) {
          T* a = reinterpret_cast<T*>(&acc[u]);
#pragma unroll
          for (int e = 0; e < V; ++e) a[e] = R::store(R::load(a[e]) / static_cast<typename R::A>(world));
        }
        reinterpret_cast<uint4*>(out)[i] = acc[u];
      }
    }
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int grid_for(int64_t items, int per_block, int blocks) {
  int64_t need = (items + per_block - 1) / per_block;
  return static_cast<int>(need < blocks ? (need > 0 ? need : 1) : blocks);
}

template <typename T, int OP>
void launch_typed(T* out, const Sources& src, int n_src, int64_t n, int world, int blocks, cudaStream_t st) {
  constexpr int V = 16 / sizeof(T);
  bool vec = aligned16(out);
  for (int k = 0; k < n_src; ++k) vec = vec && aligned16(src.p[k]);
  int64_t nvec = vec ? n / V : 0;
  if (nvec > 0) {
    reduce_vec_kernel<T, OP><<<grid_for(nvec, kThreads * 4, blocks), kThreads, 0, st>>>(out, src, n_src, nvec, world);
  }
  int64_t done = nvec * V;
  if (done < n) {  // the tail (fewer than V elements), or everything when a pointer is not 16-byte aligned
    Sources rest{};
    for (int k = 0; k < n_src; ++k) rest.p[k] = static_cast<const T*>(src.p[k]) + done;
    reduce_kernel<T, OP><<<grid_for(n - done, kThreads * 4, blocks), kThreads, 0, st>>>(out + done, rest, n_src,
                                                                                       n - done, world);
  }
}

template <typename T>
bool launch_op(void* out, const Sources& src, int n_src, int64_t n, int op, int world, int blocks, cudaStream_t st) {
  T* o = static_cast<T*>(out);
  switch (op) {
    case 0: launch_typed<T, 0>(o, src, n_src, n, world, blocks, st); return true;
    case 1: launch_typed<T, 1>(o, src, n_src, n, world, blocks, st); return true;
    case 2: launch_typed<T, 2>(o, src, n_src, n, world, blocks, st); return true;
    case 3: launch_typed<T, 3>(o, src, n_src, n, world, blocks, st); return true;
    case 4: launch_typed<T, 4>(o, src, n_src, n, world, blocks, st); return true;
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
