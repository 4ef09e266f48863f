// Fast Walsh-Hadamard transform on CUDA: one thread per element, butterflies through warp shuffles
// (a block of 16 or 32 lies inside one warp). Computed in fp32 (fp64 for double).
#include "hadamard/hadamard.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace gemzoo {
namespace {

template <typename scalar_t, typename acc_t, int BLOCK>
__global__ void fwht_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t numel,
                            const float* __restrict__ signs, bool inverse, acc_t norm) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = idx < numel;  // inactive tail lanes still take part in the shuffles
  const int lane = threadIdx.x & (BLOCK - 1);
  acc_t v = active ? static_cast<acc_t>(x[idx]) : acc_t(0);
  if (signs != nullptr && !inverse) v *= signs[lane];
#pragma unroll
  for (int h = 1; h < BLOCK; h <<= 1) {
    const acc_t other = __shfl_xor_sync(0xffffffffu, v, h, BLOCK);
    v = (lane & h) ? other - v : v + other;
  }
  v *= norm;
  if (signs != nullptr && inverse) v *= signs[lane];
  if (active) y[idx] = static_cast<scalar_t>(v);
}

at::Tensor hadamard_transform_cuda(const at::Tensor& x_in, int64_t block, const c10::optional<at::Tensor>& signs_in,
                                   bool inverse) {
  check_hadamard_args(x_in, block, signs_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous();
  auto y = at::empty_like(x);
  const int64_t numel = x.numel();
  if (numel == 0) return y;
  at::Tensor signs;
  if (signs_in.has_value()) signs = signs_in->contiguous();
  const float* s = signs.defined() ? signs.const_data_ptr<float>() : nullptr;
  const int threads = 256;
  const int64_t blocks = (numel + threads - 1) / threads;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "hadamard_transform: tensor too large for one launch");
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "hadamard_transform_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const acc_t norm = acc_t(1) / sqrt(acc_t(block));
    if (block == 16)
      fwht_kernel<scalar_t, acc_t, 16><<<blocks, threads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), numel, s, inverse, norm);
    else
      fwht_kernel<scalar_t, acc_t, 32><<<blocks, threads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), numel, s, inverse, norm);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gemzoo, CUDA, m) { m.impl("hadamard_transform", &hadamard_transform_cuda); }

}  // namespace gemzoo
