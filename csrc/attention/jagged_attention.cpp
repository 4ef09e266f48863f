// CPU jagged attention, forward and backward, with the full semantics of docs/attention.md:
// softmax / silu / gelu / gelu_tanh / relu / relu2 / leaky_relu / hardswish / identity (÷ norm), causal
// bottom-right, window, block, Lq != Lk, and the fused relative bias (RelativeAttentionBias: a position
// table and an optional log-time-bucket table, looked up per (i, j) inside the tiles; their gradients are
// summed per worker thread and reduced at the end, with no shared atomics).
//
// Grouped-query / multi-query attention: k and v may have Hkv heads, Hkv dividing q's H; query head h reads
// k/v head h / G (G = H / Hkv). The forward's work items are per query head; the backward's are per
// (sequence, k/v head) and loop over the G query heads of the group, so dK/dV of a group are summed in one
// work item, without atomics.
//
// FlashAttention-style blocking: each work item is (sequence, head[, query tile]); it walks tiles of
// BQ queries x BK keys, skipping tiles with no allowed pair, with tile matmuls in BLAS (MKL's sgemm
// from libtorch when present, plain loops otherwise) and an online softmax. Only the logsumexp
// [H, Tq] is saved for backward; scratch is per thread and O(BQ x BK), never B x Lmax^2.
// Work items are sorted by cost and handed out dynamically, so skewed lengths balance across threads.
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

// MKL's Fortran sgemm, exported by libtorch_cpu on x86 builds. Weak: absent (or GEMZOO_NO_BLAS=1 set)
// -> portable loops.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace gemzoo {
namespace {

constexpr int64_t BQ = 64;
constexpr int64_t BK = 64;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

enum Activation { SOFTMAX = 0, SILU = 1, GELU = 2, RELU = 3, IDENTITY = 4, GELU_TANH = 5, RELU2 = 6, LEAKY_RELU = 7,
                  HARDSWISH = 8 };
constexpr int64_t LAST_ACTIVATION = HARDSWISH;

// Row-major C[M,N] = alpha * op(A) op(B) + beta * C, op = transpose when the flag is set.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  static const bool use_blas = sgemm_ != nullptr && std::getenv("GEMZOO_NO_BLAS") == nullptr;
  if (use_blas) {
    // row-major C = op(A) op(B)  <=>  column-major C^T = op(B)^T op(A)^T
    const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
    const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
    sgemm_(&tB, &tA, &m, &n, &k, &alpha, B, &lb, A, &la, &beta, C, &lc);
    return;
  }
  for (int64_t i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    if (beta == 0.0f)
      std::fill(c, c + N, 0.0f);
    else if (beta != 1.0f)
      for (int64_t j = 0; j < N; ++j) c[j] *= beta;
    for (int64_t p = 0; p < K; ++p) {
      const float a = alpha * (ta ? A[p * lda + i] : A[i * lda + p]);
      if (a == 0.0f) continue;
      if (!tb) {
        const float* b = B + p * ldb;
        for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
      } else {
        for (int64_t j = 0; j < N; ++j) c[j] += a * B[j * ldb + p];
      }
    }
  }
}

// exp with ~2 ulp error, branch-free so loops over it vectorize; exp(-inf) and tiny inputs give 0.
__attribute__((always_inline)) inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float t = xc * 1.44269504088896341f + 12582912.0f;  // round(x / ln2) via the 1.5 * 2^23 trick
  const float n = t - 12582912.0f;
  float f = xc - n * 0.693359375f;
  f = f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

struct Params {
  bool causal;
  int64_t act;
  float scale;
  float inv_norm;
  int64_t window;  // <= 0: off
  int64_t block;   // <= 0: off
  int64_t H, D, Dv;
  int64_t Hkv, G;  // k/v heads and query heads per k/v head (Hkv = H, G = 1 without grouping)
};

struct Seq {
  int64_t qs, lq, ks, lk;
  int64_t shift() const { return lk - lq; }
};

