// Blocked fast Walsh-Hadamard transform: shared argument checks for the CPU and CUDA kernels.
#pragma once
#include "common.h"

namespace gemzoo {

inline void check_hadamard_args(const at::Tensor& x, int64_t block, const c10::optional<at::Tensor>& signs) {
  TORCH_CHECK(block == 16 || block == 32, "hadamard_transform block must be 16 or 32, got ", block);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % block == 0, "hadamard_transform needs the last dim to be a multiple of ",
              block, ", got shape ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "hadamard_transform needs a floating tensor, got ",
              x.scalar_type());
  if (signs.has_value()) {
    TORCH_CHECK(signs->dim() == 1 && signs->numel() == block, "signs must hold ", block, " values ±1, got shape ",
                signs->sizes());
    TORCH_CHECK(signs->scalar_type() == at::kFloat, "signs must be float32, got ", signs->scalar_type());
    TORCH_CHECK(signs->device() == x.device(), "signs is on ", signs->device(), " but x is on ", x.device());
  }
}

}  // namespace gemzoo
