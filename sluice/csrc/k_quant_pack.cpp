// Q2_K, Q3_K, Q4_K, Q5_K and Q6_K rows as a file stores them regrouped for int4_linear.cpp's q2_k_linear to
// q6_k_linear: gguf_packs.py's pack_q2_k to pack_q6_k in one pass each (the torch versions stay the reference and the
// fallback; tests/executor/layers/test_packed_types.py holds the two to the same bytes). Rows past N read as zero
// blocks, as the torch versions pad them.
//
// A Q4_K block (ggml's block_q4_K, 144 bytes): d, dmin (float16), scales[12] (eight 6-bit scales and minimums, as
// gguf_blocks.k4_scales reads them), qs[128] (weight 32 g + l in the low nibble of qs[32 (g / 2) + l] for even g, the
// high one for odd g). Packed as int4_linear.cpp's nibbles, scales_mins [P, G, 2, 16] and supers [P, nb, 2, 16]
// (d and -dmin, the sign bit flipped). A Q5_K block (176 bytes) adds qh[32] (bit i of qh[l]: weight 32 i + l's fifth
// bit) before its qs; packed as Q4_K's with the fifth bits ahead of each group's scales and minimums.
//
// A Q6_K block (ggml's block_q6_K, 210 bytes): ql[128], qh[64], scales[16] (int8, one per 16 weights), d (float16);
// weight 128 n + 32 i + l has its low nibble in ql[64 n + 32 (i % 2) + l] (the high nibble where i >= 2) and its two
// high bits at bit 2i of qh[32 n + l]. The packed layout is int4_linear.cpp's (Q6_KScales).
//
// A Q3_K block (ggml's block_q3_K, 110 bytes): hmask[32] (bit i of hmask[l]: weight 32 i + l's third bit), qs[64]
// (its low two bits at bit 2 (i % 4) of qs[32 (i / 4) + l]), scales[12] (sixteen 6-bit scales, gguf_blocks.q3_k_fields
// reads them), d (float16). Packed as the codes q + 4 in int4_linear.cpp's nibbles, each 16 inputs' scale less 32 as
// int8 [P, G, 2, 16] and d [P, nb, 16] (Q3_KScales).
//
// A Q2_K block (ggml's block_q2_K, 84 bytes): scales[16] (each 16 weights' 4-bit scale in the low nibble, minimum in
// the high one), qs[64] (weight 32 i + l's code at bit 2 (i % 4) of qs[32 (i / 4) + l]), d, dmin (float16). Packed as
// four codes a byte [P, G, 2, 16, 4], the scales and minimums [P, G, 2, 2, 16] and d, -dmin [P, nb, 2, 16]
// (Q2_KScales).
#include "cpu_ops.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kRows = 16, kGroup = 32, kSuper = 256, kQ6KBytes = 210, kQ4KBytes = 144, kQ5KBytes = 176,
                  kQ3KBytes = 110, kQ2KBytes = 84, kGroupsPerSuper = 8;

// A block's 256 six-bit codes in weight order.
void codes_of(const uint8_t* b, uint8_t* codes) {
#if defined(SLUICE_AVX2)
  const __m256i nibble = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(3);
  for (int n = 0; n < 2; ++n) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
    for (int i = 0; i < 4; ++i) {  // 16-bit shifts, then a byte mask: no bit crosses into the byte it lands in
      const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32 * (i % 2)));
      const __m256i low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (i / 2))), nibble);
      const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i)), pair);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 128 * n + 32 * i),
                          _mm256_or_si256(low, _mm256_slli_epi16(high, 4)));
    }
  }
#else
  for (int e = 0; e < kSuper; ++e) {
    const int n = e / 128, i = e % 128 / 32, l = e % 32;
    const uint8_t low = b[64 * n + 32 * (i % 2) + l] >> (4 * (i / 2)) & 15;
    codes[e] = uint8_t(low | ((b[128 + 32 * n + l] >> (2 * i)) & 3) << 4);
  }
#endif
}

