// Shared helpers for gemzoo._C kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace gemzoo {

inline void check_offsets(const at::Tensor& offsets, const char* name) {
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 1, name, " must be 1-D with B+1 >= 1 elements, got shape ",
              offsets.sizes());
  TORCH_CHECK(offsets.scalar_type() == at::kLong, name, " must be int64, got ", offsets.scalar_type(),
              "; convert with .long()");
  TORCH_CHECK(offsets.device().is_cpu(), name, " must be on the CPU for the CPU kernel, got ", offsets.device());
}

// Floor division for a possibly negative numerator and positive divisor.
inline int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

}  // namespace gemzoo