// The relative bias of gemzoo.interfaces.attention.RelativeAttentionBias for query row i (shifted
// position ii = i + Lk - Lq) and key j of one sequence:
//   pos[clamp(ii - j, 0, P - 1)] + time[clamp(trunc(log(float(max(|qt[i] - kt[j]|, 1))) / divisor), 0, NB)]
// The log is taken in float32, as the contract (and HSTU's reference) takes it. Off when pos is null.
struct RelBias {
  const float* pos = nullptr;
  int64_t P = 0;
  const float* time = nullptr;  // null: positions only
  int64_t NB = 0;               // the last time bucket
  const int64_t* qt = nullptr;  // [Tq] timestamps
  const int64_t* kt = nullptr;  // [Tk]
  float divisor = 1.0f;
  bool on() const { return pos != nullptr; }
  int64_t pos_index(int64_t ii, int64_t j) const { return std::min(std::max(ii - j, int64_t(0)), P - 1); }
  int64_t bucket(int64_t qrow, int64_t krow) const {
    const int64_t d = qt[qrow] - kt[krow];
    const int64_t gap = std::max(d < 0 ? -d : d, int64_t(1));
    const float x = std::min(std::log(static_cast<float>(gap)) / divisor, static_cast<float>(NB));
    return std::max(static_cast<int64_t>(x), int64_t(0));  // trunc: x >= 0
  }
};

// Adds the bias to columns [a, b) of one tile row: query row qrow (global) at shifted position ii, keys
// j0 + c at global rows krow0 + c. ``buckets`` (optional) receives each column's time bucket for backward.
inline void add_bias_row(const RelBias& rb, float* row, int64_t a, int64_t b, int64_t ii, int64_t j0,
                         int64_t qrow, int64_t krow0, int32_t* buckets) {
  for (int64_t c = a; c < b; ++c) {
    float x = rb.pos[rb.pos_index(ii, j0 + c)];
    if (rb.time != nullptr) {
      const int64_t t = rb.bucket(qrow, krow0 + c);
      x += rb.time[t];
      if (buckets != nullptr) buckets[c] = static_cast<int32_t>(t);
    }
    row[c] += x;
  }
}

// Accumulates dS over columns [a, b) of one tile row into this worker's partial sums of the tables'
// gradients (dpos [P], then dtime [NB + 1]); ``buckets`` are the row's time buckets from add_bias_row.
inline void bias_grad_row(const RelBias& rb, const float* grow, int64_t a, int64_t b, int64_t ii, int64_t j0,
                          const int32_t* buckets, double* dpos, double* dtime) {
  for (int64_t c = a; c < b; ++c) {
    const double g = grow[c];
    dpos[rb.pos_index(ii, j0 + c)] += g;
    if (rb.time != nullptr) dtime[buckets[c]] += g;
  }
}

// The bias tables and timestamps as fp32 / int64 contiguous tensors (kept alive by the caller) and the view
// the loops read. Shapes and dtypes are checked again here: the op may be called without the Python checks.
struct RelBiasInputs {
  at::Tensor pos, time, qt, kt;
  RelBias view;
};

RelBiasInputs rel_bias_inputs(const c10::optional<at::Tensor>& pos, const c10::optional<at::Tensor>& time,
                              const c10::optional<at::Tensor>& q_times, const c10::optional<at::Tensor>& k_times,
                              double divisor, int64_t tq, int64_t tk) {
  RelBiasInputs in;
  const bool timed = time.has_value() && time->defined();
  if (!pos.has_value() || !pos->defined()) {
    TORCH_CHECK(!timed, "relative bias time weights were given without position weights");
    return in;
  }
  for (const auto* t : {&*pos, timed ? &*time : &*pos}) {
    TORCH_CHECK(t->dim() == 1 && t->numel() >= 1 && t->is_floating_point() && t->device().is_cpu(),
                "relative bias tables must be non-empty floating 1-D CPU tensors, got ", t->sizes());
  }
  in.pos = pos->to(at::kFloat).contiguous();
  in.view.pos = in.pos.const_data_ptr<float>();
  in.view.P = in.pos.numel();
  if (timed) {
    TORCH_CHECK(q_times.has_value() && k_times.has_value() && q_times->defined() && k_times->defined(),
                "relative bias time weights need q_times and k_times");
    TORCH_CHECK(q_times->scalar_type() == at::kLong && q_times->sizes() == at::IntArrayRef({tq}) &&
                    k_times->scalar_type() == at::kLong && k_times->sizes() == at::IntArrayRef({tk}),
                "q_times and k_times must be int64 [Tq] and [Tk]");
    TORCH_CHECK(divisor > 0.0 && std::isfinite(divisor), "bucket_divisor must be finite and > 0, got ", divisor);
    in.time = time->to(at::kFloat).contiguous();
    in.qt = q_times->contiguous();
    in.kt = k_times->contiguous();
    in.view.time = in.time.const_data_ptr<float>();
    in.view.NB = in.time.numel() - 1;
    in.view.qt = in.qt.const_data_ptr<int64_t>();
    in.view.kt = in.kt.const_data_ptr<int64_t>();
    in.view.divisor = static_cast<float>(divisor);
  }
  return in;
}

