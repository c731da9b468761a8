// Decode attention that reads K/V where they lie in the paged cache: no gathered copy of each history.
//
// One query token per sequence. For each of the num_seqs sequences, every query head scores every cached token of
// its KV head (GQA: H / Hkv query heads share one), takes a softmax and sums the values. Tokens are visited in
// cache order, a chunk of them with all of a work item's heads together, so each block is read front to back, once
// per pass.
// Layouts (float32 or bfloat16, contiguous; the caches may be bfloat16 or float16 under float32 q): q and out [n, H, D];
// key_cache, value_cache [num_blocks, block_size, Hkv, D];
// block_tables [n, table_stride] int64; seq_lens [n] int64.
// Each sequence, or each share of its KV heads where sequences are fewer than the threads have use for, is a work
// item shared out among `num_threads` OpenMP threads (built with -fopenmp, the runtime torch already loaded): Python
// threads beside torch's spinning OpenMP workers would fight them for the same cores. The kernel itself is plain
// C-style code over raw pointers; PagedDecodePlan (cpu_ops.h) is its torch-facing side.
#include "cpu_ops.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>

#include "row_blocks.h"

namespace {

constexpr int64_t PARALLEL_MIN_WORK = 1 << 15;  // query-key products of a call below which one thread does it all
// How many tokens ahead the vector path prefetches a head's K and V rows: they lie a token's stride apart and
// blocks jump, and on a Xeon the hardware prefetchers alone left the fp32 kernel at 14 GB/s of cache against 23
// for a plain sum.
constexpr int64_t kPrefetchTokens = 8;
// Bytes of a chunk of tokens' K (or V) rows, all KV heads of a work item, that one row's pass keeps in L2 while it
// walks the heads (heads_simd).
constexpr int64_t kChunkBytes = 128 * 1024;

// What stays the same for every layer of one decode step (PagedDecodePlan holds the tensors behind it).
struct DecodePlan {
    const int64_t *block_tables; /* [num_seqs, table_stride] */
    int64_t table_stride;
    const int64_t *seq_lens;     /* [num_seqs], this step's token included */
    const int64_t *slot_mapping; /* [num_seqs]: the cache row each sequence's new K/V goes to (NULL: stored already) */
    const int64_t *items;        /* [num_items, 2]: first row and row count of each run of rows attended together */
    int64_t num_items;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t num_threads;
};

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

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* IEEE half (--kv-cache-dtype float16, llama.cpp's default cache type) as uint16_t bits, round to nearest even as
 * torch does: F16C's instructions where the build has them, else the same arithmetic by hand. */
static inline float f16_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN */
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa x 2^-24, exact in float32 */
        f = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint16_t float_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u); /* inf; NaN stays NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;                                    /* 65520 and up round to inf */
    if (ax < 0x38800000u) { /* below half's smallest normal: a multiple of 2^-24, rounded by the FPU */
        float a;
        memcpy(&a, &ax, sizeof a);
        return sign | (uint16_t)lrintf(a * 16777216.0f);
    }
    ax += 0xc8000fffu + ((ax >> 13) & 1u); /* exponent rebiased (-112), mantissa rounded to nearest even */
    return sign | (uint16_t)(ax >> 13);
#endif
}

/* The vector path (AVX-512, else AVX2 + FMA + F16C): per sequence and KV head, the group's query heads stay in registers
 * while each cached K and V row is read once for all of them; scores, softmax and the value sum run VW lanes at a
 * time. The macros below are all that differs between the two widths. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define SLUICE_DECODE_SIMD "avx512"
#define VW 16
typedef __m512 vf;
#define V_SET1 _mm512_set1_ps
#define V_ZERO _mm512_setzero_ps
#define V_LOADU _mm512_loadu_ps
#define V_STOREU _mm512_storeu_ps
#define V_MUL _mm512_mul_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MAX _mm512_max_ps
#define V_FMADD _mm512_fmadd_ps
#define V_FNMADD _mm512_fnmadd_ps
#define V_HSUM hsum16
#define V_HMAX _mm512_reduce_max_ps
#define V_ROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_POW2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), \
                                                                          _mm512_set1_epi32(127)), 23))
#define V_ZERO_BELOW(x, low, y) _mm512_maskz_mov_ps((__mmask16)~_mm512_cmp_ps_mask(x, low, _CMP_LT_OQ), y)
/* The sum of v's lanes in one fixed tree, written out (the compiler's reduce is its own): x[i] + x[i + 8], then the
 * halves of that 4 apart, 2 apart, 1 apart. reduce8_store sums eight vectors in the same tree, transposed. */
