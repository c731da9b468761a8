// float32 linear for the few-row batches of decoding, reading the plain [N, K] weight that torch's own path reads
// too, so nothing is copied. At batch 1 a linear streams its weight once: oneDNN's GEMV (prepacked or plain)
// streamed SmolLM2's fp32 weights at ~20 GB/s on 2 Zen 4 cores, this loop at ~31 GB/s. Each weight row is read
// once and used for up to kRowBlock input rows (more rows take turns on tiles of it in cache); threads split the
// output rows (at::parallel_for, -fopenmp).
#include "cpu_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include "row_blocks.h"
#include "simd.h"

namespace {

template <int Rows>
void rows_dot(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* row = w + n * K;
    float sum[Rows];
    int64_t k = 0;
#ifdef SLUICE_AVX2
    __m256 acc[2][Rows];
    for (int r = 0; r < Rows; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    if constexpr (Rows == 1) {
      // One row has one chain per accumulator: four of them, so the loads, not the FMA latency, set the pace.
      __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (; k + 32 <= K; k += 32) {
        acc[0][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(row + k), acc[0][0]);
        acc[1][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(row + k + 8), acc[1][0]);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(row + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(row + k + 24), a3);
      }
      acc[0][0] = _mm256_add_ps(acc[0][0], a2);
      acc[1][0] = _mm256_add_ps(acc[1][0], a3);
    }
    for (; k + 16 <= K; k += 16) {
      const __m256 w0 = _mm256_loadu_ps(row + k), w1 = _mm256_loadu_ps(row + k + 8);
      for (int r = 0; r < Rows; ++r) {
        acc[0][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, acc[0][r]);
        acc[1][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, acc[1][r]);
      }
    }
    for (int r = 0; r < Rows; ++r) sum[r] = sluice::hsum(_mm256_add_ps(acc[0][r], acc[1][r]));
#else
    for (int r = 0; r < Rows; ++r) sum[r] = 0.f;
#endif
    for (; k < K; ++k) {
      for (int r = 0; r < Rows; ++r) sum[r] += x[r * K + k] * row[k];
    }
    for (int r = 0; r < Rows; ++r) y[r * N + n] = sum[r];
  }
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
