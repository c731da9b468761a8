// Weight-only int2 to int8 linear (Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, IQ4_NL or IQ4_XS
// weights, int8 activations) for calls of any size, as llama.cpp runs its Q4_1 files. Weights: per 32 inputs of an
// output row, 32 nibbles q with a float16 scale d and minimum m, element = q * d + m (Q4_0: no minimum, element
// (q - 8) d; Q4_K: each group's scale d * sc and minimum -dmin * m; Q5_0 and Q5_1: a fifth bit per code, Q5_0's
// element (q - 16) d; Q8_0: a byte per code, kept as q + 128; IQ4_NL and IQ4_XS: a nibble picks one of 16 levels;
// Q6_K and Q3_K: a scale per 16 inputs, (q - 32) and (q - 4); Q2_K: a scale and minimum per 16, codes of 2 bits; the
// policies below). Each input row is quantized per group of 32 to int8 (qx, scale dx = max|x| / 127), so
//   y[r, n] = sum_g d[n, g] dx[r, g] * sum_j q[n, 32g + j] qx[r, 32g + j]  +  sum_g m[n, g] * xsum[r, g]
// with xsum the float sum of the group's inputs (Q5_1: dx times the sum of the int8 codes, as llama.cpp's Q8_1
// activations carry it). Q4_0, Q5_0 and Q8_0 have no minimum: their codes' offset (8, 16, 128) comes off the
// integer sum as that offset times the sum of the group's activation codes, so each group costs one float
// multiply-add fewer, and the sum is llama.cpp's own, sum_j (q - 8) qx or (q - 16) qx. The inner sums are exact
// integer dot products (u8 x s8 -> s32), so every instruction set below computes the same values; only the final
// float sums may round in another order.
//
// Layout (gguf_packs.py's pack_q4_0, pack_q4_1, pack_q4_k and pack_q5_*, a permutation of the codes' nibbles):
// outputs in blocks of 16. For block b and group g there are 256 bytes, in four chunks c of 64: chunk c holds, for
// each output o of the block, the Q4_1 bytes 4c..4c+3 of row 16b + o's group g. A Q4_1 byte j holds element j (low
// nibble) and j + 16 (high nibble), so a chunk's low nibbles are inputs 4c..4c+3 of the group and its high nibbles
// inputs 16+4c..16+4c+3: four consecutive inputs per 32-bit lane, which is what vpdpbusd (or pmaddubsw + pmaddwd)
// sums against four activation bytes broadcast to every lane. One weight load thus serves 16 outputs, and scales
// come 16 at a time (Q4_1's scale and minimum: float16 [blocks, G, 16]).
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <cstring>
#include <type_traits>

#include "quant_types.h"
#include "quantize_rows.h"
#include "row_blocks.h"

// The IQ4 levels (quant_types.h) plus 128: bytes 1..241 for vpdpbusd, their 128 taken off the integer sum as Q8_0's
// is (or by i8_dot where it sums signed bytes).
constexpr std::array<uint8_t, 16> level_bytes() {
  std::array<uint8_t, 16> bytes{};
  for (int i = 0; i < 16; ++i) bytes[i] = static_cast<uint8_t>(sluice::kIq4Levels[i] + 128);
  return bytes;
}
alignas(16) constexpr std::array<uint8_t, 16> kLevelBytes = level_bytes();

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
// 16 outputs per vector, one vector per block.
#define I4_LANES 16
using ivec = __m512i;
using fvec = __m512;
inline ivec i4_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec i4_low(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline ivec i4_high(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline ivec i4_zero() { return _mm512_setzero_si512(); }
inline ivec i4_bcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline ivec i4_dot(ivec acc, ivec w, ivec x) { return _mm512_dpbusd_epi32(acc, w, x); }
// A group's sum of 4-bit codes (at most 8 products per lane), and the 32-bit sums it ends in: vpdpbusd's own.
inline ivec i4_dot_short(ivec acc, ivec w, ivec x) { return _mm512_dpbusd_epi32(acc, w, x); }
inline ivec i4_widen(ivec acc) { return acc; }
inline ivec i4_add(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec i4_set1(int32_t v) { return _mm512_set1_epi32(v); }
// Bit `from` of every byte of v, moved to bit `to` (4 or 5: a code's fifth or sixth bit): in 16-bit lanes, where
// the bit that lands in a byte's bit `to` is always that byte's own bit `from`.
inline ivec i4_bit(ivec v, int from, int to) {
  const ivec moved = from <= to ? _mm512_sll_epi16(v, _mm_cvtsi32_si128(to - from))
                                : _mm512_srl_epi16(v, _mm_cvtsi32_si128(from - to));
  return _mm512_and_si512(moved, _mm512_set1_epi8(static_cast<char>(1 << to)));
}
inline ivec i4_or(ivec a, ivec b) { return _mm512_or_si512(a, b); }
// The 2-bit codes in bits 2p, 2p + 1 of every byte of v.
inline ivec i4_crumb(ivec v, int p) {
  return _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(2 * p)), _mm512_set1_epi8(3));
}
inline ivec i8_dot(ivec acc, ivec w, ivec x) { return _mm512_dpbusd_epi32(acc, w, x); }  // w: bytes 0..255
// Nibbles 0..15 to kLevelBytes: one in-lane byte shuffle of the table, repeated in every 128-bit lane.
inline ivec i4_levels(ivec nibbles) {
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kLevelBytes.data()));
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), nibbles);
}
constexpr bool kSignedByteDot = false;  // i8_dot sums the stored bytes u = q + 128
inline fvec f_zero() { return _mm512_setzero_ps(); }
inline fvec f_set1(float v) { return _mm512_set1_ps(v); }
inline fvec f_cvt(ivec v) { return _mm512_cvtepi32_ps(v); }
inline fvec f_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline fvec f_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline fvec f_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline fvec f_fmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec f_mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline void f_store(float* p, fvec v) { _mm512_storeu_ps(p, v); }
#define I4_SIMD "avx512_vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
// 8 outputs per vector, two vectors per block. pmaddubsw's 16-bit pair sums cannot saturate: 2 * 15 * 127 < 2^15.
#define I4_LANES 8
using ivec = __m256i;
using fvec = __m256;
inline ivec i4_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec i4_low(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline ivec i4_high(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline ivec i4_zero() { return _mm256_setzero_si256(); }
inline ivec i4_bcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline ivec i4_dot(ivec acc, ivec w, ivec x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
// A group's 4-bit codes summed in pmaddubsw's 16-bit lanes, which hold 8 products per lane (8 * 2 * 15 * 128 <
// 2^15), widened to 32 bits once per group: a third of i4_dot's instructions.
inline ivec i4_dot_short(ivec acc, ivec w, ivec x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
inline ivec i4_widen(ivec acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
inline ivec i4_add(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec i4_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline ivec i4_bit(ivec v, int from, int to) {  // as the AVX-512 one
  const ivec moved = from <= to ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from))
                                : _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to));
  return _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << to)));
}
inline ivec i4_or(ivec a, ivec b) { return _mm256_or_si256(a, b); }
inline ivec i4_crumb(ivec v, int p) {  // as the AVX-512 one
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * p)), _mm256_set1_epi8(3));
}
// Bytes 0..255 against int8 would saturate pmaddubsw's pair sums (2 * 255 * 127), so the codes go back to signed
// q = u - 128 and pmaddubsw takes |q| against x with q's sign: pair sums within 2 * 128 * 127 < 2^15 (|x| <= 127).
// Half the instructions of summing each nibble apart. The sums come out as sum_j q qx, which vpdpbusd's sums of u
// reach only once 128 times the group's activation codes are taken off (Q8_0Scales::kCodeBias).
constexpr bool kSignedByteDot = true;
inline ivec i8_dot(ivec acc, ivec u, ivec x) {
  const ivec q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  const ivec pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline ivec i4_levels(ivec nibbles) {  // as the AVX-512 one
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kLevelBytes.data()));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles);
}
inline fvec f_zero() { return _mm256_setzero_ps(); }
inline fvec f_set1(float v) { return _mm256_set1_ps(v); }
inline fvec f_cvt(ivec v) { return _mm256_cvtepi32_ps(v); }
inline fvec f_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline fvec f_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline fvec f_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline fvec f_fmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec f_mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline void f_store(float* p, fvec v) { _mm256_storeu_ps(p, v); }
#define I4_SIMD "avx2"
#else
#define I4_SIMD "portable"
constexpr bool kSignedByteDot = false;
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 16;                // outputs per block
constexpr int64_t kGroupBytes = kBlock * 16;  // one group of one block: 16 outputs x 16 bytes of nibbles
// Input rows one pass over the blocks takes: each weight vector unpacked serves this many. AVX-512's 32 registers
// hold 8 rows' sums; AVX2's 16 hold 6 (past four rows each row keeps one chain), so a verify step's 1 + 4 rows take
// one pass over the weights, not a pass of four and one of one. More rows go in passes of kRowsPerTilePass over
// tiles of blocks held in cache: on AVX2 three rows a pass, whose sums fit the registers (six spill), ran batches
// of 8-64 rows faster (docs/history.md).
#if defined(I4_LANES) && I4_LANES == 16
constexpr int kRowsPerPass = 8;
constexpr int kRowsPerTilePass = 8;
#else
constexpr int kRowsPerPass = 6;
constexpr int kRowsPerTilePass = 3;
#endif
inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

