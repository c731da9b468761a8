// float32 linear for the few-row batches of decoding, reading the plain [N, K] weight that torch's own path reads
// too, so nothing is copied. At batch 1 a linear streams its weight once, so its speed is the memory bandwidth it
// reaches (bench/results/f32-gemv.json). Each weight row is read once and used for up to kRowBlock input rows (more rows
// take turns on tiles of it in cache); threads split the output rows (at::parallel_for, -fopenmp).
#include "cpu_ops.h"

#include <ATen/Parallel.h>

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

// y[r, n + j] = x[r] . w[n + j] for r < Rows, j < WR, in Chains independent sums per pair: a lone weight row needs
// several chains so that the loads, not the FMA latency, set the pace.
template <int Rows, int WR, int Chains = 1>
void tile_dot(const float* x, int64_t K, const float* w, int64_t n, float* y, int64_t N) {
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
      for (int j = 0; j < WR; ++j) wv[j] = _mm256_loadu_ps(w + (n + j) * K + k + 8 * c);
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
      for (int j = 0; j < WR; ++j) sum[r][j] += x[r * K + k] * w[(n + j) * K + k];
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < WR; ++j) y[r * N + n + j] = sum[r][j];
}

template <int Rows>
void rows_dot(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t row_bytes = K * int64_t(sizeof(float));
  int64_t n = n0;
  if (row_bytes >= kLongRowBytes<Rows>) {
    for (; n + kWeightRows<Rows> <= n1; n += kWeightRows<Rows>) tile_dot<Rows, kWeightRows<Rows>>(x, K, w, n, y, N);
  }
  for (; n < n1; ++n) tile_dot<Rows, 1, Rows == 1 ? 4 : 2>(x, K, w, n, y, N);
}

}  // namespace

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "f32_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "f32_linear: float32 x and contiguous float32 w");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    sluice::for_each_tile(M, n0, n1, K * int64_t(sizeof(float)), [&](auto rows, int64_t m, int64_t t0, int64_t t1) {
      rows_dot<rows>(xp + m * K, K, wp, t0, t1, yp + m * N, N);
    });
  });
  return y;
}
