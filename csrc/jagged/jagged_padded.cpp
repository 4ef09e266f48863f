// Jagged <-> padded-dense conversions on CPU (dtype-agnostic row copies). Autograd: gemzoo/ops.py.
#include "common.h"

namespace gemzoo {
namespace {

int64_t row_bytes(const at::Tensor& t, int64_t skip_dims) {
  int64_t n = t.element_size();
  for (int64_t d = skip_dims; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

at::Tensor jagged_to_padded_cpu(const at::Tensor& values_in, const at::Tensor& offsets_in, int64_t max_len,
                                double pad) {
  check_offsets(offsets_in, "offsets");
  TORCH_CHECK(values_in.dim() >= 1, "values must be [T, ...], got a scalar");
  TORCH_CHECK(max_len >= 0, "max_len must be >= 0, got ", max_len);
  auto values = values_in.contiguous();
  auto offsets = offsets_in.contiguous();
  const int64_t batch = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[batch] == values.size(0), "offsets[-1]=", off[batch], " must equal values.shape[0]=",
              values.size(0));
  std::vector<int64_t> shape{batch, max_len};
  for (int64_t d = 1; d < values.dim(); ++d) shape.push_back(values.size(d));
  auto out = at::full(shape, pad, values.options());
  const int64_t rb = row_bytes(values, 1);
  const char* src = static_cast<const char*>(values.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      TORCH_CHECK(off[b + 1] >= off[b], "offsets must be non-decreasing at index ", b + 1);
      const int64_t len = std::min(off[b + 1] - off[b], max_len);
      if (len > 0) std::memcpy(dst + b * max_len * rb, src + off[b] * rb, len * rb);
    }
  });
  return out;
}

at::Tensor padded_to_jagged_cpu(const at::Tensor& padded_in, const at::Tensor& offsets_in, int64_t total) {
  check_offsets(offsets_in, "offsets");
  TORCH_CHECK(padded_in.dim() >= 2, "padded must be [B, L, ...], got shape ", padded_in.sizes());
  auto padded = padded_in.contiguous();
  auto offsets = offsets_in.contiguous();
  const int64_t batch = offsets.numel() - 1;
  TORCH_CHECK(padded.size(0) == batch, "padded has ", padded.size(0), " sequences but offsets has ", batch);
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[batch] == total, "offsets[-1]=", off[batch], " must equal total=", total);
  const int64_t max_len = padded.size(1);
  std::vector<int64_t> shape{total};
  for (int64_t d = 2; d < padded.dim(); ++d) shape.push_back(padded.size(d));
  auto out = at::empty(shape, padded.options());
  const int64_t rb = row_bytes(padded, 2);
  const char* src = static_cast<const char*>(padded.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t len = off[b + 1] - off[b];
      TORCH_CHECK(len >= 0, "offsets must be non-decreasing at index ", b + 1);
      const int64_t kept = std::min(len, max_len);
      if (kept > 0) std::memcpy(dst + off[b] * rb, src + b * max_len * rb, kept * rb);
      // rows past L read as zero: the adjoint of jagged_to_padded's truncation
      if (len > kept) std::memset(dst + (off[b] + kept) * rb, 0, (len - kept) * rb);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gemzoo, CPU, m) {
  m.impl("jagged_to_padded", &jagged_to_padded_cpu);
  m.impl("padded_to_jagged", &padded_to_jagged_cpu);
}

}  // namespace gemzoo