// Byte t of one bit plane of a group in int4_linear.cpp's order: in bit c, bit `bit` of src[4c + t] (input 4c + t's),
// in bit 4 + c that of src[16 + 4c + t].
uint8_t plane_byte(const uint8_t* src, int bit, int t) {
  uint8_t byte = 0;
  for (int half = 0; half < 2; ++half)
    for (int chunk = 0; chunk < 4; ++chunk)
      byte |= uint8_t((src[16 * half + 4 * chunk + t] >> bit & 1) << (4 * half + chunk));
  return byte;
}

// fn(o, s, b) for each row o of pack p and each super-block s of it: b its block's bytes, a zero block past row N.
template <int64_t kBytes, class Fn>
void for_each_block(const uint8_t* data, int64_t N, int64_t nb, int64_t p, Fn fn) {
  static const uint8_t kZero[kBytes] = {};
  for (int64_t o = 0; o < kRows; ++o) {
    const int64_t row = p * kRows + o;
    for (int64_t s = 0; s < nb; ++s) fn(o, s, row < N ? data + (row * nb + s) * kBytes : kZero);
  }
}

// Row o's d and -dmin (float16 at d_dmin and d_dmin + 2; -dmin by its sign bit) of super-block s of pack p, in
// supers [P, nb, 2, 16] (Q4_K, Q5_K, Q2_K).
void store_d_dmin(uint16_t* supers, int64_t nb, int64_t p, int64_t s, int64_t o, const uint8_t* d_dmin) {
  uint16_t d, dmin;
  std::memcpy(&d, d_dmin, 2);
  std::memcpy(&dmin, d_dmin + 2, 2);
  supers[((p * nb + s) * 2 + 0) * kRows + o] = d;
  supers[((p * nb + s) * 2 + 1) * kRows + o] = uint16_t(dmin ^ 0x8000);
}

// Row o's 32 codes of one group, code(j) for input j (each below 16), as int4_linear.cpp's nibbles: byte t of chunk c
// holds input 4c + t in its low nibble and input 16 + 4c + t in its high one.
template <class Code>
void store_nibbles(uint8_t* nib, int64_t o, Code code) {
  for (int chunk = 0; chunk < 4; ++chunk)
    for (int t = 0; t < 4; ++t) {
      const int j = 4 * chunk + t;
      nib[(chunk * kRows + o) * 4 + t] = uint8_t(code(j) | code(16 + j) << 4);
    }
}

// Pack p's 16 rows of Q6_K.
void pack_q6_k_rows(const uint8_t* data, int64_t N, int64_t nb, int64_t p, uint8_t* nibbles, uint8_t* high_scales,
                    uint16_t* supers) {
  const int64_t G = nb * kGroupsPerSuper;
  uint8_t codes[kSuper];
  for_each_block<kQ6KBytes>(data, N, nb, p, [&](int64_t o, int64_t s, const uint8_t* b) {
    codes_of(b, codes);
    std::memcpy(&supers[(p * nb + s) * kRows + o], b + 208, 2);
    for (int64_t gs = 0; gs < kGroupsPerSuper; ++gs) {
      const int64_t g = s * kGroupsPerSuper + gs;
      const uint8_t* c = codes + gs * kGroup;
      uint8_t* nib = nibbles + (p * G + g) * 4 * kRows * 4;  // [4 chunks][16 rows][4 bytes]
      uint8_t* planes = high_scales + (p * G + g) * 160;     // [2 planes][16 rows][4 bytes], then [2][16] scales
#if defined(SLUICE_AVX2) && defined(__BMI2__)
      // Bit 4 + plane of the 32 codes as one mask (bit k: code k), and plane byte t its bits t, t + 4, ..., t + 28.
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
      const uint32_t masks[2] = {uint32_t(_mm256_movemask_epi8(_mm256_slli_epi16(v, 3))),
                                 uint32_t(_mm256_movemask_epi8(_mm256_slli_epi16(v, 2)))};
      const __m256i low = _mm256_and_si256(v, _mm256_set1_epi8(15));
      const __m128i bytes = _mm_or_si128(_mm256_castsi256_si128(low),
                                         _mm_slli_epi16(_mm256_extracti128_si256(low, 1), 4));
      alignas(16) uint32_t words[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(words), bytes);
      for (int chunk = 0; chunk < 4; ++chunk) std::memcpy(nib + (chunk * kRows + o) * 4, &words[chunk], 4);
      for (int plane = 0; plane < 2; ++plane)
        for (int t = 0; t < 4; ++t)
          planes[(plane * kRows + o) * 4 + t] = uint8_t(_pext_u32(masks[plane], 0x11111111u << t));
#else
      store_nibbles(nib, o, [&](int j) { return c[j] & 15; });
      for (int plane = 0; plane < 2; ++plane)
        for (int t = 0; t < 4; ++t) planes[(plane * kRows + o) * 4 + t] = plane_byte(c, 4 + plane, t);
#endif
      for (int half = 0; half < 2; ++half) planes[128 + half * kRows + o] = b[192 + 2 * gs + half];
    }
  });
}