using sluice::QuantizedRows;
using sluice::quantize_rows;

// Where a group's scale and minimum come from, for each of a block's 16 outputs (element = q * scale + minimum).
// Q4_1: float16 [blocks, G, 16] each.
struct Q4_1Scales {
  static constexpr bool kFifthBit = false, kSixthBit = false, kHalfScales = false, kCodeSum = false,
                        kByteCodes = false, kMinimum = true, kLevels = false, kTwoBit = false;
  static constexpr int32_t kCodeBias = 0;
  const uint16_t* d;
  const uint16_t* m;
  int64_t G;
  void prefetch(int64_t b, int64_t g) const {  // 2 bytes each where the codes take 16
    sluice::prefetch(d + (b * G + g) * kBlock + sluice::kPrefetchBytes / 16, 2 * kBlock);
    sluice::prefetch(m + (b * G + g) * kBlock + sluice::kPrefetchBytes / 16, 2 * kBlock);
  }
#ifdef I4_LANES
  fvec scale(int64_t b, int64_t g, int h) const { return f_half(d + (b * G + g) * kBlock + h * I4_LANES); }
  fvec minimum(int64_t b, int64_t g, int h) const { return f_half(m + (b * G + g) * kBlock + h * I4_LANES); }
#endif
  float scale_at(int64_t b, int64_t g, int64_t o) const { return half_to_float(d[(b * G + g) * kBlock + o]); }
  float minimum_at(int64_t b, int64_t g, int64_t o) const { return half_to_float(m[(b * G + g) * kBlock + o]); }
};

// Where the float16 d (which 0) or -dmin (which 1) of block b's group g lies, in supers [blocks, G / 8, 2, 16]
// (Q4_K, Q5_K and Q2_K: one pair per 256 inputs).
inline const uint16_t* d_dmin_at(const uint16_t* supers, int64_t b, int64_t g, int64_t G, int which) {
  return supers + ((b * (G / 8) + g / 8) * 2 + which) * kBlock;
}