// Keys [lo, hi) that some query in [i0, i1) may see.
inline void key_range(const Seq& s, int64_t i0, int64_t i1, const Params& p, int64_t& lo, int64_t& hi) {
  const int64_t a = i0 + s.shift(), b = i1 - 1 + s.shift();
  lo = 0;
  hi = s.lk;
  if (p.causal) hi = std::min(hi, b + 1);
  if (p.window > 0) lo = std::max(lo, a - p.window + 1);
  if (p.block > 0) {
    lo = std::max(lo, floordiv(a, p.block) * p.block);
    hi = std::min(hi, (floordiv(b, p.block) + 1) * p.block);
  }
}

// Queries [lo, hi) that may see some key in [j0, j1).
inline void query_range(const Seq& s, int64_t j0, int64_t j1, const Params& p, int64_t& lo, int64_t& hi) {
  const int64_t sh = s.shift();
  lo = 0;
  hi = s.lq;
  if (p.causal) lo = std::max(lo, j0 - sh);
  if (p.window > 0) hi = std::min(hi, j1 - 1 + p.window - sh);
  if (p.block > 0) {
    lo = std::max(lo, (j0 / p.block) * p.block - sh);
    hi = std::min(hi, ((j1 - 1) / p.block + 1) * p.block - sh);
  }
  hi = std::max(hi, lo);
}

// Allowed keys of query row ii form one interval (each rule bounds j on one or both sides); clipped
// to the tile [j0, j0 + cols) and returned in tile-local columns [a, b).
inline void row_interval(int64_t ii, int64_t j0, int64_t cols, const Params& p, int64_t& a, int64_t& b) {
  int64_t lo = j0, hi = j0 + cols;
  if (p.causal) hi = std::min(hi, ii + 1);
  if (p.window > 0) lo = std::max(lo, ii - p.window + 1);
  if (p.block > 0) {
    const int64_t qb = floordiv(ii, p.block);
    lo = std::max(lo, qb * p.block);
    hi = std::min(hi, (qb + 1) * p.block);
  }
  a = std::min(lo - j0, cols);  // lo >= j0
  b = std::min(std::max(hi, lo) - j0, cols);
}

// Pointwise activations and their derivatives (gelu is the exact erf form, as torch's default).
inline float act_fwd(float x, int64_t act) {
  switch (act) {
    case SILU: return x / (1.0f + fast_exp(-x));
    case GELU: return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
    case RELU: return x > 0.0f ? x : 0.0f;
    case GELU_TANH: {
      const float t = std::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x));
      return 0.5f * x * (1.0f + t);
    }
    case RELU2: return x > 0.0f ? x * x : 0.0f;
    case LEAKY_RELU: return x > 0.0f ? x : 0.01f * x;
    case HARDSWISH: return x * std::min(std::max(x + 3.0f, 0.0f), 6.0f) * (1.0f / 6.0f);
    default: return x;
  }
}
inline float act_grad(float x, int64_t act) {
  switch (act) {
    case SILU: {
      const float sg = 1.0f / (1.0f + fast_exp(-x));
      return sg * (1.0f + x * (1.0f - sg));
    }
    case GELU:
      return 0.5f * (1.0f + std::erf(x * 0.70710678118654752f)) +
             x * 0.39894228040143268f * std::exp(-0.5f * x * x);
    case RELU: return x > 0.0f ? 1.0f : 0.0f;
    case GELU_TANH: {
      const float t = std::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x));
      return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.79788456080286536f * (1.0f + 0.134145f * x * x);
    }
    case RELU2: return x > 0.0f ? 2.0f * x : 0.0f;
    case LEAKY_RELU: return x > 0.0f ? 1.0f : 0.01f;
    case HARDSWISH: return x < -3.0f ? 0.0f : (x <= 3.0f ? x * (1.0f / 3.0f) + 0.5f : 1.0f);
    default: return 1.0f;
  }
}

// The per-element loops, cloned for AVX-512 / AVX2 and picked at load time by CPU features (the GEMMs
// are MKL's).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define GEMZOO_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GEMZOO_SIMD_CLONES
#endif

// Softmax rows run over the whole BK-wide scratch row with lanes outside [a, b) masked: fixed trip
// counts vectorize without scalar tails, and masked lanes (which may hold stale values) never reach
// the arithmetic. Max and sum keep LANES independent accumulators (no float reassociation needed).
constexpr int LANES = 16;
static_assert(BK % LANES == 0, "BK must be a multiple of LANES");

