// OCP MX casts on CPU, bit-exact with gemzoo.mx.quantize_mx_torch / dequantize_mx_torch.
// x is viewed as [outer, n, inner] with n the cast axis; each block covers `block` consecutive
// elements along n for one (outer, inner). Rowwise casts have inner == 1; columnwise ones inner > 1.
#include "common.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <vector>

namespace gemzoo {
namespace {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Biased e8m0 exponent of a block maximum (RCEIL), NaN -> 255.
inline int32_t mx_exponent(float amax, bool has_nan, float emax) {
  if (has_nan) return 255;
  const uint32_t bits = float_bits(amax / emax);
  int32_t e = static_cast<int32_t>((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0 ? 1 : 0);
  return std::min(std::max(e, 0), 254);
}

// 2^(e - 127) as fp32, exact (e = 0 is the subnormal 2^-127); NaN for 255.
inline float exponent_to_scale(int32_t e) {
  if (e == 255) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return bits_float(0x00400000u);
  return bits_float(static_cast<uint32_t>(e) << 23);
}

void view_dims(const at::Tensor& t, int64_t axis, int64_t& outer, int64_t& n, int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= t.size(d);
  for (int64_t d = axis + 1; d < t.dim(); ++d) inner *= t.size(d);
  n = t.size(axis);
}

template <typename scalar_t, typename elem_t>
void quantize_kernel(const scalar_t* x, elem_t* data, uint8_t* scale, int64_t outer, int64_t n, int64_t inner,
                     int64_t block, float emax) {
  const int64_t nb = (n + block - 1) / block;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  at::parallel_for(0, outer * nb, std::max<int64_t>(1, 4096 / (block * inner)), [&](int64_t u0, int64_t u1) {
    std::vector<float> amax(inner), inv(inner);
    std::vector<char> has_nan(inner);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t o = u / nb, b = u % nb;
      const int64_t r0 = b * block, r1 = std::min(n, r0 + block);
      const scalar_t* xb = x + (o * n) * inner;
      std::fill(amax.begin(), amax.end(), 0.0f);
      std::fill(has_nan.begin(), has_nan.end(), 0);
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = xb + r * inner;
        for (int64_t c = 0; c < inner; ++c) {
          const float a = std::fabs(static_cast<float>(row[c]));
          has_nan[c] |= std::isnan(a);
          amax[c] = a > amax[c] ? a : amax[c];
        }
      }
      uint8_t* srow = scale + (o * nb + b) * inner;
      for (int64_t c = 0; c < inner; ++c) {
        const int32_t e = mx_exponent(amax[c], has_nan[c], emax);
        srow[c] = static_cast<uint8_t>(e);
        inv[c] = e == 255 ? nan : exponent_to_scale(254 - e);  // 1/scale = 2^(127-e)
      }
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = xb + r * inner;
        elem_t* drow = data + (o * n + r) * inner;
        for (int64_t c = 0; c < inner; ++c)  // a NaN block gets the positive quiet NaN, whatever x's NaN sign
          drow[c] = has_nan[c] ? elem_t(nan) : elem_t(static_cast<float>(row[c]) * inv[c]);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_mx_cpu(const at::Tensor& x_in, int64_t axis, int64_t block,
                                                   at::ScalarType elem) {
  TORCH_CHECK(x_in.dim() >= 1, "quantize_mx needs at least one dimension");
  TORCH_CHECK(axis >= 0 && axis < x_in.dim(), "axis ", axis, " out of range for a ", x_in.dim(), "-D tensor");
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  TORCH_CHECK(elem == at::kFloat8_e4m3fn || elem == at::kFloat8_e5m2,
              "elem must be float8_e4m3fn or float8_e5m2, got ", elem);
  auto x = x_in.contiguous();
  int64_t outer, n, inner;
  view_dims(x, axis, outer, n, inner);
  const int64_t nb = (n + block - 1) / block;
  auto data = at::empty(x.sizes(), x.options().dtype(elem));
  auto sizes = x.sizes().vec();
  sizes[axis] = nb;
  auto scale = at::empty(sizes, x.options().dtype(at::kByte));
  const float emax = elem == at::kFloat8_e4m3fn ? 448.0f : 57344.0f;
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_mx", [&] {
      if (elem == at::kFloat8_e4m3fn) {
        quantize_kernel(x.const_data_ptr<scalar_t>(), static_cast<c10::Float8_e4m3fn*>(data.data_ptr()),
                        scale.data_ptr<uint8_t>(), outer, n, inner, block, emax);
      } else {
        quantize_kernel(x.const_data_ptr<scalar_t>(), static_cast<c10::Float8_e5m2*>(data.data_ptr()),
                        scale.data_ptr<uint8_t>(), outer, n, inner, block, emax);
      }
    });
  }
  return {data, scale.view(at::kFloat8_e8m0fnu)};
}

template <typename elem_t, typename out_t>
void dequantize_kernel(const elem_t* data, const uint8_t* scale, out_t* out, int64_t outer, int64_t n,
                       int64_t inner, int64_t block) {
  const int64_t nb = (n + block - 1) / block;
  at::parallel_for(0, outer * n, std::max<int64_t>(1, 4096 / inner), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r / n, i = r % n;
      const uint8_t* srow = scale + (o * nb + i / block) * inner;
      const elem_t* drow = data + r * inner;
      out_t* orow = out + r * inner;
      for (int64_t c = 0; c < inner; ++c)
        orow[c] = static_cast<out_t>(static_cast<float>(drow[c]) * exponent_to_scale(srow[c]));
    }
  });
}

at::Tensor dequantize_mx_cpu(const at::Tensor& data_in, const at::Tensor& scale_in, int64_t axis, int64_t block,
                             at::ScalarType dtype) {
  TORCH_CHECK(data_in.dim() >= 1, "dequantize_mx needs at least one dimension");
  TORCH_CHECK(axis >= 0 && axis < data_in.dim(), "axis ", axis, " out of range for a ", data_in.dim(),
              "-D tensor");
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  TORCH_CHECK(data_in.scalar_type() == at::kFloat8_e4m3fn || data_in.scalar_type() == at::kFloat8_e5m2,
              "data must be float8_e4m3fn or float8_e5m2, got ", data_in.scalar_type());
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat8_e8m0fnu, "scale must be float8_e8m0fnu, got ",
              scale_in.scalar_type());
  auto data = data_in.contiguous();
  auto scale = scale_in.contiguous().view(at::kByte);
  int64_t outer, n, inner;
  view_dims(data, axis, outer, n, inner);
  auto want = data.sizes().vec();
  want[axis] = (n + block - 1) / block;
  TORCH_CHECK(scale.sizes().vec() == want, "scale must have shape ", c10::IntArrayRef(want), ", got ",
              scale.sizes());
  auto out = at::empty(data.sizes(), data.options().dtype(dtype));
  if (data.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_mx", [&] {
    if (data.scalar_type() == at::kFloat8_e4m3fn) {
      dequantize_kernel(static_cast<const c10::Float8_e4m3fn*>(data.const_data_ptr()),
                        scale.const_data_ptr<uint8_t>(), out.data_ptr<scalar_t>(), outer, n, inner, block);
    } else {
      dequantize_kernel(static_cast<const c10::Float8_e5m2*>(data.const_data_ptr()),
                        scale.const_data_ptr<uint8_t>(), out.data_ptr<scalar_t>(), outer, n, inner, block);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gemzoo, CPU, m) {
  m.impl("quantize_mx", &quantize_mx_cpu);
  m.impl("dequantize_mx", &dequantize_mx_cpu);
}

}  // namespace gemzoo