// Q4_K and Q5_K as the file has them: per group a 6-bit scale and minimum (Q4_K: uint8 [blocks, G, 2, 16]; Q5_K:
// uint8 [blocks, G, 96], the codes' fifth bits in Q5_0's order [16, 4], then the scales and minimums [2, 16]), per
// eight groups a float16 d and -dmin ([blocks, G / 8, 2, 16]); scale = d * sc, minimum = -dmin * m.
template <bool Five>
struct KScales {
  static constexpr bool kFifthBit = Five, kSixthBit = false, kHalfScales = false, kCodeSum = false,
                        kByteCodes = false, kMinimum = true, kLevels = false, kTwoBit = false;
  static constexpr int32_t kCodeBias = 0;
  static constexpr int64_t kGroupHigh = Five ? 96 : 32;
  const uint8_t* sm;
  const uint16_t* super;
  int64_t G;
  const uint8_t* fifth_bits(int64_t b, int64_t g) const { return sm + (b * G + g) * kGroupHigh; }
  const uint8_t* six_bit(int64_t b, int64_t g, int which) const {
    return fifth_bits(b, g) + (Five ? 4 * kBlock : 0) + which * kBlock;
  }
  const uint16_t* supers(int64_t b, int64_t g, int which) const { return d_dmin_at(super, b, g, G, which); }
  void prefetch(int64_t b, int64_t g) const {  // Q4_K: 2 bytes where the codes take 16; Q5_K: 6
    sluice::prefetch(fifth_bits(b, g) + sluice::kPrefetchBytes * kGroupHigh / 256, kGroupHigh);
  }
#ifdef I4_LANES
  fvec scale(int64_t b, int64_t g, int h) const {
    return f_mul(f_u8(six_bit(b, g, 0) + h * I4_LANES), f_half(supers(b, g, 0) + h * I4_LANES));
  }
  fvec minimum(int64_t b, int64_t g, int h) const {
    return f_mul(f_u8(six_bit(b, g, 1) + h * I4_LANES), f_half(supers(b, g, 1) + h * I4_LANES));
  }
#endif
  float scale_at(int64_t b, int64_t g, int64_t o) const {
    return static_cast<float>(six_bit(b, g, 0)[o]) * half_to_float(supers(b, g, 0)[o]);
  }
  float minimum_at(int64_t b, int64_t g, int64_t o) const {
    return static_cast<float>(six_bit(b, g, 1)[o]) * half_to_float(supers(b, g, 1)[o]);
  }
  int low_upper(int64_t b, int64_t g, int64_t o, int c, int t) const { return fifth_bits(b, g)[o * 4 + t] >> c & 1; }
  int high_upper(int64_t b, int64_t g, int64_t o, int c, int t) const {
    return fifth_bits(b, g)[o * 4 + t] >> (4 + c) & 1;
  }
};
using Q4_KScales = KScales<false>;
using Q5_KScales = KScales<true>;

// Q5_0 and Q5_1: Q4_1's nibbles with a fifth bit per code, uint8 [blocks, G, 16, 4]: output o's four bytes of a
// group line up with its four code bytes of each chunk c, byte t holding in bit c the fifth bit of input 4c + t
// (chunk c's low nibble) and in bit 4 + c that of input 16 + 4c + t (its high nibble). Q5_0: element = (q - 16) d,
// d float16 [blocks, G, 16], the 16 off the integer sum; Q5_1 (WithMinimum): element = q d + m, d and m float16
// [blocks, G, 2, 16].
template <bool WithMinimum>
struct Q5Scales {
  static constexpr bool kFifthBit = true, kSixthBit = false, kHalfScales = false, kCodeSum = true,
                        kByteCodes = false, kMinimum = WithMinimum, kLevels = false, kTwoBit = false;
  static constexpr int32_t kCodeBias = WithMinimum ? 0 : 16;
  static constexpr int64_t kHalves = WithMinimum ? 2 : 1;
  const uint8_t* fifth;
  const uint16_t* dm;
  int64_t G;
  const uint8_t* fifth_bits(int64_t b, int64_t g) const { return fifth + (b * G + g) * kBlock * 4; }
  const uint16_t* at(int64_t b, int64_t g) const { return dm + (b * G + g) * kHalves * kBlock; }
  void prefetch(int64_t b, int64_t g) const {  // 4 + 2 (+ 2) bytes where the codes take 16
    sluice::prefetch(fifth_bits(b, g) + sluice::kPrefetchBytes / 4, 4 * kBlock);
    sluice::prefetch(at(b, g) + sluice::kPrefetchBytes / 16 * kHalves, 2 * kHalves * kBlock);
  }
#ifdef I4_LANES
  fvec scale(int64_t b, int64_t g, int h) const { return f_half(at(b, g) + h * I4_LANES); }
  fvec minimum(int64_t b, int64_t g, int h) const { return f_half(at(b, g) + kBlock + h * I4_LANES); }
#endif
  float scale_at(int64_t b, int64_t g, int64_t o) const { return half_to_float(at(b, g)[o]); }
  float minimum_at(int64_t b, int64_t g, int64_t o) const { return half_to_float(at(b, g)[kBlock + o]); }
  // The bits above the nibble (here the fifth) of output o's code byte t of chunk c: its low nibble's, its high one's.
  int low_upper(int64_t b, int64_t g, int64_t o, int c, int t) const { return fifth_bits(b, g)[o * 4 + t] >> c & 1; }
  int high_upper(int64_t b, int64_t g, int64_t o, int c, int t) const {
    return fifth_bits(b, g)[o * 4 + t] >> (4 + c) & 1;
  }
};

// One float16 scale d per group and output, [blocks, G, 16], and no minimum: the codes' offset comes off the integer
// sum (that offset times the group's activation codes), so a group costs two float operations, not Q4_1's three.
template <bool ByteCodes, int32_t CodeBias, bool Levels = false>
struct ScaleOnly {
  static constexpr bool kFifthBit = false, kSixthBit = false, kHalfScales = false, kCodeSum = true,
                        kByteCodes = ByteCodes, kMinimum = false, kLevels = Levels, kTwoBit = false;
  static constexpr int32_t kCodeBias = CodeBias;
  const uint16_t* d;
  int64_t G;
  void prefetch(int64_t b, int64_t g) const {  // 2 bytes where the codes take 16 (bytes: 32)
    sluice::prefetch(d + (b * G + g) * kBlock + sluice::kPrefetchBytes / (ByteCodes ? 32 : 16), 2 * kBlock);
  }
#ifdef I4_LANES
  fvec scale(int64_t b, int64_t g, int h) const { return f_half(d + (b * G + g) * kBlock + h * I4_LANES); }
#endif
  float scale_at(int64_t b, int64_t g, int64_t o) const { return half_to_float(d[(b * G + g) * kBlock + o]); }
};

// Q4_0: Q4_1's nibbles, element = (q - 8) d.
using Q4_0Scales = ScaleOnly<false, 8>;

// Q8_0, packed as the nibbles are but a byte per code (8 chunks of 4 inputs per group: 512 bytes per group of a
// block; pack_q8_0): u = q + 128 as uint8 for vpdpbusd, element = (u - 128) d; the 128 comes off the integer sum,
// where i8_dot has not taken it off already.
using Q8_0Scales = ScaleOnly<true, kSignedByteDot ? 0 : 128>;

// IQ4_NL: Q4_0's nibbles, each the index of a level (kLevelBytes: level + 128), element = level * d; the 128 as
// Q8_0's.
using IQ4_NLScales = ScaleOnly<false, kSignedByteDot ? 0 : 128, true>;