static inline float hsum16(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                                                   _mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}
static inline vf vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vload_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SLUICE_DECODE_SIMD "avx2"
#define VW 8
typedef __m256 vf;
#define V_SET1 _mm256_set1_ps
#define V_ZERO _mm256_setzero_ps
#define V_LOADU _mm256_loadu_ps
#define V_STOREU _mm256_storeu_ps
#define V_MUL _mm256_mul_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MAX _mm256_max_ps
#define V_FMADD _mm256_fmadd_ps
#define V_FNMADD _mm256_fnmadd_ps
#define V_ROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_POW2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), \
                                                                          _mm256_set1_epi32(127)), 23))
#define V_ZERO_BELOW(x, low, y) _mm256_andnot_ps(_mm256_cmp_ps(x, low, _CMP_LT_OQ), y)
static inline float V_HSUM(__m256 a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline float V_HMAX(__m256 a) {
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline vf vload_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vload_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* Queries (rows x query heads of one KV head) that the vector path attends in one pass over a sequence's K and V:
 * a verify step's rows read the cache once per KV head, not once per row. */
#define MAX_QUERIES 16

#ifdef SLUICE_DECODE_SIMD
#define MAX_D 256 /* head dims the vector path covers (up to MAX_D / VW vectors a row) */
#define SCORE_TILE 8  /* tokens whose scores one query computes together: eight sums, one reduction */
#define VALUE_TILE 32 /* tokens whose value rows every query of a run reads from L1 before the next tile's */
#define VALUE_TILE_ROWS VALUE_TILE

/* The eight horizontal sums of s[0..7], stored to dst[0..7], each bit for bit V_HSUM's (so a verify step's rows
 * score as its decodes do): on AVX2 the same adds in the same order, transposed across the eight vectors, where a
 * sum at a time costs a shuffle tree each. */
static inline void reduce8_store(const vf *s, float *dst) {
#if VW == 16
    /* hsum16's first add for two vectors at once: [low halves of s[2i], s[2i + 1]] + [their high halves] */
    __m512 h[4];
    for (int i = 0; i < 4; i++)
        h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xEE));
    /* its second: quarter 0 plus quarter 1 of each half, four vectors' in each result */
    const __m512 g0 = _mm512_add_ps(_mm512_shuffle_f32x4(h[0], h[1], 0x88), _mm512_shuffle_f32x4(h[0], h[1], 0xDD));
    const __m512 g1 = _mm512_add_ps(_mm512_shuffle_f32x4(h[2], h[3], 0x88), _mm512_shuffle_f32x4(h[2], h[3], 0xDD));
    /* its third (elements 0 + 2, 1 + 3 of each quarter), then its last (0 + 1): s[i]'s sum lands in quarter i % 4,
     * element 2 * (i / 4) */
    const __m512 p = _mm512_add_ps(g0, _mm512_shuffle_ps(g0, g0, 0x4E));
    const __m512 q = _mm512_add_ps(g1, _mm512_shuffle_ps(g1, g1, 0x4E));
    const __m512 pq = _mm512_shuffle_ps(p, q, 0x44);
    const __m512 t = _mm512_add_ps(pq, _mm512_shuffle_ps(pq, pq, 0xB1));
    const __m512 order = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0), t);
    _mm256_storeu_ps(dst, _mm512_castps512_ps256(order));
