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

/* float32: sluice_paged_decode */
#define KV_T float
#define LOAD(x) (x)
#define STORE(x) (x)
#define NAME(f) f
#include "paged_decode_body.h"
#undef KV_T
#undef LOAD
#undef STORE
#undef NAME

/* bfloat16 (as uint16_t bits): sluice_paged_decode_bf16 */
#define KV_T uint16_t
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define NAME(f) f##_bf16
#include "paged_decode_body.h"
