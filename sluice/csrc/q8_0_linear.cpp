// Linear on GGUF Q8_0 blocks as stored, for the few-row batches of decoding: a row holds K / 32 blocks of 34 bytes,
// a float16 scale d then 32 int8 values q, element = q * d, so
//   y[r, n] = sum_g d[g] * sum_j x[r, 32g + j] * q[32g + j].
// The activations stay float (llama.cpp rounds them to int8; timed over SmolLM2's shapes at 1 to 64 rows, neither
// wins clearly, and float ones are exact). At batch 1 a linear streams its weight once, so the int8 bytes are the
// cost: each block is read once, widened to float in registers and used for up to kRowBlock input rows. Threads split the output rows through ATen's pool (at::parallel_for, built with -fopenmp so that it really
// forks; the extension then shares the OpenMP runtime torch loaded). Built at run time for the CPU it runs on.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#include "row_blocks.h"
#include "simd.h"

namespace {

constexpr int64_t kGroup = 32, kBytes = 34;

inline uint16_t scale_bits(const uint8_t* block) {
  uint16_t bits;
  std::memcpy(&bits, block, 2);
  return bits;
}

template <int Rows>
void rows_dot(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * G * kBytes;
    float sum[Rows];
#ifdef SLUICE_AVX2
    // Two accumulators per row (even and odd groups), so consecutive groups do not wait on one FMA's latency.
    __m256 acc[2][Rows];
    for (int r = 0; r < Rows; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      sluice::prefetch(row + g * kBytes + sluice::kPrefetchBytes, kBytes);
      const int8_t* qg = reinterpret_cast<const int8_t*>(row + g * kBytes + 2);
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
      const __m256 dg = _mm256_set1_ps(_cvtsh_ss(scale_bits(row + g * kBytes)));
      for (int r = 0; r < Rows; ++r) {
        acc[g & 1][r] = _mm256_fmadd_ps(sluice::dot32(x + r * K + g * kGroup, w0, w1, w2, w3), dg, acc[g & 1][r]);
      }
    }
    for (int r = 0; r < Rows; ++r) sum[r] = sluice::hsum(_mm256_add_ps(acc[0][r], acc[1][r]));
#else
    for (int r = 0; r < Rows; ++r) sum[r] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* qg = reinterpret_cast<const int8_t*>(row + g * kBytes + 2);
      const float dg = static_cast<float>(c10::Half(scale_bits(row + g * kBytes), c10::Half::from_bits()));
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

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q8_0_linear: x float32 [M, K]");
  const int64_t K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kGroup == 0 && w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / kGroup * kBytes &&
                  w.is_contiguous(),
              "q8_0_linear: blocks uint8 [N, K / 32 * 34], contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    sluice::for_each_row_block(M, [&](auto rows, int64_t m) { rows_dot<rows>(xp + m * K, K, wp, n0, n1, yp + m * N, N); });
  });
  return y;
}