#else
    __m256 h[4]; /* [halves of s[2i] added | those of s[2i + 1]]: V_HSUM's first add */
    for (int i = 0; i < 4; i++)
        h[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
    /* its second, element k + 2 onto k: lanes (s0, s2 | s1, s3) and (s4, s6 | s5, s7), two sums each */
    const __m256 a = _mm256_add_ps(_mm256_shuffle_ps(h[0], h[1], 0x44), _mm256_shuffle_ps(h[0], h[1], 0xEE));
    const __m256 b = _mm256_add_ps(_mm256_shuffle_ps(h[2], h[3], 0x44), _mm256_shuffle_ps(h[2], h[3], 0xEE));
    /* its last, element 0 plus element 1: (t0, t2, t4, t6 | t1, t3, t5, t7), put in order */
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
    _mm256_storeu_ps(dst, _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
}

/* One query's scores against SCORE_TILE float K rows k[i] (V vectors each), stored to dst[0..SCORE_TILE): the
 * tile's products for each lane in the per-token order (a product, then FMAs), one reduce8_store for all eight. */
static inline __attribute__((always_inline)) void score_tile(const vf *q, const float *const *k, int64_t V,
                                                             float *dst) {
    vf s[SCORE_TILE];
    for (int64_t i = 0; i < SCORE_TILE; i++) s[i] = V_MUL(q[0], V_LOADU(k[i]));
    for (int64_t v = 1; v < V; v++)
        for (int64_t i = 0; i < SCORE_TILE; i++) s[i] = V_FMADD(q[v], V_LOADU(k[i] + VW * v), s[i]);
    reduce8_store(s, dst);
}

/* exp(x) for x <= 0 (scores less their max): x = n ln2 + r, exp(r) = 1 + r + r^2 P(r) (Cephes' expf polynomial,
 * ~1 ulp), times 2^n built in the exponent bits; below -87 it is 0, as expf's result would be subnormal or zero. */
static inline vf vexp(vf x) {
    const vf n = V_ROUND(V_MUL(x, V_SET1(1.44269504088896341f)));
    vf r = V_FNMADD(n, V_SET1(0.693359375f), x);
    r = V_FNMADD(n, V_SET1(-2.12194440e-4f), r);
    vf p = V_SET1(1.9875691500e-4f);
    p = V_FMADD(p, r, V_SET1(1.3981999507e-3f));
    p = V_FMADD(p, r, V_SET1(8.3334519073e-3f));
    p = V_FMADD(p, r, V_SET1(4.1665795894e-2f));
    p = V_FMADD(p, r, V_SET1(1.6666665459e-1f));
    p = V_FMADD(p, r, V_SET1(5.0000001201e-1f));
    p = V_FMADD(p, V_MUL(r, r), V_ADD(r, V_SET1(1.0f)));
    return V_ZERO_BELOW(x, V_SET1(-87.0f), V_MUL(p, V_POW2(n)));
}

/* A query's scores sc[0..len) become their softmax numerators exp(s - max), VW at a time and the tail one by one;
 * returns their sum. */
static inline float softmax_numerators(float *sc, int64_t len) {
    const int64_t full = len - len % VW;
    vf m = V_SET1(-INFINITY), sum = V_ZERO();
    for (int64_t t = 0; t < full; t += VW) m = V_MAX(m, V_LOADU(sc + t));
    float mx = V_HMAX(m), tail = 0.f;
    for (int64_t t = full; t < len; t++) mx = sc[t] > mx ? sc[t] : mx;
    const vf mxv = V_SET1(mx);
    for (int64_t t = 0; t < full; t += VW) {
        const vf e = vexp(V_SUB(V_LOADU(sc + t), mxv));
        V_STOREU(sc + t, e);
        sum = V_ADD(sum, e);
    }
    for (int64_t t = full; t < len; t++) tail += sc[t] = expf(sc[t] - mx);
    return V_HSUM(sum) + tail;
}
#else
#define VALUE_TILE_ROWS 1 /* the portable loop needs no tile */
#endif

/* Whether the vector path covers this head shape (else every row takes the portable loop on its own). */
static inline bool simd_covers(int64_t H, int64_t Hkv, int64_t D) {
#ifdef SLUICE_DECODE_SIMD
    return D % VW == 0 && D <= MAX_D && H / Hkv <= 8;
#else
    (void)H, (void)Hkv, (void)D;
    return false;
#endif
}

/* float32 queries and cache: sluice_paged_decode */
#define Q_T float
#define Q_LOADV vload_f32
#define Q_LOAD(x) (x)
#define Q_STORE(x) (x)
#define KV_T float
#define LOADV vload_f32
#define LOAD(x) (x)
#define STORE(x) (x)
#define NAME(f) f
#include "paged_decode_body.h"
#undef KV_T
#undef LOADV
#undef LOAD
#undef STORE
#undef NAME

/* float32 queries over a bfloat16 cache (--kv-cache-dtype bfloat16): sluice_paged_decode_f32_bf16 */
#define KV_T uint16_t
#define LOADV vload_bf16
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define NAME(f) f##_f32_bf16
#include "paged_decode_body.h"
#undef LOADV
#undef LOAD
#undef STORE
#undef NAME

/* float32 queries over a float16 cache (--kv-cache-dtype float16): sluice_paged_decode_f32_f16 */
#define LOADV vload_f16
#define LOAD(x) f16_to_float(x)
#define STORE(x) float_to_f16(x)
#define NAME(f) f##_f32_f16
#include "paged_decode_body.h"
#undef KV_T
#undef LOADV
#undef LOAD
#undef STORE
#undef Q_T
#undef Q_LOADV
#undef Q_LOAD
#undef Q_STORE
#undef NAME

/* bfloat16 queries and cache (as uint16_t bits): sluice_paged_decode_bf16 */
#define KV_T uint16_t
#define LOADV vload_bf16
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define Q_T uint16_t
#define Q_LOADV vload_bf16
#define Q_LOAD(x) bf16_to_float(x)
#define Q_STORE(x) float_to_bf16(x)
#define NAME(f) f##_bf16
#include "paged_decode_body.h"

}  // namespace