// Q6_K and Q3_K: element = d * sc * (q - offset), with a signed 8-bit sc per 16 inputs (a group's low nibbles, then
// its high ones) and a float16 d per 256 inputs; each half's offset comes off its integer sum: the offset times the
// sum of that half's activation codes (`xsum`, [G, 2] a row). Q6_K (SixBits): codes of 6 bits less 32, per group
// uint8 [blocks, G, 160]: the codes' bit 4 and bit 5 in two planes of Q5's fifth-bit order ([16, 4] each), then sc
// [2, 16]. Q3_K: codes of 3 bits less 4, held in the nibbles (their fourth bit clear), per group int8 sc [2, 16].
// d float16 [blocks, G / 8, 16].
template <bool SixBits>
struct HalfScales {
  static constexpr bool kFifthBit = SixBits, kSixthBit = SixBits, kHalfScales = true, kCodeSum = true,
                        kByteCodes = false, kMinimum = false, kLevels = false, kTwoBit = false;
  static constexpr int32_t kCodeBias = 0;  // the half offset instead, in the half-scale branch
  static constexpr int32_t kHalfOffset = SixBits ? 32 : 4;
  static constexpr int64_t kGroupHigh = SixBits ? 160 : 32;
  const uint8_t* high;
  const uint16_t* d;
  int64_t G;
  const uint8_t* fifth_bits(int64_t b, int64_t g) const { return high + (b * G + g) * kGroupHigh; }
  const uint8_t* sixth_bits(int64_t b, int64_t g) const { return fifth_bits(b, g) + kBlock * 4; }
  const int8_t* sub_scales(int64_t b, int64_t g, int half) const {
    return reinterpret_cast<const int8_t*>(fifth_bits(b, g) + (SixBits ? 2 * kBlock * 4 : 0)) + half * kBlock;
  }
  const uint16_t* super(int64_t b, int64_t g) const { return d + (b * (G / 8) + g / 8) * kBlock; }
  void prefetch(int64_t b, int64_t g) const {  // Q6_K: 10 bytes where the codes take 16; Q3_K: 2
    sluice::prefetch(fifth_bits(b, g) + sluice::kPrefetchBytes / 16 * (kGroupHigh / 16), kGroupHigh);
  }
#ifdef I4_LANES
  fvec half_scale(int64_t b, int64_t g, int h, int half) const {
    return f_mul(f_i8(sub_scales(b, g, half) + h * I4_LANES), f_half(super(b, g) + h * I4_LANES));
  }
#endif
  float half_scale_at(int64_t b, int64_t g, int64_t o, int half) const {
    return static_cast<float>(sub_scales(b, g, half)[o]) * half_to_float(super(b, g)[o]);
  }
  int low_upper(int64_t b, int64_t g, int64_t o, int c, int t) const {
    return (fifth_bits(b, g)[o * 4 + t] >> c & 1) | (sixth_bits(b, g)[o * 4 + t] >> c & 1) << 1;
  }
  int high_upper(int64_t b, int64_t g, int64_t o, int c, int t) const {
    return (fifth_bits(b, g)[o * 4 + t] >> (4 + c) & 1) | (sixth_bits(b, g)[o * 4 + t] >> (4 + c) & 1) << 1;
  }
};
using Q6_KScales = HalfScales<true>;
using Q3_KScales = HalfScales<false>;

// Q2_K: codes of 2 bits, element = d * sc * q - dmin * m with a 4-bit sc and m per 16 inputs (a group's first 16,
// then its last 16) and a float16 d and dmin per 256. The codes lie four to a byte: chunk c of a group (c = 0, 1)
// holds in bits 2p, 2p + 1 of its lane's byte t the code of input 16c + 4p + t, so chunk 0 sums into the first half's
// chain and chunk 1 into the second's. Per group uint8 [blocks, G, 2, 2, 16]: sc of each half, then m; d and -dmin
// float16 [blocks, G / 8, 2, 16]. Each half's minimum multiplies dx times that half's activation codes' sum (`xsum`).
struct Q2_KScales {
  static constexpr bool kFifthBit = false, kSixthBit = false, kHalfScales = true, kCodeSum = true,
                        kByteCodes = false, kMinimum = true, kLevels = false, kTwoBit = true;
  static constexpr int32_t kCodeBias = 0, kHalfOffset = 0;
  const uint8_t* sm;
  const uint16_t* super;
  int64_t G;
  const uint8_t* at(int64_t b, int64_t g, int which, int half) const {
    return sm + (b * G + g) * 4 * kBlock + (2 * which + half) * kBlock;
  }
  const uint16_t* supers(int64_t b, int64_t g, int which) const { return d_dmin_at(super, b, g, G, which); }
  void prefetch(int64_t b, int64_t g) const {  // 4 bytes where the codes take 8
    sluice::prefetch(at(b, g, 0, 0) + sluice::kPrefetchBytes / 2, 4 * kBlock);
  }
#ifdef I4_LANES
  fvec half_scale(int64_t b, int64_t g, int h, int half) const {
    return f_mul(f_u8(at(b, g, 0, half) + h * I4_LANES), f_half(supers(b, g, 0) + h * I4_LANES));
  }
  fvec half_minimum(int64_t b, int64_t g, int h, int half) const {
    return f_mul(f_u8(at(b, g, 1, half) + h * I4_LANES), f_half(supers(b, g, 1) + h * I4_LANES));
  }
#endif
  float half_scale_at(int64_t b, int64_t g, int64_t o, int half) const {
    return static_cast<float>(at(b, g, 0, half)[o]) * half_to_float(supers(b, g, 0)[o]);
  }
  float half_minimum_at(int64_t b, int64_t g, int64_t o, int half) const {
    return static_cast<float>(at(b, g, 1, half)[o]) * half_to_float(supers(b, g, 1)[o]);
  }
};

