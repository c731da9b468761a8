// Each row's argmax for greedy sampling, the index torch's max(dim=-1) and argmax pick: the first largest value, or
// the first NaN of a row that has one. torch's CPU max reduction over the last dimension compares an element at a
// time on one thread, so a decode batch's rows over a 49,152-token vocabulary took a millisecond while the other
// thread waited; here each thread takes rows and compares 16 (AVX-512) or 8 (AVX2) at a time.
#include "cpu_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Elements [i, V) after the vector loop: the first NaN wins, else a strictly larger value (ties keep the first).
int64_t finish(const float* x, int64_t V, int64_t i, float best, int64_t best_i) {
  for (; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > best) best = x[i], best_i = i;
  }
  return best_i;
}

int64_t row_argmax(const float* x, int64_t V) {
#if defined(__AVX512F__)
  constexpr int64_t W = 16;
  if (V >= 2 * W && !_mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_loadu_ps(x), _CMP_UNORD_Q)) {
    // Lane l keeps the first largest of elements l, l + 16, ...: strictly greater replaces, so ties keep the first.
    __m512 best = _mm512_loadu_ps(x);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = index;
    int64_t i = W;
    for (; i + W <= V; i += W) {
      const __m512 v = _mm512_loadu_ps(x + i);
      if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;  // a NaN: finish() finds the first from here
      at = _mm512_add_epi32(at, _mm512_set1_epi32(W));
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, greater, v);
      index = _mm512_mask_mov_epi32(index, greater, at);
    }
    // The largest over the lanes, at the smallest index among the lanes that hold it: the first occurrence.
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return finish(x, V, i, top, _mm512_mask_reduce_min_epi32(holders, index));
  }
#elif defined(__AVX2__)
  constexpr int64_t W = 8;
  const auto has_nan = [](__m256 v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; };
  if (V >= 2 * W && !has_nan(_mm256_loadu_ps(x))) {
    __m256 best = _mm256_loadu_ps(x);
    __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = index;
    int64_t i = W;
    for (; i + W <= V; i += W) {
      const __m256 v = _mm256_loadu_ps(x + i);
      if (has_nan(v)) break;
      at = _mm256_add_epi32(at, _mm256_set1_epi32(W));
      const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, v, greater);
      index = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(index), _mm256_castsi256_ps(at), greater));
    }
    float lanes[W];
    int32_t indices[W];
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(indices), index);
    float top = lanes[0];
    int64_t top_i = indices[0];
    for (int l = 1; l < W; ++l) {
      if (lanes[l] > top || (lanes[l] == top && indices[l] < top_i)) top = lanes[l], top_i = indices[l];
    }
    return finish(x, V, i, top, top_i);
  }
#endif
  if (std::isnan(x[0])) return 0;
  return finish(x, V, 1, x[0], 0);
}

}  // namespace

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t{1} << 31),
              "greedy_argmax: logits float32 [B, V], 0 < V < 2^31");
  const at::Tensor x = logits.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor ids = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* out = ids.data_ptr<int64_t>();
  // A row is tens of microseconds at a large vocabulary: threads from two rows on.
  at::parallel_for(0, B, std::max<int64_t>(1, (int64_t{1} << 15) / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = row_argmax(xp + r * V, V);
  });
  return ids;
}