std::string paged_decode_isa() {
#ifdef SLUICE_DECODE_SIMD
    return SLUICE_DECODE_SIMD;
#else
    return "portable";
#endif
}

bool paged_decode_vector_covers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && simd_covers(num_heads, num_kv_heads, head_dim);
}

namespace {

void check_index(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
                "paged decode: ", name, " must be a contiguous int64 CPU tensor");
}

}  // namespace

PagedDecodePlan::PagedDecodePlan(at::Tensor block_tables, at::Tensor seq_lens,
                                 c10::optional<at::Tensor> slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, double scale, int64_t num_threads)
    : block_tables_(std::move(block_tables)), seq_lens_(std::move(seq_lens)), slot_mapping_(std::move(slot_mapping)),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), block_size_(block_size),
      scale_(scale), num_threads_(num_threads) {
    check_index(block_tables_, "block tables");
    check_index(seq_lens_, "sequence lengths");
    TORCH_CHECK(block_tables_.dim() == 2 && seq_lens_.dim() == 1 && seq_lens_.size(0) == block_tables_.size(0),
                "paged decode: block tables [n, blocks] and sequence lengths [n]");
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0 && block_size > 0,
                "paged decode: query heads must be a multiple of KV heads");
    if (slot_mapping_) {
        check_index(*slot_mapping_, "slot mapping");
        TORCH_CHECK(slot_mapping_->numel() == seq_lens_.size(0), "paged decode: one slot per sequence");
    }
    // The kernel walks each table row up to its sequence's length: a length past the row would read beyond it.
    const int64_t capacity = block_tables_.size(1) * block_size;
    const int64_t* lens = seq_lens_.data_ptr<int64_t>();
    for (int64_t i = 0; i < seq_lens_.size(0); ++i) {
        TORCH_CHECK(lens[i] >= 1 && lens[i] <= capacity, "paged decode: sequence length ", lens[i],
                    " outside 1..", capacity, " (its block table)");
    }
    plan_runs();
}

// Work items: consecutive rows of one sequence (a verify step's: the same table, each one token longer) are one run,
// as many as the vector path attends in a pass; runs are halved while there are fewer items than two per thread, so
// that a lone verify step's KV heads still keep every thread busy.
void PagedDecodePlan::plan_runs() {
    const int64_t group = num_heads_ / num_kv_heads_, stride = block_tables_.size(1), n = seq_lens_.size(0);
    const bool vector = simd_covers(num_heads_, num_kv_heads_, head_dim_);
    const int64_t longest = vector ? std::max<int64_t>(1, MAX_QUERIES / group) : 1;
    const int64_t* lens = seq_lens_.data_ptr<int64_t>();
    const int64_t* tables = block_tables_.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
        const int64_t blocks = (lens[i] + block_size_ - 1) / block_size_;
        const bool extends = !items_.empty() && items_.back() < longest && lens[i] == lens[i - 1] + 1 &&
                             std::equal(tables + i * stride, tables + i * stride + blocks, tables + (i - 1) * stride);
        if (extends) {
            items_.back() += 1;
        } else {
            items_.push_back(i);
            items_.push_back(1);
        }
    }
    while (static_cast<int64_t>(items_.size() / 2) * num_kv_heads_ < 2 * num_threads_) {
        size_t widest = 1;
        for (size_t j = 3; j < items_.size(); j += 2) widest = items_[j] > items_[widest] ? j : widest;
        if (items_[widest] < 2) break;
        const int64_t first = items_[widest - 1], half = items_[widest] / 2;
        items_[widest] -= half;
        items_.insert(items_.begin() + static_cast<std::ptrdiff_t>(widest) + 1, {first + items_[widest], half});
    }
}

