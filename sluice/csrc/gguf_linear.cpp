// Linears on GGUF's own blocks, read in place, and the table of the quant types (kQuantTypes, at the end: one row per
// type naming its kernels, the C++ mirror of service/executor/layers/quant_types.py). A weight is uint8 [N, row_bytes],
// each row its K / QK blocks exactly as the file stores them. Every block unpacks in registers to integer codes q
// (int8), a scale per 16 inputs and an offset per 32, so that element i = scale[i / 16] * q[i] + offset[i / 32] for
// every type (Q4_K: scale = d * sc, offset = -dmin * m; IQ4_NL: q a level of its table; Q2_K: an offset per 16).
//
// stored_linear (few rows, decoding; the engine runs the types with a packed layout in int4_linear.cpp instead): each
// input row is quantized per 32 inputs to int8 (qx, dx = max|x| / 127), as llama.cpp quantizes activations, so
//   y[r, n] = sum_g dx[r, g] * (sum_{i in g} scale[i / 16] q[i] qx[r, i])
//             + offset[g] * dx[r, g] * sum_{i in g} qx[r, i]
// where the inner sums are exact integer dot products (u8 x s8 -> s32 with the sign trick), one per 16 inputs'
// scale. A block is unpacked once and used for up to kRowsPerPass rows.
// stored_dequantize (many rows): the float rows of the weight, for a tile of a prefill GEMM.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "quant_types.h"
#include "quantize_rows.h"
#include "row_blocks.h"
#include "simd.h"

namespace {

constexpr int64_t kGroup = 32;
// Weight rows a pass of every input row block walks: their bytes stay in L1/L2 (16 rows of a 2,048-input Q4_K
// weight: 18 KiB) while each block of input rows reads them again.
constexpr int64_t kTileRows = 16;
// Input rows per pass over a weight row, each unpacked block serving them all: AVX-512VL's 32 vector registers hold
// 8 rows' sums (AVX2's 16, 4).
#if defined(__AVX512VL__)
constexpr int kRowsPerPass = 8;
#else
constexpr int kRowsPerPass = 4;
#endif

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef SLUICE_AVX2
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// A 32-element block's 16 bytes of nibbles to q: element j the low nibble of byte j, element j + 16 its high
// nibble; each ORed with high[j] (Q5's fifth bits, or nullptr) and less `bias`. In one vector where built for AVX2
// (a scalar loop of 16 here costs as much as the block's whole dot product).
inline void unpack_nibbles(const uint8_t* qs, const uint8_t* high, int bias, int8_t* q) {
#ifdef SLUICE_AVX2
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  __m256i all = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
  if (high != nullptr) all = _mm256_or_si256(all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)));
  all = _mm256_sub_epi8(all, _mm256_set1_epi8(static_cast<char>(bias)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), all);
#else
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 15) | (high ? high[j] : 0)) - bias);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (high ? high[j + 16] : 0)) - bias);
  }
#endif
}

// One block unpacked: codes, a scale per 16 elements, an offset per 32 (per 16 where the type says kHalfOffsets).
template <int QK>
struct Unpacked {
  alignas(64) int8_t q[QK];
  float scale[QK / 16];
  float offset[QK / 16];
};

// Whether a type's offsets come per 16 elements (Q2_K's minimums), not per 32.
template <class F, class = void>
struct HalfOffsets : std::false_type {};
template <class F>
struct HalfOffsets<F, std::void_t<decltype(F::kHalfOffsets)>> : std::true_type {};

struct Q4_0 {
  static constexpr int kQK = 32, kBytes = 18;
  static void unpack(const uint8_t* b, Unpacked<32>& u) {
    unpack_nibbles(b + 2, nullptr, 8, u.q);
    u.scale[0] = u.scale[1] = f16(b);
    u.offset[0] = 0.f;
  }
};

struct Q4_1 {
  static constexpr int kQK = 32, kBytes = 20;
  static void unpack(const uint8_t* b, Unpacked<32>& u) {
    unpack_nibbles(b + 4, nullptr, 0, u.q);
    u.scale[0] = u.scale[1] = f16(b);
    u.offset[0] = f16(b + 2);
  }
};

#ifdef SLUICE_AVX2
// Bit j of the 32-bit `bits` as byte j of a vector: 0xFF where set, 0 where clear (each byte picks its source
// byte of `bits` by shuffle, then tests its own bit).
inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
#endif