// IQ4_XS: Q4_0's nibbles, each the index of a level (kLevelBytes: level + 128), element = d * sc * level with a
// signed sc per group (int8 [blocks, G, 16], the file's 6-bit scale less 32) and a float16 d per 256 inputs
// ([blocks, G / 8, 16]). The levels' 128 comes off the integer sum as Q8_0's does.
struct IQ4_XSScales {
  static constexpr bool kFifthBit = false, kSixthBit = false, kHalfScales = false, kCodeSum = true,
                        kByteCodes = false, kMinimum = false, kLevels = true, kTwoBit = false;
  static constexpr int32_t kCodeBias = kSignedByteDot ? 0 : 128;
  const int8_t* sc;
  const uint16_t* d;
  int64_t G;
  const uint16_t* super(int64_t b, int64_t g) const { return d + (b * (G / 8) + g / 8) * kBlock; }
  void prefetch(int64_t b, int64_t g) const {  // 1 byte where the codes take 16
    sluice::prefetch(sc + (b * G + g) * kBlock + sluice::kPrefetchBytes / 16, kBlock);
  }
#ifdef I4_LANES
  fvec scale(int64_t b, int64_t g, int h) const {
    return f_mul(f_i8(sc + (b * G + g) * kBlock + h * I4_LANES), f_half(super(b, g) + h * I4_LANES));
  }
#endif
  float scale_at(int64_t b, int64_t g, int64_t o) const {
    return static_cast<float>(sc[(b * G + g) * kBlock + o]) * half_to_float(super(b, g)[o]);
  }
};

// Input rows a tile pass takes. The half-scale types keep two chains a row at any count: past 6 rows their sums,
// scales and codes outgrow AVX-512's 32 registers (8 rows took 1.6-1.8x Q4_K's time on a 256-row prefill, 6 rows
// 1.3-1.6x).
template <class Scales>
constexpr int tile_rows() {
  return Scales::kHalfScales ? std::min(kRowsPerTilePass, 6) : kRowsPerTilePass;
}

// Bytes of one group of one block: 16 outputs x 16 bytes of nibbles, 32 bytes of codes, or 8 of 2-bit codes.
template <class Scales>
constexpr int64_t group_bytes() {
  return Scales::kByteCodes ? 2 * kGroupBytes : Scales::kTwoBit ? kGroupBytes / 2 : kGroupBytes;
}