// Online-softmax update of one row: the row becomes P (0 outside [a, b)), m (running max) is updated,
// alpha receives the rescale factor for earlier tiles; returns sum(P).
GEMZOO_SIMD_CLONES
float softmax_row(float* __restrict__ row, int64_t a, int64_t b, float* __restrict__ m, float* __restrict__ alpha) {
  const float m_old = *m;
  float acc[LANES];
  for (int l = 0; l < LANES; ++l) acc[l] = m_old;
  for (int64_t c = 0; c < BK; c += LANES)
    for (int l = 0; l < LANES; ++l) {
      const float v = (c + l >= a && c + l < b) ? row[c + l] : NEG_INF;
      acc[l] = acc[l] > v ? acc[l] : v;
    }
  float mx = acc[0];
  for (int l = 1; l < LANES; ++l) mx = mx > acc[l] ? mx : acc[l];
  *alpha = 1.0f;
  if (mx == NEG_INF) {  // nothing allowed so far in this row
    for (int64_t c = 0; c < BK; ++c) row[c] = 0.0f;
    return 0.0f;
  }
  for (int l = 0; l < LANES; ++l) acc[l] = 0.0f;
  for (int64_t c = 0; c < BK; c += LANES)
    for (int l = 0; l < LANES; ++l) {
      const float x = (c + l >= a && c + l < b) ? row[c + l] - mx : NEG_INF;
      const float e = fast_exp(x);  // exactly 0 for masked lanes
      row[c + l] = e;
      acc[l] += e;
    }
  *alpha = fast_exp(m_old - mx);
  *m = mx;
  float sum = 0.0f;
  for (int l = 0; l < LANES; ++l) sum += acc[l];
  return sum;
}

// Backward: P = exp(S - lse) on [a, b), 0 elsewhere (whole BK-wide row).
GEMZOO_SIMD_CLONES
void softmax_probs_row(const float* __restrict__ srow, float* __restrict__ prow, int64_t a, int64_t b, float lse) {
  if (lse == NEG_INF) a = b = 0;  // a row without keys
  for (int64_t c = 0; c < BK; ++c) prow[c] = fast_exp((c >= a && c < b) ? srow[c] - lse : NEG_INF);
}

// Backward: dS = P * (dP - delta), in place of dP (whole BK-wide row; P is 0 outside [a, b)).
GEMZOO_SIMD_CLONES
void softmax_grad_row(const float* __restrict__ prow, float* __restrict__ grow, float delta) {
  for (int64_t c = 0; c < BK; ++c) grow[c] = prow[c] * (grow[c] - delta);
}

// Pointwise: P = act(S) / norm on [a, b), 0 elsewhere, over the whole BK-wide row (srow may equal
// prow). One masked fixed-width loop per activation, so each vectorizes without scalar tails.
GEMZOO_SIMD_CLONES
void act_row(const float* srow, float* prow, int64_t a, int64_t b, int64_t act, float inv_norm) {
  switch (act) {
    case SILU:
      for (int64_t c = 0; c < BK; ++c) {
        const float x = (c >= a && c < b) ? srow[c] : 0.0f;
        prow[c] = x / (1.0f + fast_exp(-x)) * inv_norm;
      }
      break;
    case GELU:
      for (int64_t c = 0; c < BK; ++c) prow[c] = (c >= a && c < b) ? act_fwd(srow[c], GELU) * inv_norm : 0.0f;
      break;
    case RELU:
      for (int64_t c = 0; c < BK; ++c) {
        const float x = (c >= a && c < b) ? srow[c] : 0.0f;
        prow[c] = (x > 0.0f ? x : 0.0f) * inv_norm;
      }
      break;
    case GELU_TANH:
    case RELU2:
    case LEAKY_RELU:
    case HARDSWISH:
      for (int64_t c = 0; c < BK; ++c) prow[c] = (c >= a && c < b) ? act_fwd(srow[c], act) * inv_norm : 0.0f;
      break;
    default:
      for (int64_t c = 0; c < BK; ++c) prow[c] = ((c >= a && c < b) ? srow[c] : 0.0f) * inv_norm;
  }
}

