// Orthonormal fast Walsh-Hadamard transform over blocks of 16 or 32 along the last dim (CPU).
// forward: y = H diag(signs) x per block; inverse: x = diag(signs) H^T y (H is symmetric).
#include "hadamard/hadamard.h"

#include <cmath>

namespace gemzoo {
namespace {

template <typename scalar_t, typename acc_t, int BLOCK>
void fwht_blocks(const scalar_t* x, scalar_t* y, int64_t nblocks, const float* signs, bool inverse) {
  const acc_t norm = acc_t(1) / std::sqrt(acc_t(BLOCK));
  at::parallel_for(0, nblocks, 2048, [&](int64_t b0, int64_t b1) {
    acc_t buf[BLOCK];
    for (int64_t b = b0; b < b1; ++b) {
      const scalar_t* src = x + b * BLOCK;
      for (int i = 0; i < BLOCK; ++i) buf[i] = static_cast<acc_t>(src[i]);
      if (signs && !inverse)
        for (int i = 0; i < BLOCK; ++i) buf[i] *= signs[i];
      for (int h = 1; h < BLOCK; h <<= 1) {
        for (int i = 0; i < BLOCK; i += 2 * h) {
          for (int j = i; j < i + h; ++j) {
            const acc_t a = buf[j], c = buf[j + h];
            buf[j] = a + c;
            buf[j + h] = a - c;
          }
        }
      }
      scalar_t* dst = y + b * BLOCK;
      if (signs && inverse) {
        for (int i = 0; i < BLOCK; ++i) dst[i] = static_cast<scalar_t>(buf[i] * norm * signs[i]);
      } else {
        for (int i = 0; i < BLOCK; ++i) dst[i] = static_cast<scalar_t>(buf[i] * norm);
      }
    }
  });
}

at::Tensor hadamard_transform_cpu(const at::Tensor& x_in, int64_t block, const c10::optional<at::Tensor>& signs_in,
                                  bool inverse) {
  check_hadamard_args(x_in, block, signs_in);
  auto x = x_in.contiguous();
  auto y = at::empty_like(x);
  const int64_t nblocks = x.numel() / block;
  at::Tensor signs;
  if (signs_in.has_value()) signs = signs_in->contiguous();
  const float* s = signs.defined() ? signs.const_data_ptr<float>() : nullptr;
  if (nblocks == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "hadamard_transform", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    if (block == 16)
      fwht_blocks<scalar_t, acc_t, 16>(x.const_data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), nblocks, s, inverse);
    else
      fwht_blocks<scalar_t, acc_t, 32>(x.const_data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), nblocks, s, inverse);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gemzoo, CPU, m) { m.impl("hadamard_transform", &hadamard_transform_cpu); }

}  // namespace gemzoo