// Q5_0 and Q5_1: the fifth bit of element j is bit j of the 32-bit qh.
template <bool kMin>
struct Q5 {
  static constexpr int kQK = 32, kBytes = kMin ? 24 : 22;
  static void unpack(const uint8_t* b, Unpacked<32>& u) {
    const int head = kMin ? 4 : 2;
    uint32_t qh;
    std::memcpy(&qh, b + head, 4);
    alignas(32) uint8_t high[32];
#ifdef SLUICE_AVX2
    _mm256_store_si256(reinterpret_cast<__m256i*>(high), _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(16)));
#else
    for (int j = 0; j < 32; ++j) high[j] = static_cast<uint8_t>(((qh >> j) & 1) << 4);
#endif
    unpack_nibbles(b + head + 4, high, kMin ? 0 : 16, u.q);
    u.scale[0] = u.scale[1] = f16(b);
    u.offset[0] = kMin ? f16(b + 2) : 0.f;
  }
};

struct Q8_0 {
  static constexpr int kQK = 32, kBytes = 34;
  static void unpack(const uint8_t* b, Unpacked<32>& u) {
    std::memcpy(u.q, b + 2, 32);
    u.scale[0] = u.scale[1] = f16(b);
    u.offset[0] = 0.f;
  }
};

// 16 bytes of nibbles (Q4_0's order) to the 32 levels (sluice::kIq4Levels) they pick: one byte shuffle per half where
// built for AVX2.
inline void unpack_levels(const uint8_t* qs, int8_t* q) {
#ifdef SLUICE_AVX2
  const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sluice::kIq4Levels));
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(15);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_shuffle_epi8(levels, _mm_and_si128(v, mask)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(v, 4), mask)));
#else
  for (int j = 0; j < 16; ++j) {
    q[j] = sluice::kIq4Levels[qs[j] & 15];
    q[j + 16] = sluice::kIq4Levels[qs[j] >> 4];
  }
#endif
}

// IQ4_NL: d and 16 bytes of nibbles laid out as Q4_0's, each nibble the index of one of the 16 levels.
struct IQ4_NL {
  static constexpr int kQK = 32, kBytes = 18;
  static void unpack(const uint8_t* b, Unpacked<32>& u) {
    unpack_levels(b + 2, u.q);
    u.scale[0] = u.scale[1] = f16(b);
    u.offset[0] = 0.f;
  }
};

// IQ4_XS: IQ4_NL's levels in super-blocks of 256: d (float16), scales_h (uint16: group g's high two bits at bit 2g),
// scales_l[4] (group g's low nibble in byte g / 2 at bit 4 (g % 2)), then each group's 16 bytes of nibbles. Element
// = d * (sc - 32) * level.
struct IQ4_XS {
  static constexpr int kQK = 256, kBytes = 136;
  static void unpack(const uint8_t* b, Unpacked<256>& u) {
    const float d = f16(b);
    uint16_t scales_h;
    std::memcpy(&scales_h, b + 2, 2);
    for (int g = 0; g < 8; ++g) {
      unpack_levels(b + 8 + 16 * g, u.q + 32 * g);
      const int sc = ((b[4 + g / 2] >> (4 * (g % 2))) & 15) | (((scales_h >> (2 * g)) & 3) << 4);
      u.scale[2 * g] = u.scale[2 * g + 1] = d * static_cast<float>(sc - 32);
      u.offset[g] = 0.f;
    }
  }
};

// Q4_K and Q5_K: eight sub-blocks of 32, each a 6-bit scale and minimum packed into 12 bytes.
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

template <bool kFive>
struct QK4 {
  static constexpr int kQK = 256, kBytes = kFive ? 176 : 144;
  static void unpack(const uint8_t* b, Unpacked<256>& u) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (kFive ? 48 : 16);
    for (int j = 0; j < 4; ++j) {
#ifdef SLUICE_AVX2
      // 32 bytes: elements 64j + l in the low nibbles, 64j + 32 + l in the high ones (the fifth bits in qh's bits
      // 2j and 2j + 1); 16-bit shifts are safe, the masks drop what crosses into the next byte.
      const __m256i mask = _mm256_set1_epi8(15);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      if (kFive) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
        const __m256i sixteen = _mm256_set1_epi8(16);
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h, 2 * j), 4), sixteen));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h, 2 * j + 1), 4), sixteen));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(u.q + 64 * j), lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(u.q + 64 * j + 32), hi);
#else
      for (int l = 0; l < 32; ++l) {
        int lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
        if (kFive) {
          lo |= ((qh[l] >> (2 * j)) & 1) << 4;
          hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
        }
        u.q[64 * j + l] = static_cast<int8_t>(lo);
        u.q[64 * j + 32 + l] = static_cast<int8_t>(hi);
      }