// Outputs of blocks [b0, b1) for Rows input rows; y rows are N apart, and the last block may reach past N. The
// rows' groups come interleaved (quantize_rows' row_block): group g of row r is group g * Rows + r of qx, dx,
// xsum ([.., 2] for Q6_K) and codes (the sum of each group's activation codes), so each group of all the rows lies
// at one address and the compiler keeps one pointer, not one per row.
template <int Rows, class Scales>
void rows_dot(const int8_t* qx, const float* dx, const float* xsum, const int32_t* codes, int64_t K,
              const uint8_t* qs, const Scales& scales, int64_t b0, int64_t b1, float* y, int64_t N) {
  const int64_t G = K / kGroup;
  const auto at = [](int r, int64_t g) { return g * Rows + r; };
  constexpr int64_t kStride = group_bytes<Scales>();
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* qblock = qs + b * G * kStride;
    float out[Rows][kBlock];
#ifdef I4_LANES
    constexpr int kVecs = kBlock / I4_LANES;
    // Codes of 4 bits sum a group in i4_dot_short's narrow lanes; levels are bytes, summed as Q8_0's codes are.
    constexpr bool kShort = !Scales::kFifthBit && !Scales::kByteCodes && !Scales::kLevels;
    // Sums per row: low and high nibbles (Q8_0: chunks 0-3 and 4-7) apart, so each group's chain is half as long,
    // up to four rows; more rows are chains enough. AVX2's narrow sums add in one cycle and need no second.
    // Q6_K keeps them apart at any row count: each half has its own scale.
    constexpr int kChains = Scales::kHalfScales || (Rows <= 4 && !(kShort && kVecs == 2)) ? 2 : 1;
    // AVX2's block is two vectors wide. Past two rows their sums outgrow its 16 registers, so each half walks the
    // groups in turn, the second from cache; at one or two rows one walk keeps the weight stream busy.
    constexpr int kWalks = Rows > 2 ? kVecs : 1, kPer = kVecs / kWalks;
    // A group's integer sums: narrow for 4-bit codes, widened once per group; 32-bit for wider codes.
    const auto dot = [](ivec acc, ivec w, ivec x) {
      if constexpr (kShort) return i4_dot_short(acc, w, x);
      else if constexpr (Scales::kLevels) return i8_dot(acc, w, x);
      else return i4_dot(acc, w, x);
    };
    const auto widen = [](ivec acc) {
      if constexpr (kShort) return i4_widen(acc);
      else return acc;
    };
    for (int walk = 0; walk < kWalks; ++walk) {
      const int h0 = walk * kPer;  // this walk's first vector of the block: vector h0 + j is its j-th
      fvec total[Rows][kPer];
      for (int r = 0; r < Rows; ++r)
        for (int j = 0; j < kPer; ++j) total[r][j] = f_zero();
      for (int64_t g = 0; g < G; ++g) {
        if (walk == 0) {  // the codes and the scales stream ahead
          sluice::prefetch(qblock + g * kStride + sluice::kPrefetchBytes, kStride);
          scales.prefetch(b, g);
        }
        ivec acc[kChains][Rows][kPer];
        for (int s = 0; s < kChains; ++s)
          for (int r = 0; r < Rows; ++r)
            for (int j = 0; j < kPer; ++j) acc[s][r][j] = i4_zero();
        auto& lo = acc[0];
        auto& hi = acc[kChains - 1];
        for (int c = 0; c < 8 && Scales::kByteCodes; ++c) {  // a byte per code: inputs 4c..4c+3 per lane
          for (int j = 0; j < kPer; ++j) {
            const ivec w = i4_load(qblock + g * kStride + c * 64 + (h0 + j) * I4_LANES * 4);
            for (int r = 0; r < Rows; ++r) {
              ivec& sum = c < 4 ? lo[r][j] : hi[r][j];  // chains of four, as the nibbles'
              sum = i8_dot(sum, w, i4_bcast(qx + at(r, g) * kGroup + 4 * c));
            }
          }
        }
        for (int j = 0; j < kPer && Scales::kTwoBit; ++j) {  // 2-bit codes: chunk c holds inputs 16c..16c+15
          const ivec v_lo = i4_load(qblock + g * kStride + (h0 + j) * I4_LANES * 4);
          const ivec v_hi = i4_load(qblock + g * kStride + 64 + (h0 + j) * I4_LANES * 4);
          for (int p = 0; p < 4; ++p) {
            const ivec wl = i4_crumb(v_lo, p), wh = i4_crumb(v_hi, p);
            for (int r = 0; r < Rows; ++r) {
              const int8_t* xg = qx + at(r, g) * kGroup;
              lo[r][j] = dot(lo[r][j], wl, i4_bcast(xg + 4 * p));
              hi[r][j] = dot(hi[r][j], wh, i4_bcast(xg + 16 + 4 * p));
            }
          }
        }
        for (int c = 0; c < 4 && !Scales::kByteCodes && !Scales::kTwoBit; ++c) {
          for (int j = 0; j < kPer; ++j) {
            const int h = h0 + j;
            const ivec v = i4_load(qblock + g * kStride + c * 64 + h * I4_LANES * 4);
            ivec wl = i4_low(v), wh = i4_high(v);
            if constexpr (Scales::kFifthBit) {
              const ivec fifth = i4_load(scales.fifth_bits(b, g) + h * I4_LANES * 4);
              wl = i4_or(wl, i4_bit(fifth, c, 4));
              wh = i4_or(wh, i4_bit(fifth, 4 + c, 4));
            }
            if constexpr (Scales::kSixthBit) {
              const ivec sixth = i4_load(scales.sixth_bits(b, g) + h * I4_LANES * 4);
              wl = i4_or(wl, i4_bit(sixth, c, 5));
              wh = i4_or(wh, i4_bit(sixth, 4 + c, 5));
            }
            if constexpr (Scales::kLevels) {
              wl = i4_levels(wl);
              wh = i4_levels(wh);
            }
            for (int r = 0; r < Rows; ++r) {
              const int8_t* xg = qx + at(r, g) * kGroup;
              lo[r][j] = dot(lo[r][j], wl, i4_bcast(xg + 4 * c));
              hi[r][j] = dot(hi[r][j], wh, i4_bcast(xg + 16 + 4 * c));
            }
          }
        }
        if constexpr (Scales::kHalfScales) {
          // Per row: the halves' sums at their scales (and the halves' minimums at their code sums), then dx once.
          for (int j = 0; j < kPer; ++j) {
            const int h = h0 + j;
            const fvec d_lo = scales.half_scale(b, g, h, 0), d_hi = scales.half_scale(b, g, h, 1);
            fvec m_lo = d_lo, m_hi = d_hi;  // read only where there are minimums
            if constexpr (Scales::kMinimum) {
              m_lo = scales.half_minimum(b, g, h, 0);
              m_hi = scales.half_minimum(b, g, h, 1);
            }
            for (int r = 0; r < Rows; ++r) {
              const float* offsets = xsum + at(r, g) * 2;  // this group's halves' code sums
              constexpr int32_t kOffset = Scales::kHalfOffset;
              ivec sum_lo = widen(lo[r][j]), sum_hi = widen(hi[r][j]);
              if constexpr (kOffset != 0) {
                sum_lo = i4_add(sum_lo, i4_set1(-kOffset * static_cast<int32_t>(offsets[0])));
                sum_hi = i4_add(sum_hi, i4_set1(-kOffset * static_cast<int32_t>(offsets[1])));
              }
              fvec part = f_fmadd(f_cvt(sum_hi), d_hi, f_mul(f_cvt(sum_lo), d_lo));
              if constexpr (Scales::kMinimum) {
                part = f_fmadd(m_lo, f_set1(offsets[0]), part);
                part = f_fmadd(m_hi, f_set1(offsets[1]), part);
              }
              total[r][j] = f_fmadd(part, f_set1(dx[at(r, g)]), total[r][j]);
            }
          }
        } else {
          for (int j = 0; j < kPer; ++j) {
            const int h = h0 + j;
            const fvec dg = scales.scale(b, g, h);
            fvec mg;
            if constexpr (Scales::kMinimum) mg = scales.minimum(b, g, h);
            for (int r = 0; r < Rows; ++r) {
              ivec sum = widen(lo[r][j]);
              if constexpr (kChains == 2) sum = i4_add(sum, widen(hi[r][j]));
              if constexpr (Scales::kCodeBias != 0) sum = i4_add(sum, i4_set1(-Scales::kCodeBias * codes[at(r, g)]));
              total[r][j] = f_fmadd(f_cvt(sum), f_mul(dg, f_set1(dx[at(r, g)])), total[r][j]);
              if constexpr (Scales::kMinimum) total[r][j] = f_fmadd(mg, f_set1(xsum[at(r, g)]), total[r][j]);
            }
          }
        }
      }
      for (int r = 0; r < Rows; ++r)
        for (int j = 0; j < kPer; ++j) f_store(out[r] + (h0 + j) * I4_LANES, total[r][j]);
    }
#else
    for (int r = 0; r < Rows; ++r) {
      for (int64_t o = 0; o < kBlock; ++o) {
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const int8_t* xg = qx + at(r, g) * kGroup;
          int32_t dot[2] = {0, 0};  // inputs 0..15 of the group, 16..31
          for (int c = 0; c < 8 && Scales::kByteCodes; ++c) {
            const uint8_t* w = qblock + g * kStride + c * 64 + o * 4;
            for (int t = 0; t < 4; ++t) dot[c / 4] += w[t] * xg[4 * c + t];
          }
          for (int c = 0; c < 2 && Scales::kTwoBit; ++c) {
            const uint8_t* w = qblock + g * kStride + c * 64 + o * 4;
            for (int p = 0; p < 4; ++p)
              for (int t = 0; t < 4; ++t) dot[c] += (w[t] >> (2 * p) & 3) * xg[16 * c + 4 * p + t];
          }
          for (int c = 0; c < 4 && !Scales::kByteCodes && !Scales::kTwoBit; ++c) {
            const uint8_t* w = qblock + g * kStride + c * 64 + o * 4;
            for (int t = 0; t < 4; ++t) {
              int low = w[t] & 0x0F, high = w[t] >> 4;
              if constexpr (Scales::kFifthBit) {
                low |= scales.low_upper(b, g, o, c, t) << 4;
                high |= scales.high_upper(b, g, o, c, t) << 4;
              }
              if constexpr (Scales::kLevels) {
                low = kLevelBytes[low];
                high = kLevelBytes[high];
              }
              dot[0] += low * xg[4 * c + t];
              dot[1] += high * xg[16 + 4 * c + t];
            }
          }
          if constexpr (Scales::kHalfScales) {
            const float* offsets = xsum + at(r, g) * 2;
            float sum[2];
            for (int half = 0; half < 2; ++half)
              sum[half] = static_cast<float>(dot[half] - Scales::kHalfOffset * static_cast<int32_t>(offsets[half]));
            float part = std::fma(sum[1], scales.half_scale_at(b, g, o, 1), sum[0] * scales.half_scale_at(b, g, o, 0));
            if constexpr (Scales::kMinimum) {
              for (int half = 0; half < 2; ++half)
                part = std::fma(scales.half_minimum_at(b, g, o, half), offsets[half], part);
            }
            total = std::fma(part, dx[at(r, g)], total);
          } else {
            const int32_t sum = dot[0] + dot[1] - Scales::kCodeBias * codes[at(r, g)];
            total = std::fma(static_cast<float>(sum), scales.scale_at(b, g, o) * dx[at(r, g)], total);
            if constexpr (Scales::kMinimum) total = std::fma(scales.minimum_at(b, g, o), xsum[at(r, g)], total);
          }
        }
        out[r][o] = total;
      }
    }
