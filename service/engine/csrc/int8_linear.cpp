// Weight-only int8 linear for the few-row batches of decoding: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
// At batch 1 a linear only streams its weight once, so the int8 row (a quarter of the fp32 bytes) is the cost;
// each weight row is read once from memory, widened to float once, and used for up to kMaxRows input rows.
// Threads split the output rows through ATen's own pool (at::parallel_for, built with -fopenmp so that it really
// forks; the extension then shares the OpenMP runtime torch loaded). Built at run time for the CPU it runs on (AVX2 path, or scalar).
#include "cpu_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;

template <int Rows>
void rows_dot(const float* x, int64_t K, const int8_t* q, int64_t n0, int64_t n1, const float* scale, float* y,
              int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = q + n * K;
    float sum[Rows];
    int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0[Rows], acc1[Rows];
    for (int r = 0; r < Rows; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    if constexpr (Rows == 1) {
      // One row has only two FMA chains above; four more hide the FMA latency, so the loop runs at memory speed.
      __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
      for (; k + 32 <= K; k += 32) {
        const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
        const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16));
        acc0[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0)), acc0[0]);
        acc1[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8),
                                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8))), acc1[0]);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1)), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24),
                               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8))), acc3);
      }
      acc0[0] = _mm256_add_ps(acc0[0], acc2);
      acc1[0] = _mm256_add_ps(acc1[0], acc3);
    }
    for (; k + 16 <= K; k += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
      for (int r = 0; r < Rows; ++r) {
        acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, acc1[r]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      const __m256 a = _mm256_add_ps(acc0[r], acc1[r]);
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
      sum[r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
    }
#else
    for (int r = 0; r < Rows; ++r) sum[r] = 0.f;
#endif
    for (; k < K; ++k) {
      const float w = static_cast<float>(row[k]);
      for (int r = 0; r < Rows; ++r) sum[r] += x[r * K + k] * w;
    }
    for (int r = 0; r < Rows; ++r) y[r * N + n] = sum[r] * scale[n];
  }
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "int8_linear: x [M, K], q [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "int8_linear: float32 x, int8 q, float32 scale");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.numel() == q.size(0), "int8_linear: layout");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = q.size(0);
  torch::Tensor y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const float* xm = xp + m * K;
      float* ym = yp + m * N;
      switch (std::min(kMaxRows, M - m)) {
        case 1: rows_dot<1>(xm, K, qp, n0, n1, sp, ym, N); break;
        case 2: rows_dot<2>(xm, K, qp, n0, n1, sp, ym, N); break;
        case 3: rows_dot<3>(xm, K, qp, n0, n1, sp, ym, N); break;
        default: rows_dot<4>(xm, K, qp, n0, n1, sp, ym, N); break;
      }
    }
  });
  return y;
}