#endif
    }
    for (int s = 0; s < 8; ++s) {
      int sc, m;
      scale_min_k4(s, scales, sc, m);
      u.scale[2 * s] = u.scale[2 * s + 1] = d * static_cast<float>(sc);
      u.offset[s] = -(dmin * static_cast<float>(m));
    }
  }
};

struct Q6_K {
  static constexpr int kQK = 256, kBytes = 210;
  static void unpack(const uint8_t* b, Unpacked<256>& u) {
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int n = 0; n < 2; ++n) {
      const uint8_t* ql = b + 64 * n;
      const uint8_t* qh = b + 128 + 32 * n;
      int8_t* q = u.q + 128 * n;
#ifdef SLUICE_AVX2
      // Four runs of 32: the low then high nibbles of ql's two halves, each with two bits of qh (bits 2k, 2k + 1
      // for run k) as bits 4-5. 16-bit shifts are safe, the masks drop what crosses into the next byte.
      const __m256i mask = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      const __m256i runs[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, mask), _mm256_and_si256(_mm256_slli_epi16(h, 4), top)),
          _mm256_or_si256(_mm256_and_si256(l1, mask), _mm256_and_si256(_mm256_slli_epi16(h, 2), top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), mask), _mm256_and_si256(h, top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), mask),
                          _mm256_and_si256(_mm256_srli_epi16(h, 2), top))};
      for (int k = 0; k < 4; ++k)
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * k), _mm256_sub_epi8(runs[k], bias));
#else
      for (int l = 0; l < 32; ++l) {
        q[l] = static_cast<int8_t>(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
        q[l + 32] = static_cast<int8_t>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
        q[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        q[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
#endif
    }
    for (int s = 0; s < 16; ++s) u.scale[s] = d * static_cast<float>(sc[s]);
    for (int s = 0; s < 8; ++s) u.offset[s] = 0.f;
  }
};

// Q2_K: scales[16] (each 16 elements' 4-bit scale in the low nibble, their minimum in the high one), qs[64] (element
// 32 i + l's code at bit 2 (i % 4) of qs[32 (i / 4) + l]), d and dmin (float16). Element = d * sc * q - dmin * m.
struct Q2_K {
  static constexpr int kQK = 256, kBytes = 84;
  static constexpr bool kHalfOffsets = true;
  static void unpack(const uint8_t* b, Unpacked<256>& u) {
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int i = 0; i < 8; ++i)
      for (int l = 0; l < 32; ++l) u.q[32 * i + l] = static_cast<int8_t>(b[16 + 32 * (i / 4) + l] >> (2 * (i % 4)) & 3);
    for (int s = 0; s < 16; ++s) {
      u.scale[s] = d * static_cast<float>(b[s] & 15);
      u.offset[s] = -(dmin * static_cast<float>(b[s] >> 4));
    }
  }
};

// Q3_K: hmask[32] (input 32 i + l's third bit in bit i of byte l; a clear bit subtracts 4), qs[64] (its low two bits
// at bit 2 (i % 4) of byte 32 (i / 4) + l), scales[12] (sixteen 6-bit scales: s's low nibble in byte s % 8 at bit
// 4 (s / 8), its high two bits in byte 8 + s % 4 at bit 2 (s / 4)), d (float16). Element = d * (sc - 32) * q, q in
// -4..3.
struct Q3_K {
  static constexpr int kQK = 256, kBytes = 110;
  static void unpack(const uint8_t* b, Unpacked<256>& u) {
    const uint8_t* hmask = b;
    const uint8_t* qs = b + 32;
    const uint8_t* sc = b + 96;
    const float d = f16(b + 108);
    for (int i = 0; i < 8; ++i) {
      for (int l = 0; l < 32; ++l) {
        const int low = (qs[32 * (i / 4) + l] >> (2 * (i % 4))) & 3, third = (hmask[l] >> i) & 1;
        u.q[32 * i + l] = static_cast<int8_t>(low + 4 * third - 4);
      }
    }
    for (int s = 0; s < 16; ++s) {
      const int scale = ((sc[s % 8] >> (4 * (s / 8))) & 15) | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4);
      u.scale[s] = d * static_cast<float>(scale - 32);
    }
    for (int s = 0; s < 8; ++s) u.offset[s] = 0.f;
  }
};