#endif
    const int64_t n0 = b * kBlock, width = std::min(kBlock, N - n0);
    // A whole block's copy has a constant size, which the compiler turns into a vector store: a call to memcpy per
    // row and block took a hundredth of a prefill.
    for (int r = 0; r < Rows; ++r) {
      if (width == kBlock) std::memcpy(y + r * N + n0, out[r], sizeof(out[r]));
      else std::memcpy(y + r * N + n0, out[r], width * sizeof(float));
    }
  }
}

}  // namespace

namespace {

// The sum of each 16 activation codes (exact in a float), [M, K / 16]: Q6_K's offsets, one per scale.
std::unique_ptr<float[]> code_sums_by_half(const int8_t* q, int64_t M, int64_t K) {
  std::unique_ptr<float[]> sums(new float[M * K / 16]);
  at::parallel_for(0, M * K / 16, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int32_t total = 0;
      for (int l = 0; l < 16; ++l) total += q[i * 16 + l];
      sums[i] = static_cast<float>(total);
    }
  });
  return sums;
}

// Checks x and the codes, quantizes x and runs rows_dot over every block with the scales `make(blocks, G)` builds.
template <class MakeScales>
at::Tensor packed_linear(const char* name, const at::Tensor& x, const at::Tensor& qs, int64_t N, MakeScales make) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": x float32 [M, K]");
  const int64_t K = x.size(1), G = K / kGroup, blocks = (N + kBlock - 1) / kBlock;
  TORCH_CHECK(K % kGroup == 0, name, ": K must be a multiple of 32");
  const auto scales = make(blocks, G);
  using Scales = std::decay_t<decltype(scales)>;
  constexpr int64_t chunks = group_bytes<Scales>() / 64;
  TORCH_CHECK(N > 0 && qs.scalar_type() == at::kByte && qs.dim() == 5 && qs.size(0) == blocks && qs.size(1) == G &&
                  qs.size(2) == chunks && qs.size(3) == kBlock && qs.size(4) == 4 && qs.is_contiguous(),
              name, ": qs uint8 [ceil(N / 16), K / 32, ", chunks, ", 16, 4], contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  // One pass over the weights, or passes over tiles of them: the rows come interleaved per block of that path's
  // rows (rows_dot), so this one choice decides both.
  const bool one_pass = M <= kRowsPerPass;
  constexpr int kTileRows = tile_rows<Scales>();
  const QuantizedRows qx = quantize_rows(xc.data_ptr<float>(), M, K, one_pass ? kRowsPerPass : kTileRows);
  std::unique_ptr<float[]> half_sums;
  if constexpr (Scales::kHalfScales) half_sums = code_sums_by_half(qx.q.get(), M, K);
  const float* sums = Scales::kHalfScales ? half_sums.get() : Scales::kCodeSum ? qx.code_sum.get() : qx.sum.get();
  const int64_t sums_per_row = Scales::kHalfScales ? 2 * G : G;
  at::Tensor y = at::empty({M, N}, xc.options());
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const auto rows_over = [&](auto rows, int64_t r, int64_t b0, int64_t b1) {
    rows_dot<rows>(qx.q.get() + r * K, qx.scale.get() + r * G, sums + r * sums_per_row, qx.codes.get() + r * G, K, qp,
                   scales, b0, b1, yp + r * N, N);
  };
  if (M == 0) return y;
  // Four blocks (64 outputs) at least per thread: below that, forking costs more than it saves.
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    if (one_pass) {
      sluice::with_rows<kRowsPerPass>(M, [&](auto rows) { rows_over(rows, 0, b0, b1); });
    } else {  // the weights stream from memory once, a tile at a time, and each pass reads the tile from cache
      sluice::for_each_tile<kTileRows>(M, b0, b1, G * group_bytes<Scales>(), rows_over);
    }
  });
  return y;
}

bool has_shape(const at::Tensor& t, at::ScalarType type, std::initializer_list<int64_t> shape) {
  return t.scalar_type() == type && t.sizes().equals(shape) && t.is_contiguous();
}

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& minimum, int64_t N) {
  return packed_linear("int4_linear", x, qs, N, [&](int64_t blocks, int64_t G) {
    for (const at::Tensor* t : {&scale, &minimum}) {
      TORCH_CHECK(has_shape(*t, at::kHalf, {blocks, G, kBlock}),
                  "int4_linear: scale and minimum float16 [ceil(N / 16), K / 32, 16], contiguous");
    }
    return Q4_1Scales{reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()),
                      reinterpret_cast<const uint16_t*>(minimum.data_ptr<at::Half>()), G};
  });
}

namespace {

// The kernel on a type of one float16 scale per group and output (ScaleOnly): scale [ceil(N / 16), K / 32, 16].
template <class Scales>
at::Tensor scale_only_linear(const char* name, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                             int64_t N) {
  return packed_linear(name, x, qs, N, [&](int64_t blocks, int64_t G) {
    TORCH_CHECK(has_shape(scale, at::kHalf, {blocks, G, kBlock}), name,
                ": scale float16 [ceil(N / 16), K / 32, 16], contiguous");
    return Scales{reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()), G};
  });
}

}  // namespace

at::Tensor q4_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, int64_t N) {
  return scale_only_linear<Q4_0Scales>("q4_0_linear", x, qs, scale, N);
}

at::Tensor iq4_nl_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, int64_t N) {
  return scale_only_linear<IQ4_NLScales>("iq4_nl_linear", x, qs, scale, N);
}