at::Tensor PagedDecodePlan::step(const at::Tensor& query, const c10::optional<at::Tensor>& key,
                                 const c10::optional<at::Tensor>& value, at::Tensor key_cache,
                                 at::Tensor value_cache) const {
    const int64_t n = seq_lens_.size(0);
    TORCH_CHECK(key.has_value() == slot_mapping_.has_value() && key.has_value() == value.has_value(),
                "paged decode: new keys and values go with a plan that has their slots");
    const auto dtype = query.scalar_type(), cache_dtype = key_cache.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged decode: float32 or bfloat16, not ", dtype);
    const bool narrower = dtype == at::kFloat && (cache_dtype == at::kBFloat16 || cache_dtype == at::kHalf);
    TORCH_CHECK(query.device().is_cpu() && value_cache.scalar_type() == cache_dtype &&
                    (cache_dtype == dtype || narrower) && key_cache.is_contiguous() && value_cache.is_contiguous(),
                "paged decode: contiguous CPU caches of the query's dtype, or 16-bit ones under float32 queries");
    TORCH_CHECK(query.dim() == 3 && query.size(0) == n && query.size(1) == num_heads_ && query.size(2) == head_dim_,
                "paged decode: query must be [", n, ", ", num_heads_, ", ", head_dim_, "]");
    TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(1) == block_size_ && key_cache.size(2) == num_kv_heads_ &&
                    key_cache.size(3) == head_dim_ && value_cache.sizes() == key_cache.sizes(),
                "paged decode: caches must be [blocks, ", block_size_, ", ", num_kv_heads_, ", ", head_dim_, "]");
    const at::Tensor q = query.contiguous();
    at::Tensor k, v;
    if (key) {
        k = key->contiguous(), v = value->contiguous();
        TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && k.numel() == n * num_kv_heads_ * head_dim_ &&
                        v.numel() == k.numel(), "paged decode: new keys and values [n, Hkv, D] of the query's dtype");
    }
    at::Tensor out = at::empty_like(q);
    const DecodePlan plan{block_tables_.data_ptr<int64_t>(), block_tables_.size(1), seq_lens_.data_ptr<int64_t>(),
                          slot_mapping_ ? slot_mapping_->data_ptr<int64_t>() : nullptr, items_.data(),
                          static_cast<int64_t>(items_.size() / 2), n, num_heads_, num_kv_heads_,
                          head_dim_, block_size_, static_cast<float>(scale_), num_threads_};
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    int failed;
    if (dtype == at::kBFloat16) {
        failed = sluice_paged_decode_step_bf16(&plan, bits(q), key ? bits(k) : nullptr, key ? bits(v) : nullptr,
                                               bits(key_cache), bits(value_cache), bits(out));
    } else if (cache_dtype != at::kFloat) {
        auto step = cache_dtype == at::kBFloat16 ? sluice_paged_decode_step_f32_bf16 : sluice_paged_decode_step_f32_f16;
        failed = step(&plan, q.data_ptr<float>(), key ? k.data_ptr<float>() : nullptr,
                      key ? v.data_ptr<float>() : nullptr, bits(key_cache), bits(value_cache), out.data_ptr<float>());
    } else {
        failed = sluice_paged_decode_step(&plan, q.data_ptr<float>(), key ? k.data_ptr<float>() : nullptr,
                                          key ? v.data_ptr<float>() : nullptr, key_cache.data_ptr<float>(),
                                          value_cache.data_ptr<float>(), out.data_ptr<float>());
    }
    TORCH_CHECK(!failed, "paged decode: out of memory for its score buffer");
    return out;
}