// Pointwise backward: dS = dP * act'(S) / norm on [a, b), 0 elsewhere, in place of dP (BK-wide row).
GEMZOO_SIMD_CLONES
void act_grad_row(const float* srow, float* grow, int64_t a, int64_t b, int64_t act, float inv_norm) {
  switch (act) {
    case SILU:
      for (int64_t c = 0; c < BK; ++c) {
        const float x = (c >= a && c < b) ? srow[c] : 0.0f;
        const float sg = 1.0f / (1.0f + fast_exp(-x));
        const float g = (c >= a && c < b) ? grow[c] : 0.0f;
        grow[c] = g * (sg * (1.0f + x * (1.0f - sg)) * inv_norm);
      }
      break;
    case GELU:
      for (int64_t c = 0; c < BK; ++c)
        grow[c] = (c >= a && c < b) ? grow[c] * act_grad(srow[c], GELU) * inv_norm : 0.0f;
      break;
    case RELU:
      for (int64_t c = 0; c < BK; ++c) grow[c] = (c >= a && c < b && srow[c] > 0.0f) ? grow[c] * inv_norm : 0.0f;
      break;
    case GELU_TANH:
    case RELU2:
    case LEAKY_RELU:
    case HARDSWISH:
      for (int64_t c = 0; c < BK; ++c)
        grow[c] = (c >= a && c < b) ? grow[c] * act_grad(srow[c], act) * inv_norm : 0.0f;
      break;
    default:
      for (int64_t c = 0; c < BK; ++c) grow[c] = (c >= a && c < b) ? grow[c] * inv_norm : 0.0f;
  }
}

// Run work(item) over items (sorted by decreasing cost) with dynamic hand-out across threads. MKL
// (GNU OpenMP threading) runs the tile GEMMs sequentially inside this parallel region.
// work(item, slot): slot, in [0, item_workers(n)), is unique among the calls running at once (for per-worker
// partial sums).
inline int64_t item_workers(int64_t n) { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)); }

template <typename F>
void run_items(int64_t n, const F& work) {
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = item_workers(n);
  at::parallel_for(0, threads, 1, [&](int64_t slot, int64_t) {
    for (int64_t it = next.fetch_add(1); it < n; it = next.fetch_add(1)) work(it, slot);
  });
}

std::vector<Seq> sequences(const at::Tensor& q_offsets, const at::Tensor& k_offsets, int64_t tq, int64_t tk) {
  check_offsets(q_offsets, "q_offsets");
  check_offsets(k_offsets, "k_offsets");
  TORCH_CHECK(q_offsets.numel() == k_offsets.numel(), "q_offsets has ", q_offsets.numel() - 1,
              " sequences but k_offsets has ", k_offsets.numel() - 1);
  auto qo = q_offsets.contiguous(), ko = k_offsets.contiguous();
  const int64_t* a = qo.const_data_ptr<int64_t>();
  const int64_t* b = ko.const_data_ptr<int64_t>();
  const int64_t n = qo.numel() - 1;
  TORCH_CHECK(a[0] == 0 && a[n] == tq, "q_offsets must start at 0 and end at Tq=", tq);
  TORCH_CHECK(b[0] == 0 && b[n] == tk, "k_offsets must start at 0 and end at Tk=", tk);
  std::vector<Seq> out(n);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(a[i + 1] >= a[i] && b[i + 1] >= b[i], "offsets must be non-decreasing at index ", i + 1);
    out[i] = {a[i], a[i + 1] - a[i], b[i], b[i + 1] - b[i]};
  }
  return out;
}

Params make_params(const at::Tensor& q, const at::Tensor& v, bool causal, int64_t act, double scale, double norm,
                   int64_t window, int64_t block) {
  TORCH_CHECK(act >= SOFTMAX && act <= LAST_ACTIVATION, "activation code must be 0..", LAST_ACTIVATION, ", got ", act);
  TORCH_CHECK(norm != 0.0, "norm must be non-zero");
  return {causal, act, static_cast<float>(scale), static_cast<float>(1.0 / norm), window, block,
          q.size(1), q.size(2), v.size(2), v.size(1), v.size(1) > 0 ? q.size(1) / v.size(1) : 1};
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, H, D]");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1), "k and v must agree on [Tk, H]");
  TORCH_CHECK(q.size(2) == k.size(2), "q and k must agree on D");
  TORCH_CHECK(k.size(1) == q.size(1) || (k.size(1) > 0 && k.size(1) < q.size(1) && q.size(1) % k.size(1) == 0),
              "k/v have ", k.size(1), " heads and q ", q.size(1), ": they need as many heads as q, or (grouped-query "
              "attention) a divisor of that count");
  for (const auto* t : {&q, &k, &v}) {
    const auto dt = t->scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                "the cpu attention kernel takes float32, bfloat16 or float16, got ", dt);
  }
}

struct Item {
  int64_t seq, head, i0, i1;
  double cost;
};

