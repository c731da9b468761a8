// float32 linear for the few-row batches of decoding, reading the plain [N, K] weight that torch's own path reads
// too, so nothing is copied. At batch 1 a linear streams its weight once, so its speed is the memory bandwidth it
// reaches (bench/results/f32-gemv.json). Each weight row is read once and used for up to kRowBlock input rows (more rows
// take turns on tiles of it in cache); threads split the output rows (at::parallel_for, -fopenmp).
//
// The weight may also be 16-bit (float16 or bfloat16, `--quantization f16 | bf16`): each element is widened to float32
// in registers (F16C's vcvtph2ps; a bfloat16 is a float32's upper half) and the arithmetic is float32's, so a decode
// step streams half the bytes of a float32 weight and rounds nothing but the weights.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include "row_blocks.h"
#include "simd.h"

namespace {

// Weight rows read side by side per input-row count, where a weight row is long (kLongRowBytes). A long row read
// alone is one memory stream, and one stream per thread leaves the hardware prefetchers idle: reading several rows
// at once keeps several streams going and at least as many registers in use (Rows x WR accumulators, <= 9).
template <int Rows>
constexpr int kWeightRows = Rows == 1 ? 8 : Rows == 2 ? 4 : Rows == 3 ? 3 : 2;

// Rows of 3 KiB and more (768 floats) gain from side-by-side reads (bench/f32_gemv.py); shorter rows lie next to
// each other, one stream already, and lose to the extra register pressure. Four input rows have the fewest
// registers to spare and gain from two weight rows only past 8 KiB.
template <int Rows>
constexpr int64_t kLongRowBytes = Rows == 4 ? 8 * 1024 : 3 * 1024;

// A weight element as float32, one at a time and (AVX2) eight at a time.
inline float widen(float w) { return w; }
inline float widen(c10::Half w) { return static_cast<float>(w); }
inline float widen(c10::BFloat16 w) { return static_cast<float>(w); }
#ifdef SLUICE_AVX2
inline __m256 widen8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 widen8(const c10::Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
inline __m256 widen8(const c10::BFloat16* w) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
#endif

// y[r, n + j] = x[r] . w[n + j] for r < Rows, j < WR, in Chains independent sums per pair: a lone weight row needs
// several chains so that the loads, not the FMA latency, set the pace.
template <int Rows, int WR, int Chains = 1, typename W>
void tile_dot(const float* x, int64_t K, const W* w, int64_t n, float* y, int64_t N) {
  float sum[Rows][WR];
  int64_t k = 0;
#ifdef SLUICE_AVX2
  __m256 acc[Chains][Rows][WR];
  for (int c = 0; c < Chains; ++c)
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < WR; ++j) acc[c][r][j] = _mm256_setzero_ps();
  for (; k + 8 * Chains <= K; k += 8 * Chains) {
    for (int c = 0; c < Chains; ++c) {
      __m256 wv[WR];
      for (int j = 0; j < WR; ++j) wv[j] = widen8(w + (n + j) * K + k + 8 * c);
      for (int r = 0; r < Rows; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + k + 8 * c);
        for (int j = 0; j < WR; ++j) acc[c][r][j] = _mm256_fmadd_ps(xv, wv[j], acc[c][r][j]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int j = 0; j < WR; ++j) {
      __m256 total = acc[0][r][j];
      for (int c = 1; c < Chains; ++c) total = _mm256_add_ps(total, acc[c][r][j]);
      sum[r][j] = sluice::hsum(total);
    }
  }
#else
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < WR; ++j) sum[r][j] = 0.f;
#endif
  for (; k < K; ++k) {
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < WR; ++j) sum[r][j] += x[r * K + k] * widen(w[(n + j) * K + k]);
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < WR; ++j) y[r * N + n + j] = sum[r][j];
}

template <int Rows, typename W>
void rows_dot(const float* x, int64_t K, const W* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t row_bytes = K * int64_t(sizeof(W));
  int64_t n = n0;
  if (row_bytes >= kLongRowBytes<Rows>) {
    for (; n + kWeightRows<Rows> <= n1; n += kWeightRows<Rows>) tile_dot<Rows, kWeightRows<Rows>>(x, K, w, n, y, N);
  }
  for (; n < n1; ++n) tile_dot<Rows, 1, Rows == 1 ? 4 : 2>(x, K, w, n, y, N);
}

template <typename W>
void linear(const float* xp, int64_t M, int64_t K, const W* wp, int64_t N, float* yp) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    sluice::for_each_tile(M, n0, n1, K * int64_t(sizeof(W)), [&](auto rows, int64_t m, int64_t t0, int64_t t1) {
      rows_dot<rows>(xp + m * K, K, wp, t0, t1, yp + m * N, N);
    });
  });
}

}  // namespace

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "f32_linear: x [M, K], w [N, K]");
  const at::ScalarType wt = w.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat && (wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16) &&
                  w.is_contiguous(),
              "f32_linear: float32 x and a contiguous float32, float16 or bfloat16 w");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (wt == at::kHalf) {
    linear(xp, M, K, w.data_ptr<c10::Half>(), N, yp);
  } else if (wt == at::kBFloat16) {
    linear(xp, M, K, w.data_ptr<c10::BFloat16>(), N, yp);
  } else {
    linear(xp, M, K, w.data_ptr<float>(), N, yp);
  }
  return y;
}
