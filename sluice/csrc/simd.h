// AVX2 helpers the kernels share. Each kernel keeps a scalar path for CPUs without AVX2/FMA/F16C.
#pragma once
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SLUICE_AVX2 1

namespace sluice {

// The sum of the eight lanes.
inline float hsum(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// x[0..32) times a group's 32 weights, already widened to float as w0..w3 (elements 0-7, 8-15, 16-23, 24-31),
// left as 8 partial sums in two independent FMA chains.
inline __m256 dot32(const float* x, __m256 w0, __m256 w1, __m256 w2, __m256 w3) {
  __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x), w0);
  __m256 u = _mm256_mul_ps(_mm256_loadu_ps(x + 8), w1);
  t = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w2, t);
  u = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w3, u);
  return _mm256_add_ps(t, u);
}

}  // namespace sluice
#endif