at::Tensor q4_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales_mins,
                       const at::Tensor& supers, int64_t N) {
  return packed_linear("q4_k_linear", x, qs, N, [&](int64_t blocks, int64_t G) {
    TORCH_CHECK(G % 8 == 0, "q4_k_linear: K must be a multiple of 256");
    TORCH_CHECK(has_shape(scales_mins, at::kByte, {blocks, G, 2, kBlock}) &&
                    has_shape(supers, at::kHalf, {blocks, G / 8, 2, kBlock}),
                "q4_k_linear: scales_mins uint8 [ceil(N / 16), K / 32, 2, 16], supers float16 "
                "[ceil(N / 16), K / 256, 2, 16], contiguous");
    return Q4_KScales{scales_mins.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()),
                      G};
  });
}

at::Tensor q5_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& high_scales_mins,
                       const at::Tensor& supers, int64_t N) {
  return packed_linear("q5_k_linear", x, qs, N, [&](int64_t blocks, int64_t G) {
    TORCH_CHECK(G % 8 == 0, "q5_k_linear: K must be a multiple of 256");
    TORCH_CHECK(has_shape(high_scales_mins, at::kByte, {blocks, G, Q5_KScales::kGroupHigh}) &&
                    has_shape(supers, at::kHalf, {blocks, G / 8, 2, kBlock}),
                "q5_k_linear: high_scales_mins uint8 [ceil(N / 16), K / 32, 96], supers float16 "
                "[ceil(N / 16), K / 256, 2, 16], contiguous");
    return Q5_KScales{high_scales_mins.data_ptr<uint8_t>(),
                      reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()), G};
  });
}

at::Tensor iq4_xs_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                         const at::Tensor& supers, int64_t N) {
  return packed_linear("iq4_xs_linear", x, qs, N, [&](int64_t blocks, int64_t G) {
    TORCH_CHECK(G % 8 == 0, "iq4_xs_linear: K must be a multiple of 256");
    TORCH_CHECK(has_shape(scales, at::kChar, {blocks, G, kBlock}) &&
                    has_shape(supers, at::kHalf, {blocks, G / 8, kBlock}),
                "iq4_xs_linear: scales int8 [ceil(N / 16), K / 32, 16], supers float16 [ceil(N / 16), K / 256, 16], "
                "contiguous");
    return IQ4_XSScales{scales.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()), G};
  });
}

namespace {

template <bool WithMinimum>
at::Tensor q5_linear(const char* name, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& fifth,
                     const at::Tensor& dm, int64_t N) {
  return packed_linear(name, x, qs, N, [&](int64_t blocks, int64_t G) {
    TORCH_CHECK(has_shape(fifth, at::kByte, {blocks, G, kBlock, 4}), name,
                ": fifth uint8 [ceil(N / 16), K / 32, 16, 4], contiguous");
    const bool shaped = WithMinimum ? has_shape(dm, at::kHalf, {blocks, G, 2, kBlock})
                                    : has_shape(dm, at::kHalf, {blocks, G, kBlock});
    TORCH_CHECK(shaped, name, WithMinimum ? ": scale_min float16 [ceil(N / 16), K / 32, 2, 16], contiguous"
                                          : ": scale float16 [ceil(N / 16), K / 32, 16], contiguous");
    return Q5Scales<WithMinimum>{fifth.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()),
                                 G};
  });
}

}  // namespace

at::Tensor q5_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& fifth, const at::Tensor& scale,
                       int64_t N) {
  return q5_linear<false>("q5_0_linear", x, qs, fifth, scale, N);
}

at::Tensor q5_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& fifth,
                       const at::Tensor& scale_min, int64_t N) {
  return q5_linear<true>("q5_1_linear", x, qs, fifth, scale_min, N);
}

at::Tensor q8_0_packed_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, int64_t N) {
  return scale_only_linear<Q8_0Scales>("q8_0_packed_linear", x, qs, scale, N);
}

at::Tensor q6_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& high_scales,
                       const at::Tensor& supers, int64_t N) {
  return packed_linear("q6_k_linear", x, qs, N, [&](int64_t blocks, int64_t G) {
    TORCH_CHECK(G % 8 == 0, "q6_k_linear: K must be a multiple of 256");
    TORCH_CHECK(has_shape(high_scales, at::kByte, {blocks, G, Q6_KScales::kGroupHigh}) &&
                    has_shape(supers, at::kHalf, {blocks, G / 8, kBlock}),
                "q6_k_linear: high_scales uint8 [ceil(N / 16), K / 32, 160], supers float16 [ceil(N / 16), K / 256, "
                "16], contiguous");
    return Q6_KScales{high_scales.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()),
                      G};
  });
}

at::Tensor q3_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& supers,
                       int64_t N) {
  return packed_linear("q3_k_linear", x, qs, N, [&](int64_t blocks, int64_t G) {
    TORCH_CHECK(G % 8 == 0, "q3_k_linear: K must be a multiple of 256");
    TORCH_CHECK(has_shape(scales, at::kChar, {blocks, G, 2, kBlock}) &&
                    has_shape(supers, at::kHalf, {blocks, G / 8, kBlock}),
                "q3_k_linear: scales int8 [ceil(N / 16), K / 32, 2, 16], supers float16 [ceil(N / 16), K / 256, 16], "
                "contiguous");
    return Q3_KScales{reinterpret_cast<const uint8_t*>(scales.data_ptr<int8_t>()),
                      reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()), G};
  });
}

at::Tensor q2_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales_mins,
                       const at::Tensor& supers, int64_t N) {
  return packed_linear("q2_k_linear", x, qs, N, [&](int64_t blocks, int64_t G) {
    TORCH_CHECK(G % 8 == 0, "q2_k_linear: K must be a multiple of 256");
    TORCH_CHECK(has_shape(scales_mins, at::kByte, {blocks, G, 2, 2, kBlock}) &&
                    has_shape(supers, at::kHalf, {blocks, G / 8, 2, kBlock}),
                "q2_k_linear: scales_mins uint8 [ceil(N / 16), K / 32, 2, 2, 16], supers float16 [ceil(N / 16), "
                "K / 256, 2, 16], contiguous");
    return Q2_KScales{scales_mins.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()),
                      G};
  });
}

std::string int4_linear_isa() { return I4_SIMD; }
