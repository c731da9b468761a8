// Q6_K weights packed for q6_k_linear (service/executor/layers/gguf_blocks.py pack_q6_k) back to float32 rows: the
// tiles of a prefill, which multiplies float activations (gguf_linear.py: int8-rounded ones moved SmolLM2's answers).
// Layout, per block of 16 rows and group g of 32 inputs: nibbles [4 chunks][16 rows][4 bytes], byte 4c + t of a row
// holding input 4c + t in its low nibble and input 16 + 4c + t in its high one; high_scales [160]: the bit-4 and
// bit-5 planes [2][16 rows][4 bytes] (byte t, bit c: input 4c + t; bit 4 + c: input 16 + 4c + t), then the int8
// scales [2 halves][16 rows]; supers [nb][16 rows] float16 d per 256 inputs. w = d * scale * (code - 32).
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>

#include "simd.h"

namespace {

constexpr int64_t kRows = 16, kGroup = 32, kGroupsPerSuper = 8;

// Rows [16 p, 16 p + 16) of the weight into out (row stride K).
void dequantize_pack(const uint8_t* nibbles, const uint8_t* high_scales, const c10::Half* supers, int64_t G,
                     int64_t p, float* out, int64_t K) {
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* nib = nibbles + (p * G + g) * 4 * kRows * 4;
    const uint8_t* planes = high_scales + (p * G + g) * 160;
    const int8_t* scales = reinterpret_cast<const int8_t*>(planes + 128);
    const c10::Half* d = supers + (p * (G / kGroupsPerSuper) + g / kGroupsPerSuper) * kRows;
    for (int64_t o = 0; o < kRows; ++o) {
      float* row = out + o * K + g * kGroup;
      const float d0 = float(d[o]) * scales[o], d1 = float(d[o]) * scales[kRows + o];
      const uint8_t* bit4 = planes + o * 4;
      const uint8_t* bit5 = planes + (kRows + o) * 4;
#ifdef SLUICE_AVX2
      // Eight inputs a vector, each lane shifting its own nibble and bits down: inputs 8v..8v+7 are chunks
      // 2(v % 2) and 2(v % 2) + 1 (bytes t = 0..3 of each), nibble and plane bit 4h + c with h = v / 2.
      uint32_t w[4], p4, p5;
      for (int c = 0; c < 4; ++c) std::memcpy(&w[c], nib + (c * kRows + o) * 4, 4);
      std::memcpy(&p4, bit4, 4);
      std::memcpy(&p5, bit5, 4);
      const __m256i words[2] = {_mm256_setr_epi32(w[0], w[0], w[0], w[0], w[1], w[1], w[1], w[1]),
                                _mm256_setr_epi32(w[2], w[2], w[2], w[2], w[3], w[3], w[3], w[3])};
      const __m256i plane4 = _mm256_set1_epi32(int(p4)), plane5 = _mm256_set1_epi32(int(p5));
      const __m256i bytes = _mm256_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24), one = _mm256_set1_epi32(1);
      for (int v = 0; v < 4; ++v) {
        const int h = v / 2, c0 = 2 * (v % 2);
        const __m256i nib_shift = _mm256_add_epi32(bytes, _mm256_set1_epi32(4 * h));
        const __m256i bit_shift = _mm256_add_epi32(nib_shift, _mm256_setr_epi32(c0, c0, c0, c0, c0 + 1, c0 + 1,
                                                                                c0 + 1, c0 + 1));
        const __m256i low = _mm256_and_si256(_mm256_srlv_epi32(words[v % 2], nib_shift), _mm256_set1_epi32(15));
        const __m256i b4 = _mm256_and_si256(_mm256_srlv_epi32(plane4, bit_shift), one);
        const __m256i b5 = _mm256_and_si256(_mm256_srlv_epi32(plane5, bit_shift), one);
        const __m256i code = _mm256_or_si256(low, _mm256_or_si256(_mm256_slli_epi32(b4, 4), _mm256_slli_epi32(b5, 5)));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, _mm256_set1_epi32(32)));
        _mm256_storeu_ps(row + 8 * v, _mm256_mul_ps(q, _mm256_set1_ps(h ? d1 : d0)));
      }
#else
      for (int c = 0; c < 4; ++c) {
        const uint8_t* bytes = nib + (c * kRows + o) * 4;
        for (int t = 0; t < 4; ++t) {  // inputs 4c + t (low nibble) and 16 + 4c + t (high nibble)
          const int lo = (bytes[t] & 15) | ((bit4[t] >> c) & 1) << 4 | ((bit5[t] >> c) & 1) << 5;
          const int hi = (bytes[t] >> 4) | ((bit4[t] >> (4 + c)) & 1) << 4 | ((bit5[t] >> (4 + c)) & 1) << 5;
          row[4 * c + t] = d0 * float(lo - 32);
          row[16 + 4 * c + t] = d1 * float(hi - 32);
        }
      }
#endif
    }
  }
}

}  // namespace

at::Tensor q6_k_dequantize(const at::Tensor& nibbles, const at::Tensor& high_scales, const at::Tensor& supers) {
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 5 && nibbles.size(2) == 4 &&
                  nibbles.size(3) == kRows && nibbles.size(4) == 4 && nibbles.is_contiguous(),
              "q6_k_dequantize: nibbles uint8 [P, G, 4, 16, 4], contiguous");
  const int64_t P = nibbles.size(0), G = nibbles.size(1), K = G * kGroup;
  TORCH_CHECK(G % kGroupsPerSuper == 0, "q6_k_dequantize: groups ", G, " are not whole 256-input blocks");
  TORCH_CHECK(high_scales.scalar_type() == at::kByte && high_scales.sizes().equals({P, G, 160}) &&
                  high_scales.is_contiguous(), "q6_k_dequantize: high_scales uint8 [P, G, 160], contiguous");
  TORCH_CHECK(supers.scalar_type() == at::kHalf && supers.sizes().equals({P, G / kGroupsPerSuper, kRows}) &&
                  supers.is_contiguous(), "q6_k_dequantize: supers float16 [P, G / 8, 16], contiguous");
  at::Tensor out = at::empty({P * kRows, K}, nibbles.options().dtype(at::kFloat));
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  const uint8_t* hp = high_scales.data_ptr<uint8_t>();
  const c10::Half* sp = supers.data_ptr<c10::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) dequantize_pack(np, hp, sp, G, p, op + p * kRows * K, K);
  });
  return out;
}
