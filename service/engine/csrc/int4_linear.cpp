// Weight-only int4 linear in GGUF's Q4_1 layout, for the few-row batches of decoding. A row of q holds K / 32
// groups; group g is 16 bytes of nibbles (byte j: element j in the low nibble, element j + 16 in the high one)
// with a float16 scale d[g] and minimum m[g], element = q * d + m. So
//   y[r, n] = sum_g d[g] * sum_j x[r, 32g + j] * q[j]  +  sum_g m[g] * sum_j x[r, 32g + j],
// and the second term needs only each input row's group sums, computed once per call. Activations stay float32
// (quantizing them to int8 as llama.cpp does was no faster here, and outputs would drift from fp32's). Each group is read
// once, widened in registers and used for up to kRowBlock input rows; threads split the output rows.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include "row_blocks.h"
#include <vector>
#include "simd.h"

namespace {

constexpr int64_t kGroup = 32;
inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

template <int Rows>
void rows_dot(const float* x, const float* xsum, int64_t K, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
              int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = qs + n * G * 16;
    const uint16_t* drow = d + n * G;
    const uint16_t* mrow = m + n * G;
    float sum[Rows];
    for (int r = 0; r < Rows; ++r) sum[r] = 0.f;
#ifdef SLUICE_AVX2
    // Two accumulators per row (even and odd groups), so consecutive groups do not wait on one FMA's latency.
    __m256 acc[2][Rows];
    for (int r = 0; r < Rows; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; ++g) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + g * 16));
      const __m128i lo = _mm_and_si128(v, nibble);                        // elements 0..15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);     // elements 16..31
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      const __m256 dg = _mm256_set1_ps(_cvtsh_ss(drow[g]));
      for (int r = 0; r < Rows; ++r) {
        acc[g & 1][r] = _mm256_fmadd_ps(sluice::dot32(x + r * K + g * kGroup, w0, w1, w2, w3), dg, acc[g & 1][r]);
      }
    }
    // The minimum's term, sum_g m[g] * xsum[g], eight groups at a time.
    for (int r = 0; r < Rows; ++r) {
      __m256 a = _mm256_add_ps(acc[0][r], acc[1][r]);
      int64_t g = 0;
      for (; g + 8 <= G; g += 8) {
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mrow + g)));
        a = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + r * G + g), a);
      }
      for (; g < G; ++g) sum[r] += _cvtsh_ss(mrow[g]) * xsum[r * G + g];
      sum[r] += sluice::hsum(a);
    }
#else
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* qg = qrow + g * 16;
      const float dg = half_to_float(drow[g]), mg = half_to_float(mrow[g]);
      for (int r = 0; r < Rows; ++r) {
        const float* xg = x + r * K + g * kGroup;
        float t = 0.f;
        for (int j = 0; j < 16; ++j) {
          t += xg[j] * static_cast<float>(qg[j] & 0x0F) + xg[j + 16] * static_cast<float>(qg[j] >> 4);
        }
        sum[r] += dg * t + mg * xsum[r * G + g];
      }
    }
#endif
    for (int r = 0; r < Rows; ++r) y[r * N + n] = sum[r];
  }
}

}  // namespace

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scale,
                          const torch::Tensor& minimum) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_linear: x float32 [M, K]");
  const int64_t K = x.size(1), G = K / kGroup, N = qs.size(0);
  TORCH_CHECK(K % kGroup == 0, "int4_linear: K must be a multiple of 32");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 3 && qs.size(1) == G && qs.size(2) == 16 &&
                  qs.is_contiguous(),
              "int4_linear: qs uint8 [N, K / 32, 16], contiguous");
  for (const torch::Tensor* t : {&scale, &minimum}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 2 && t->size(0) == N && t->size(1) == G &&
                    t->is_contiguous(),
                "int4_linear: scale and minimum float16 [N, K / 32], contiguous");
  }
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  const float* xp = xc.data_ptr<float>();
  std::vector<float> xsum(static_cast<size_t>(M * G));  // group sums of x, for the minimum's term
  for (int64_t i = 0; i < M * G; ++i) {
    float total = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) total += xp[i * kGroup + j];
    xsum[i] = total;
  }
  const float* sp = xsum.data();
  torch::Tensor y = torch::empty({M, N}, xc.options());
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(minimum.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    sluice::for_each_row_block(M, [&](auto rows, int64_t r) {
      rows_dot<rows>(xp + r * K, sp + r * G, K, qp, dp, mp, n0, n1, yp + r * N, N);
    });
  });
  return y;
}