std::tuple<at::Tensor, at::Tensor> jagged_attention_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                            const at::Tensor& v_in, const at::Tensor& q_offsets,
                                                            const at::Tensor& k_offsets, bool causal, int64_t act,
                                                            double scale, double norm, int64_t window,
                                                            int64_t block, const c10::optional<at::Tensor>& rel_pos,
                                                            const c10::optional<at::Tensor>& rel_time,
                                                            const c10::optional<at::Tensor>& q_times,
                                                            const c10::optional<at::Tensor>& k_times,
                                                            double bucket_divisor) {
  check_qkv(q_in, k_in, v_in);
  const auto rel = rel_bias_inputs(rel_pos, rel_time, q_times, k_times, bucket_divisor, q_in.size(0), k_in.size(0));
  const RelBias& bias = rel.view;
  const auto seqs = sequences(q_offsets, k_offsets, q_in.size(0), k_in.size(0));
  const Params p = make_params(q_in, v_in, causal, act, scale, norm, window, block);
  const auto q = q_in.to(at::kFloat).contiguous(), k = k_in.to(at::kFloat).contiguous(),
             v = v_in.to(at::kFloat).contiguous();
  const int64_t tq = q.size(0), H = p.H, D = p.D, Dv = p.Dv;
  auto out = at::zeros({tq, H, Dv}, q.options());
  auto lse = at::full({H, tq}, act == SOFTMAX ? NEG_INF : 0.0f, q.options());

  std::vector<Item> items;
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    const Seq& s = seqs[b];
    for (int64_t i0 = 0; i0 < s.lq; i0 += BQ) {
      const int64_t i1 = std::min(s.lq, i0 + BQ);
      int64_t lo, hi;
      key_range(s, i0, i1, p, lo, hi);
      if (hi <= lo) continue;
      for (int64_t h = 0; h < H; ++h) items.push_back({b, h, i0, i1, double(i1 - i0) * double(hi - lo)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t ldq = H * D, ldv = H * Dv, ldk = p.Hkv * D, ldkv = p.Hkv * Dv;

  run_items(static_cast<int64_t>(items.size()), [&](int64_t it, int64_t) {
    thread_local std::vector<float> S;
    S.resize(BQ * BK);
    float m_run[BQ], l_run[BQ];
    bool any_key[BQ];  // the row has an allowed key: rows without one output exactly 0, NaN or not
    const Item& w = items[it];
    const Seq& s = seqs[w.seq];
    const int64_t rows = w.i1 - w.i0, h = w.head, hk = h / p.G;
    const float* Q = qp + (s.qs + w.i0) * ldq + h * D;
    float* O = op + (s.qs + w.i0) * ldv + h * Dv;
    int64_t lo, hi;
    key_range(s, w.i0, w.i1, p, lo, hi);
    std::fill(m_run, m_run + rows, NEG_INF);
    std::fill(l_run, l_run + rows, 0.0f);
    std::fill(any_key, any_key + rows, false);
    for (int64_t j0 = lo; j0 < hi; j0 += BK) {
      const int64_t cols = std::min(hi, j0 + BK) - j0;
      const float* K = kp + (s.ks + j0) * ldk + hk * D;
      const float* V = vp + (s.ks + j0) * ldkv + hk * Dv;
      gemm(false, true, rows, cols, D, p.scale, Q, ldq, K, ldk, 0.0f, S.data(), BK);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = S.data() + r * BK;
        int64_t a, b;
        row_interval(w.i0 + r + s.shift(), j0, cols, p, a, b);
        any_key[r] = any_key[r] || b > a;
        if (bias.on()) add_bias_row(bias, row, a, b, w.i0 + r + s.shift(), j0, s.qs + w.i0 + r, s.ks + j0, nullptr);
        if (p.act == SOFTMAX) {
          float alpha;
          const float sum = softmax_row(row, a, b, &m_run[r], &alpha);
          if (alpha != 1.0f) {
            float* o = O + r * ldv;
            for (int64_t c = 0; c < Dv; ++c) o[c] *= alpha;
          }
          l_run[r] = l_run[r] * alpha + sum;
        } else {
          act_row(row, row, a, b, p.act, p.inv_norm);
        }
      }
      gemm(false, false, rows, Dv, cols, 1.0f, S.data(), BK, V, ldkv, 1.0f, O, ldv);
    }
    // NaN rule (docs/attention.md): a row with no allowed key is 0; any other row keeps what its inputs
    // give, NaN included (l_run is NaN then, never 0), and tiles never mix sequences.
    for (int64_t r = 0; r < rows; ++r) {
      float* o = O + r * ldv;
      if (!any_key[r]) {
        std::fill(o, o + Dv, 0.0f);
      } else if (p.act == SOFTMAX) {
        const float inv = 1.0f / l_run[r];
        for (int64_t c = 0; c < Dv; ++c) o[c] *= inv;
        lp[h * tq + s.qs + w.i0 + r] = m_run[r] + std::log(l_run[r]);
      }
    }
  });
  // out stays fp32 (the Python wrapper casts it to the input dtype): backward's rowsum(dO * O) then uses
  // the fp32 output, not its bf16/fp16 rounding.
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> jagged_attention_bwd_cpu(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& q_offsets, const at::Tensor& k_offsets,
    bool causal, int64_t act, double scale, double norm, int64_t window, int64_t block,
    const c10::optional<at::Tensor>& rel_pos, const c10::optional<at::Tensor>& rel_time,
    const c10::optional<at::Tensor>& q_times, const c10::optional<at::Tensor>& k_times, double bucket_divisor) {
  check_qkv(q_in, k_in, v_in);
  const auto rel = rel_bias_inputs(rel_pos, rel_time, q_times, k_times, bucket_divisor, q_in.size(0), k_in.size(0));
  const RelBias& bias = rel.view;
  const auto seqs = sequences(q_offsets, k_offsets, q_in.size(0), k_in.size(0));
  const Params p = make_params(q_in, v_in, causal, act, scale, norm, window, block);
  const auto q = q_in.to(at::kFloat).contiguous(), k = k_in.to(at::kFloat).contiguous(),
             v = v_in.to(at::kFloat).contiguous();
  const auto dout = grad_in.to(at::kFloat).contiguous();
  const int64_t tq = q.size(0), H = p.H, D = p.D, Dv = p.Dv;
  TORCH_CHECK(dout.sizes() == at::IntArrayRef({tq, H, Dv}), "grad_out must be [Tq, H, Dv]");
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  at::Tensor out, lse;
  if (act == SOFTMAX) {
    out = out_in.to(at::kFloat).contiguous();
    lse = lse_in.to(at::kFloat).contiguous();
    TORCH_CHECK(out.sizes() == at::IntArrayRef({tq, H, Dv}), "out must be [Tq, H, Dv]");
    TORCH_CHECK(lse.sizes() == at::IntArrayRef({H, tq}), "lse must be [H, Tq]");
  }

  // one item per (sequence, k/v head): it loops over the G query heads of the group, summing their dK/dV
  std::vector<Item> items;
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    const Seq& s = seqs[b];
    if (s.lq == 0 || s.lk == 0) continue;
    for (int64_t hk = 0; hk < p.Hkv; ++hk) items.push_back({b, hk, 0, s.lq, double(s.lq) * double(s.lk)});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  const float* gp = dout.const_data_ptr<float>();
  const float* lp = act == SOFTMAX ? lse.const_data_ptr<float>() : nullptr;
  const float* op = act == SOFTMAX ? out.const_data_ptr<float>() : nullptr;
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  const int64_t ldq = H * D, ldv = H * Dv, ldk = p.Hkv * D, ldkv = p.Hkv * Dv;
  // the bias tables' gradients: one partial sum per worker (fp64), reduced after the loop
  const int64_t nb = bias.time != nullptr ? bias.NB + 1 : 0, width = bias.P + nb;
  std::vector<double> partial(bias.on() ? item_workers(static_cast<int64_t>(items.size())) * width : 0, 0.0);

  run_items(static_cast<int64_t>(items.size()), [&](int64_t it, int64_t slot) {
    thread_local std::vector<float> P, dP, S, delta;
    thread_local std::vector<int32_t> buckets;  // the tile's time buckets, from the bias to its gradient
    double* dpos = bias.on() ? partial.data() + slot * width : nullptr;
    if (bias.time != nullptr) buckets.resize(BQ * BK);
    P.resize(BQ * BK);
    dP.resize(BQ * BK);
    S.resize(BQ * BK);
    const Item& w = items[it];
    const Seq& s = seqs[w.seq];
    const int64_t hk = w.head;
    for (int64_t h = hk * p.G; h < (hk + 1) * p.G; ++h) {  // the query heads that read k/v head hk
      if (p.act == SOFTMAX) {  // delta_i = rowsum(dO * O) for this (sequence, query head)
        delta.resize(s.lq);
        for (int64_t r = 0; r < s.lq; ++r) {
          const float* g = gp + (s.qs + r) * ldv + h * Dv;
          const float* o = op + (s.qs + r) * ldv + h * Dv;
          float acc = 0.0f;
          for (int64_t c = 0; c < Dv; ++c) acc += g[c] * o[c];
          delta[r] = acc;
        }
      }
      for (int64_t j0 = 0; j0 < s.lk; j0 += BK) {
        const int64_t cols = std::min(s.lk, j0 + BK) - j0;
        const float* K = kp + (s.ks + j0) * ldk + hk * D;
        const float* V = vp + (s.ks + j0) * ldkv + hk * Dv;
        float* dK = dkp + (s.ks + j0) * ldk + hk * D;
        float* dV = dvp + (s.ks + j0) * ldkv + hk * Dv;
        int64_t qlo, qhi;
        query_range(s, j0, j0 + cols, p, qlo, qhi);
        for (int64_t i0 = qlo; i0 < qhi; i0 += BQ) {
          const int64_t rows = std::min(qhi, i0 + BQ) - i0;
          int64_t klo, khi;
          key_range(s, i0, i0 + rows, p, klo, khi);
          if (khi <= j0 || klo >= j0 + cols) continue;
          const float* Q = qp + (s.qs + i0) * ldq + h * D;
          const float* dO = gp + (s.qs + i0) * ldv + h * Dv;
          float* dQ = dqp + (s.qs + i0) * ldq + h * D;
          gemm(false, true, rows, cols, D, p.scale, Q, ldq, K, ldk, 0.0f, S.data(), BK);
          int64_t ra[BQ], rb[BQ];
          for (int64_t r = 0; r < rows; ++r) {
            row_interval(i0 + r + s.shift(), j0, cols, p, ra[r], rb[r]);
            if (bias.on())
              add_bias_row(bias, S.data() + r * BK, ra[r], rb[r], i0 + r + s.shift(), j0, s.qs + i0 + r, s.ks + j0,
                           bias.time != nullptr ? buckets.data() + r * BK : nullptr);
            if (p.act == SOFTMAX)
              softmax_probs_row(S.data() + r * BK, P.data() + r * BK, ra[r], rb[r], lp[h * tq + s.qs + i0 + r]);
            else
              act_row(S.data() + r * BK, P.data() + r * BK, ra[r], rb[r], p.act, p.inv_norm);
          }
          // dV += P^T dO ; dP = dO V^T
          gemm(true, false, cols, Dv, rows, 1.0f, P.data(), BK, dO, ldv, 1.0f, dV, ldkv);
          gemm(false, true, rows, cols, Dv, 1.0f, dO, ldv, V, ldkv, 0.0f, dP.data(), BK);
          for (int64_t r = 0; r < rows; ++r) {
            if (p.act == SOFTMAX)
              softmax_grad_row(P.data() + r * BK, dP.data() + r * BK, delta[i0 + r]);
            else
              act_grad_row(S.data() + r * BK, dP.data() + r * BK, ra[r], rb[r], p.act, p.inv_norm);
            if (bias.on())
              bias_grad_row(bias, dP.data() + r * BK, ra[r], rb[r], i0 + r + s.shift(), j0,
                            bias.time != nullptr ? buckets.data() + r * BK : nullptr, dpos, dpos + bias.P);
          }
          // dQ += scale dS K ; dK += scale dS^T Q
          gemm(false, false, rows, D, cols, p.scale, dP.data(), BK, K, ldk, 1.0f, dQ, ldq);
          gemm(true, false, cols, D, rows, p.scale, dP.data(), BK, Q, ldq, 1.0f, dK, ldk);
        }
      }
    }
  });
  // the tables' gradients: the workers' partial sums reduced in order (deterministic for one thread count)
  at::Tensor dpos_t = at::zeros({bias.on() ? bias.P : 0}, q.options()), dtime_t = at::zeros({nb}, q.options());
  if (bias.on()) {
    float* dp = dpos_t.data_ptr<float>();
    float* dt = dtime_t.data_ptr<float>();
    const int64_t slots = static_cast<int64_t>(partial.size()) / width;
    for (int64_t c = 0; c < width; ++c) {
      double acc = 0.0;
      for (int64_t w = 0; w < slots; ++w) acc += partial[w * width + c];
      (c < bias.P ? dp[c] : dt[c - bias.P]) = static_cast<float>(acc);
    }
    dpos_t = dpos_t.to(rel_pos->scalar_type());
    if (nb) dtime_t = dtime_t.to(rel_time->scalar_type());
  }
  const auto dt = q_in.scalar_type();
  return {dq.to(dt), dk.to(k_in.scalar_type()), dv.to(v_in.scalar_type()), dpos_t, dtime_t};
}

}  // namespace

TORCH_LIBRARY_IMPL(gemzoo, CPU, m) {
  m.impl("jagged_attention_fwd", &jagged_attention_fwd_cpu);
  m.impl("jagged_attention_bwd", &jagged_attention_bwd_cpu);
}

}  // namespace gemzoo