// Pack p's 16 rows of Q4_K, or of Q5_K (Five: its fifth bits, bit gs of qh[l] for weight 32 gs + l, go ahead of each
// group's scales and minimums in pack_q5_0's order).
template <bool Five>
void pack_k4_rows(const uint8_t* data, int64_t N, int64_t nb, int64_t p, uint8_t* nibbles, uint8_t* per_group,
                  uint16_t* supers) {
  constexpr int64_t kBytes = Five ? kQ5KBytes : kQ4KBytes, kGroupBytes = Five ? 96 : 32, kScalesAt = Five ? 64 : 0;
  const int64_t G = nb * kGroupsPerSuper;
  for_each_block<kBytes>(data, N, nb, p, [&](int64_t o, int64_t s, const uint8_t* b) {
    store_d_dmin(supers, nb, p, s, o, b);
    const uint8_t* sc = b + 4;
    for (int64_t gs = 0; gs < kGroupsPerSuper; ++gs) {
      const int64_t g = s * kGroupsPerSuper + gs;
      uint8_t* group = per_group + (p * G + g) * kGroupBytes;
      group[kScalesAt + o] = gs < 4 ? sc[gs] & 63 : (sc[4 + gs] & 15) | ((sc[gs - 4] >> 2) & 48);
      group[kScalesAt + kRows + o] = gs < 4 ? sc[4 + gs] & 63 : (sc[4 + gs] >> 4) | ((sc[gs] >> 2) & 48);
      const uint8_t* qs = b + (Five ? 48 : 16) + 32 * (gs / 2);
      const int shift = 4 * (gs % 2);
      uint8_t* nib = nibbles + (p * G + g) * 4 * kRows * 4;  // [4 chunks][16 rows][4 bytes]
      store_nibbles(nib, o, [&](int j) { return qs[j] >> shift & 15; });
      for (int t = 0; t < 4 && Five; ++t) group[o * 4 + t] = plane_byte(b + 16, int(gs), t);
    }
  });
}

// Pack p's 16 rows of Q3_K.
void pack_q3_k_rows(const uint8_t* data, int64_t N, int64_t nb, int64_t p, uint8_t* nibbles, uint8_t* scales,
                    uint16_t* supers) {
  const int64_t G = nb * kGroupsPerSuper;
  for_each_block<kQ3KBytes>(data, N, nb, p, [&](int64_t o, int64_t s, const uint8_t* b) {
    const uint8_t* sc = b + 96;
    std::memcpy(&supers[(p * nb + s) * kRows + o], b + 108, 2);
    for (int64_t gs = 0; gs < kGroupsPerSuper; ++gs) {
      const int64_t g = s * kGroupsPerSuper + gs;
      const uint8_t* qs = b + 32 + 32 * (gs / 4);
      uint8_t* nib = nibbles + (p * G + g) * 4 * kRows * 4;  // [4 chunks][16 rows][4 bytes]
      store_nibbles(nib, o, [&](int l) { return (qs[l] >> (2 * (gs % 4)) & 3) | (b[l] >> gs & 1) << 2; });
      for (int half = 0; half < 2; ++half) {
        const int64_t i = 2 * gs + half;  // the scale of inputs 16 i .. 16 i + 15
        const int scale = (sc[i % 8] >> (4 * (i / 8)) & 15) | (sc[8 + i % 4] >> (2 * (i / 4)) & 3) << 4;
        scales[((p * G + g) * 2 + half) * kRows + o] = uint8_t(scale - 32);  // int8's bits
      }
    }
  });
}

