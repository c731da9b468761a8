// Weight-only int8 linear in GGUF's Q8_0 layout, for the few-row batches of decoding. A row of q holds K / 32
// groups of 32 int8 values with a float16 scale d[g] each, element = q * d, so
//   y[r, n] = sum_g d[g] * sum_j x[r, 32g + j] * q[32g + j].
// At batch 1 a linear streams its weight once, so the int8 bytes (a quarter of fp32's, plus 1/16 for the scales)
// are the cost: each weight group is read once, widened to float in registers and used for up to kRowBlock input
// rows. Threads split the output rows through ATen's pool (at::parallel_for, built with -fopenmp so that it really
// forks; the extension then shares the OpenMP runtime torch loaded). Built at run time for the CPU it runs on.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include "row_blocks.h"
#include "simd.h"

namespace {

constexpr int64_t kGroup = 32;
template <int Rows>
void rows_dot(const float* x, int64_t K, const int8_t* q, const uint16_t* d, int64_t n0, int64_t n1, float* y,
              int64_t N) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = q + n * K;
    const uint16_t* drow = d + n * G;
    float sum[Rows];
#ifdef SLUICE_AVX2
    // Two accumulators per row (even and odd groups), so consecutive groups do not wait on one FMA's latency.
    __m256 acc[2][Rows];
    for (int r = 0; r < Rows; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* qg = row + g * kGroup;
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
      const __m256 dg = _mm256_set1_ps(_cvtsh_ss(drow[g]));
      for (int r = 0; r < Rows; ++r) {
        acc[g & 1][r] = _mm256_fmadd_ps(sluice::dot32(x + r * K + g * kGroup, w0, w1, w2, w3), dg, acc[g & 1][r]);
      }
    }
    for (int r = 0; r < Rows; ++r) sum[r] = sluice::hsum(_mm256_add_ps(acc[0][r], acc[1][r]));
#else
    for (int r = 0; r < Rows; ++r) sum[r] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* qg = row + g * kGroup;
      const float dg = static_cast<float>(c10::Half(drow[g], c10::Half::from_bits()));
      for (int r = 0; r < Rows; ++r) {
        const float* xg = x + r * K + g * kGroup;
        float t = 0.f;
        for (int j = 0; j < kGroup; ++j) t += xg[j] * static_cast<float>(qg[j]);
        sum[r] += dg * t;
      }
    }
#endif
    for (int r = 0; r < Rows; ++r) y[r * N + n] = sum[r];
  }
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "int8_linear: x [M, K], q [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scale.scalar_type() == at::kHalf,
              "int8_linear: float32 x, int8 q, float16 scale");
  const int64_t K = x.size(1), G = K / kGroup, N = q.size(0);
  TORCH_CHECK(K % kGroup == 0, "int8_linear: K must be a multiple of 32");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == G,
              "int8_linear: q [N, K] and scale [N, K / 32], contiguous");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  torch::Tensor y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    sluice::for_each_row_block(M, [&](auto rows, int64_t m) {
      rows_dot<rows>(xp + m * K, K, qp, dp, n0, n1, yp + m * N, N);
    });
  });
  return y;
}