using sluice::QuantizedRows;
using sluice::quantize_rows;

// Group s's offsets times its inputs (codes xq, scale dx; sx = dx times the codes' sum): one offset per 32, or per 16.
template <class F, int QK>
float offset_term(const Unpacked<QK>& u, int s, const int8_t* xq, float dx, float sx) {
  if constexpr (HalfOffsets<F>::value) {
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < 16; ++j) {
      lo += xq[j];
      hi += xq[16 + j];
    }
    return dx * (u.offset[2 * s] * static_cast<float>(lo) + u.offset[2 * s + 1] * static_cast<float>(hi));
  } else {
    return u.offset[s] * sx;
  }
}

template <class F, int Rows>
void rows_dot(const QuantizedRows& x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
              int64_t m, float* y, int64_t N) {
  constexpr int kGroups = F::kQK / kGroup;
  const int64_t G = K / kGroup, blocks = K / F::kQK;
  const int8_t* qx = x.q.get() + m * K;
  const float* dx = x.scale.get() + m * G;
  const float* sx = x.code_sum.get() + m * G;
  Unpacked<F::kQK> u;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float offsets[Rows] = {};
#ifdef SLUICE_AVX2
    __m256 acc[Rows];
    for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
#else
    float acc[Rows] = {};
#endif
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * F::kBytes;
      sluice::prefetch(block + sluice::kPrefetchBytes, F::kBytes);
      F::unpack(block, u);
      for (int s = 0; s < kGroups; ++s) {
        const int64_t g = b * kGroups + s;
#ifdef SLUICE_AVX2
        // |w| (u8) times x carrying w's sign (s8): the products of w * x, summed four bytes to a 32-bit lane, so
        // lanes 0-3 hold the first 16 inputs and 4-7 the second (hence one scale per half).
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.q + s * kGroup));
        const __m256i wabs = _mm256_sign_epi8(wv, wv);
        const __m256 sv = _mm256_setr_m128(_mm_set1_ps(u.scale[2 * s]), _mm_set1_ps(u.scale[2 * s + 1]));
        for (int r = 0; r < Rows; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + g * kGroup));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
          const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(xv, wv));
#else
          const __m256i dot =
              _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)), _mm256_set1_epi16(1));
#endif
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sv, _mm256_set1_ps(dx[r * G + g])), acc[r]);
          offsets[r] += offset_term<F>(u, s, qx + r * K + g * kGroup, dx[r * G + g], sx[r * G + g]);
        }
#else
        const int8_t* wq = u.q + s * kGroup;
        for (int r = 0; r < Rows; ++r) {
          const int8_t* xq = qx + r * K + g * kGroup;
          int32_t lo = 0, hi = 0;
          for (int j = 0; j < 16; ++j) lo += wq[j] * xq[j];
          for (int j = 16; j < 32; ++j) hi += wq[j] * xq[j];
          acc[r] += dx[r * G + g] * (u.scale[2 * s] * lo + u.scale[2 * s + 1] * hi);
          offsets[r] += offset_term<F>(u, s, xq, dx[r * G + g], sx[r * G + g]);
        }
#endif
      }
    }
    for (int r = 0; r < Rows; ++r) {
#ifdef SLUICE_AVX2
      y[r * N + n] = sluice::hsum(acc[r]) + offsets[r];
#else
      y[r * N + n] = acc[r] + offsets[r];
#endif
    }
  }
}

template <class F>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, float* out) {
  Unpacked<F::kQK> u;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < K / F::kQK; ++b) {
      F::unpack(w + n * row_bytes + b * F::kBytes, u);
      float* o = out + n * K + b * F::kQK;
#ifdef SLUICE_AVX2
      for (int i = 0; i < F::kQK; i += 8) {
        const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u.q + i));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
        const float offset = u.offset[HalfOffsets<F>::value ? i / 16 : i / 32];
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(q, _mm256_set1_ps(u.scale[i / 16]), _mm256_set1_ps(offset)));
      }