// Pack p's 16 rows of Q2_K.
void pack_q2_k_rows(const uint8_t* data, int64_t N, int64_t nb, int64_t p, uint8_t* codes, uint8_t* scales_mins,
                    uint16_t* supers) {
  const int64_t G = nb * kGroupsPerSuper;
  for_each_block<kQ2KBytes>(data, N, nb, p, [&](int64_t o, int64_t s, const uint8_t* b) {
    store_d_dmin(supers, nb, p, s, o, b + 80);
    for (int64_t gs = 0; gs < kGroupsPerSuper; ++gs) {
      const int64_t g = s * kGroupsPerSuper + gs;
      const uint8_t* qs = b + 16 + 32 * (gs / 4);
      const int shift = 2 * (gs % 4);
      for (int c = 0; c < 2; ++c)  // chunk c, byte t: bits 2q, 2q + 1 hold input 16c + 4q + t's code
        for (int t = 0; t < 4; ++t) {
          uint8_t byte = 0;
          for (int q = 0; q < 4; ++q) byte |= uint8_t((qs[16 * c + 4 * q + t] >> shift & 3) << (2 * q));
          codes[((p * G + g) * 2 + c) * kRows * 4 + o * 4 + t] = byte;
        }
      for (int half = 0; half < 2; ++half) {
        const uint8_t both = b[2 * gs + half];
        scales_mins[((p * G + g) * 4 + half) * kRows + o] = both & 15;
        scales_mins[((p * G + g) * 4 + 2 + half) * kRows + o] = both >> 4;
      }
    }
  });
}

using PackRows = void (*)(const uint8_t* data, int64_t N, int64_t nb, int64_t p, uint8_t* nibbles, uint8_t* middle,
                          uint16_t* supers);

// `data`'s packs, made pack by pack on every thread: the codes [P, G, chunks, 16, 4], the type's per-group buffer
// [P, G, middle...] and its float16 supers [P, nb, supers...].
std::tuple<at::Tensor, at::Tensor, at::Tensor> packed(const at::Tensor& data, const char* name, int64_t block_bytes,
                                                      std::vector<int64_t> middle, std::vector<int64_t> supers,
                                                      PackRows pack_rows, int64_t chunks = 4) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.size(1) > 0 &&
                  data.size(1) % block_bytes == 0 && data.is_contiguous(),
              name, ": data uint8 [N, whole ", block_bytes, "-byte blocks], contiguous");
  const int64_t N = data.size(0), nb = data.size(1) / block_bytes, P = (N + kRows - 1) / kRows;
  const int64_t G = nb * kGroupsPerSuper;
  middle.insert(middle.begin(), {P, G});
  supers.insert(supers.begin(), {P, nb});
  at::Tensor nibbles = at::empty({P, G, chunks, kRows, 4}, data.options());
  at::Tensor per_group = at::empty(middle, data.options());
  at::Tensor per_block = at::empty(supers, data.options().dtype(at::kHalf));
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* np = nibbles.data_ptr<uint8_t>();
  uint8_t* mp = per_group.data_ptr<uint8_t>();
  uint16_t* sp = reinterpret_cast<uint16_t*>(per_block.data_ptr<at::Half>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) pack_rows(src, N, nb, p, np, mp, sp);
  });
  return {nibbles, per_group, per_block};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q4_k(const at::Tensor& data) {
  return packed(data, "pack_q4_k", kQ4KBytes, {2, kRows}, {2, kRows}, pack_k4_rows<false>);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q5_k(const at::Tensor& data) {
  return packed(data, "pack_q5_k", kQ5KBytes, {96}, {2, kRows}, pack_k4_rows<true>);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q2_k(const at::Tensor& data) {
  return packed(data, "pack_q2_k", kQ2KBytes, {2, 2, kRows}, {2, kRows}, pack_q2_k_rows, 2);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q3_k(const at::Tensor& data) {
  auto [nibbles, scales, supers] = packed(data, "pack_q3_k", kQ3KBytes, {2, kRows}, {kRows}, pack_q3_k_rows);
  return {nibbles, scales.view(at::kChar), supers};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q6_k(const at::Tensor& data) {
  return packed(data, "pack_q6_k", kQ6KBytes, {160}, {kRows}, pack_q6_k_rows);
}
