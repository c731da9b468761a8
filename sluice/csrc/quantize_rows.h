// Activations quantized per group of 32 inputs to int8, as llama.cpp quantizes them for its integer dot products
// (Q8_0 / Q8_1): codes q = round(x / dx), dx = max|x| / 127, with the group's float sum, its codes' sum and dx times
// that.
// Every linear on integer weights runs this on its whole input first, so it is threaded and vectorized: serial,
// it took a tenth of a one-thread 1.7B prefill while the other thread waited. The float sum adds in one fixed
// tree (x[l] + x[l + 16], then halves of 8, 4, 2, 1) in every build, so AVX-512, AVX2 and portable builds agree bit
// for bit; rounding is to nearest even (nearbyint) in all three.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include "simd.h"

#if defined(SLUICE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define SLUICE_QUANTIZE_AVX512 1
#elif defined(SLUICE_AVX2)
#define SLUICE_QUANTIZE_AVX2 1
#endif

namespace sluice {

constexpr int64_t kQuantGroup = 32;

// M rows of K inputs quantized: codes [M, K], and per group of 32 (M * K / 32 of each) dx, the float sum of x, the
// sum of the codes and dx times that.
struct QuantizedRows {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> scale, sum, code_sum;
  std::unique_ptr<int32_t[]> codes;
};

namespace detail {

inline void quantize_group(const float* xg, int8_t* q, float* scale, float* sum, float* code_sum, int32_t* code_total) {
#if defined(SLUICE_QUANTIZE_AVX512)
  const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 p = _mm512_add_ps(a, b);  // x[l] + x[l + 16]; then its halves added
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1));
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(p), high);
#elif defined(SLUICE_QUANTIZE_AVX2)
  const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8), x2 = _mm256_loadu_ps(xg + 16),
               x3 = _mm256_loadu_ps(xg + 24);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  // x[l] + x[l + 16] for l < 8 and for 8 <= l < 16, then those two halves added
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(x0, x2), _mm256_add_ps(x1, x3));
#else
  float amax = 0.f, p[16];
  for (int l = 0; l < 32; ++l) amax = std::max(amax, std::fabs(xg[l]));
  for (int l = 0; l < 16; ++l) p[l] = xg[l] + xg[l + 16];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) p[l] = p[l] + p[l + w];
#endif
#ifdef SLUICE_AVX2
  *sum = hsum(s8);  // halves of 4, 2, 1 as the portable tree
#else
  *sum = p[0];
#endif
  const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t codes = 0;
#if defined(SLUICE_QUANTIZE_AVX512)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, vinv), kRound));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(b, vinv), kRound));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  codes = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#elif defined(SLUICE_QUANTIZE_AVX2)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i c0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x0, vinv), kRound));
  const __m256i c1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x1, vinv), kRound));
  const __m256i c2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x2, vinv), kRound));
  const __m256i c3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x3, vinv), kRound));
  // Saturating packs keep |q| <= 127 as it is, but interleave 4-byte units across the 128-bit lanes: undone by the
  // permute.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i c = _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3));
  __m128i c4 = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  c4 = _mm_add_epi32(c4, _mm_shuffle_epi32(c4, 0x4E));
  codes = _mm_cvtsi128_si32(_mm_add_epi32(c4, _mm_shuffle_epi32(c4, 0xB1)));
#else
  for (int l = 0; l < 32; ++l) {
    q[l] = static_cast<int8_t>(std::nearbyint(xg[l] * inv));
    codes += q[l];
  }
#endif
  *scale = d;
  *code_total = codes;
  *code_sum = d * static_cast<float>(codes);
}

}  // namespace detail

// x float32 [M, K], K a multiple of 32, quantized on torch's threads past 1,024 groups (a decode row stays on one:
// forking costs more than it saves). Groups are stored row by row, or with row_block > 1 interleaved per block of
// that many rows (the last block holds the rest, R rows): block m's group g of its row r at m * G + g * R + r.
// A kernel walking a block's rows then reads each group of all of them from one place, one pointer for all rows.
inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t row_block = 1) {
  const int64_t G = K / kQuantGroup, groups = M * G;
  // Every element is written below: no zeroing.
  QuantizedRows out{std::unique_ptr<int8_t[]>(new int8_t[M * K]), std::unique_ptr<float[]>(new float[groups]),
                    std::unique_ptr<float[]>(new float[groups]), std::unique_ptr<float[]>(new float[groups]),
                    std::unique_ptr<int32_t[]>(new int32_t[groups])};
  at::parallel_for(0, groups, 1024, [&](int64_t g0, int64_t g1) {
    for (int64_t i = g0; i < g1; ++i) {
      const int64_t row = i / G, g = i % G, m = row / row_block * row_block;
      const int64_t at = m * G + g * std::min(row_block, M - m) + (row - m);
      detail::quantize_group(x + i * kQuantGroup, out.q.get() + at * kQuantGroup, &out.scale[at], &out.sum[at],
                             &out.code_sum[at], &out.codes[at]);
    }
  });
  return out;
}

}  // namespace sluice