#else
      for (int i = 0; i < F::kQK; ++i)
        o[i] = u.scale[i / 16] * static_cast<float>(u.q[i]) + u.offset[HalfOffsets<F>::value ? i / 16 : i / 32];
#endif
    }
  }
}

template <class F>
void check_blocks(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_linear: blocks uint8 [N, row_bytes], contiguous");
  TORCH_CHECK(K % F::kQK == 0 && w.size(1) == K / F::kQK * F::kBytes, "gguf_linear: ", K,
              " inputs do not match rows of ", w.size(1), " bytes of ", F::kQK, "-input blocks of ", F::kBytes);
}

template <class F>
at::Tensor stored_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gguf_linear: x float32 [M, K]");
  const int64_t K = x.size(1), N = w.size(0);
  check_blocks<F>(w, K);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  const QuantizedRows qx = quantize_rows(xc.data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, xc.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, N, kTileRows, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {
      const int64_t t1 = std::min(n1, t0 + kTileRows);
      sluice::for_each_row_block<kRowsPerPass>(M, [&](auto rows, int64_t m) {
        rows_dot<F, rows>(qx, K, wp, row_bytes, t0, t1, m, yp + m * N, N);
      });
    }
  });
  return y;
}

template <class F>
at::Tensor stored_dequantize(const at::Tensor& w, int64_t K) {
  check_blocks<F>(w, K);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) { dequantize_rows<F>(wp, row_bytes, K, n0, n1, op); });
  return out;
}

// A packed kernel of two buffers (codes, scale) in the table's three-buffer shape.
template <at::Tensor (*Kernel)(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>
at::Tensor two_buffers(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor&, int64_t n) {
  return Kernel(x, a, b, n);
}

template <class F>
constexpr sluice::QuantTraits row(const char* name, int64_t id, sluice::PackedLinear packed = nullptr) {
  return {name, id, F::kQK, F::kBytes, stored_linear<F>, stored_dequantize<F>, packed};
}

// One row per type, by GGML id (gguf.GGMLQuantizationType's values), as quant_types.py's QUANT_TYPES.
constexpr sluice::QuantTraits kQuantTypes[] = {
    row<Q4_0>("Q4_0", 2, two_buffers<q4_0_linear>),
    row<Q4_1>("Q4_1", 3, int4_linear),
    row<Q5<false>>("Q5_0", 6, q5_0_linear),
    row<Q5<true>>("Q5_1", 7, q5_1_linear),
    row<Q8_0>("Q8_0", 8, two_buffers<q8_0_packed_linear>),
    row<Q2_K>("Q2_K", 10, q2_k_linear),
    row<Q3_K>("Q3_K", 11, q3_k_linear),
    row<QK4<false>>("Q4_K", 12, q4_k_linear),
    row<QK4<true>>("Q5_K", 13, q5_k_linear),
    row<Q6_K>("Q6_K", 14, q6_k_linear),
    row<IQ4_NL>("IQ4_NL", 20, two_buffers<iq4_nl_linear>),
    row<IQ4_XS>("IQ4_XS", 23, iq4_xs_linear),
};

}  // namespace

const sluice::QuantTraits& sluice::quant_traits(int64_t id) {
  const QuantTraits* found = nullptr;
  for (const QuantTraits& t : kQuantTypes)
    if (t.id == id) found = &t;
  TORCH_CHECK(found != nullptr, "no kernels for GGML type ", id);
  return *found;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  return sluice::quant_traits(type).stored_linear(x, w);
}

at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t K) {
  return sluice::quant_traits(type).stored_dequantize(w, K);
}

at::Tensor quant_linear(const at::Tensor& x, int64_t type, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor& c, int64_t N) {
  const sluice::QuantTraits& t = sluice::quant_traits(type);
  TORCH_CHECK(t.packed_linear != nullptr, "quant_linear: ", t.name, " has no packed kernel");
  return t.packed_linear(x, a, b, c, N);
}

std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, bool>> quant_types() {
  std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, bool>> rows;
  for (const sluice::QuantTraits& t : kQuantTypes)
    rows.emplace_back(t.name, t.id, t.block_size, t.block_bytes, t.packed_linear != nullptr);
  return rows;
}
