/* Decode attention that reads K/V where they lie in the paged cache: no gathered copy of each history.
 *
 * One query token per sequence. For each of the num_seqs sequences, every query head scores every cached token of
 * its KV head (GQA: H / Hkv query heads share one), takes a softmax and sums the values. Tokens are visited in
 * cache order with all heads of a token together, so each block is read front to back, once per pass.
 * Layouts (float32 or bfloat16, contiguous): q and out [n, H, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D];
 * block_tables [n, table_stride] int64; seq_lens [n] int64. Plain C so it builds in a second with any cc.
 * Sequences are shared out among `num_threads` OpenMP threads (built with -fopenmp, the runtime torch already
 * loaded): Python threads beside torch's spinning OpenMP workers would fight them for the same cores.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PARALLEL_MIN_WORK (1 << 20) /* query-key products of a call below which one thread does it all */

/* What stays the same for every layer of one decode step: built once per step by the caller, so each layer's call
 * passes seven pointers (a call through ctypes pays for every argument it converts). */
typedef struct {
    const int64_t *block_tables; /* [num_seqs, table_stride] */
    int64_t table_stride;
    const int64_t *seq_lens;     /* [num_seqs], this step's token included */
    const int64_t *slot_mapping; /* [num_seqs]: the cache row each sequence's new K/V goes to */
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t num_threads;
} sluice_decode_plan;

static inline float bf16_to_float(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* The AVX-512 path: per sequence and KV head, the group's query heads stay in registers while each cached K row
 * is read once for all of them; scores, softmax and the value sum run 16 lanes at a time. */
#define SLUICE_DECODE_AVX512 1

/* exp(x) for x <= 0 (scores less their max): x = n ln2 + r, exp(r) = 1 + r + r^2 P(r) (Cephes' expf polynomial,
 * ~1 ulp), scaled by 2^n; below -87 it is 0, as expf's result would be subnormal or zero. */
static inline __m512 exp512(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.0f);
    const __mmask16 zero = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps((__mmask16)~zero, _mm512_scalef_ps(p, n));
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The AVX2 path (e.g. Zen 3): the AVX-512 path's plan, 8 lanes at a time. */
#define SLUICE_DECODE_AVX2 1

/* exp512's polynomial; 2^n goes into the exponent bits directly (n >= -126 here, so the result stays normal). */
static inline __m256 exp256(__m256 x) {
    const __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

static inline float hsum256(__m256 a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

static inline float hmax256(__m256 a) {
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* Which vector path this build takes for the shapes it covers: "avx512", "avx2" or "portable". */
const char *sluice_paged_decode_isa(void) {
#if defined(SLUICE_DECODE_AVX512)
    return "avx512";
#elif defined(SLUICE_DECODE_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* float32: sluice_paged_decode */
#define KV_T float
#define LOAD16 load16_f32
#define LOAD8 load8_f32
#define LOAD(x) (x)
#define STORE(x) (x)
#define NAME(f) f
#include "paged_decode_body.h"
#undef KV_T
#undef LOAD16
#undef LOAD8
#undef LOAD
#undef STORE
#undef NAME

/* bfloat16 (as uint16_t bits): sluice_paged_decode_bf16 */
#define KV_T uint16_t
#define LOAD16 load16_bf16
#define LOAD8 load8_bf16
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define NAME(f) f##_bf16
#include "paged_decode_body.h"
