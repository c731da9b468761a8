// GGUF types without a kernel here, rewritten at load into types with one (gguf_weights.py). Q3_K goes into Q6_K
// blocks, which hold its values exactly (q3_k_as_q6_k). Q2_K is requantized into Q8_0 rows
// (requantize_q8_0) in one pass over the file's bytes: each super-block of 256 weights is dequantized
// with the float32 operations gguf's own (numpy) dequantize performs, in its order, so the values are the same bit
// for bit; each 32 of them then become a Q8_0 block exactly as gguf_blocks.quantize rounds one: d = half(max|w| /
// 127), q = w / d rounded half to even. tests/executor/models/test_gguf_requantize.py holds both to the slow path.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kSuper = 256, kGroup = 32, kQ8Bytes = 2 + kGroup;

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return float(c10::Half(bits, c10::Half::from_bits()));
}

// Q2_K, 84 bytes: scales[16] (per 16 weights, the scale in the low nibble and the minimum in the high one), qs[64]
// (weight 32 i + l in bits 2 (i % 4) and up of byte 32 (i / 4) + l), d, dmin (float16). w = d * sc * q - dmin * m.
#if defined(__GNUC__) && !defined(__clang__)
// numpy rounds the product before it subtracts: no fused multiply-subtract here. (clang contracts only within one
// expression, and the product is its own statement.)
__attribute__((optimize("fp-contract=off")))
#endif
void q2_k(const uint8_t* b, float* w) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  for (int i = 0; i < kSuper / kGroup; ++i) {
    float dl[2], ml[2];
    for (int half = 0; half < 2; ++half) {
      const uint8_t s = scales[2 * i + half];
      dl[half] = d * float(s & 15);
      ml[half] = dmin * float(s >> 4);
    }
    const uint8_t* bytes = qs + 32 * (i / 4);
    for (int l = 0; l < kGroup; ++l) {
      const float product = dl[l / 16] * float((bytes[l] >> (2 * (i % 4))) & 3);
      w[kGroup * i + l] = product - ml[l / 16];
    }
  }
}

// Q3_K, 110 bytes → Q6_K, 210 bytes, the same values: Q6_K's w = d * scale * (code - 32) with an int8 scale per 16
// weights and d per 256 holds Q3_K's d * (sc - 32) * q exactly (scale = sc - 32, code = q + 32, q in -4..3). Q3_K's
// layout: hmask[32] (weight 32 i + l's third bit in bit i of byte l; a clear bit subtracts 4), qs[64] (its low two
// bits in bits 2 (i % 4) and up of byte 32 (i / 4) + l), scales[12] (sixteen 6-bit scales: s's low nibble in byte
// s % 8 at bit 4 (s / 8), its high two bits in byte 8 + s % 4 at bit 2 (s / 4)), d (float16). Q6_K's layout (ggml's
// block_q6_K): ql[128], qh[64], scales[16] (int8), d; weight 128 n + 32 t + l has its low nibble in
// ql[64 n + 32 (t % 2) + l] (the high nibble where t >= 2), its two high bits at bit 2t of qh[32 n + l].
void q3_k_as_q6_k(const uint8_t* b, uint8_t* out) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  int8_t* scales = reinterpret_cast<int8_t*>(out + 192);
  std::memset(out, 0, 192);
  for (int s = 0; s < 16; ++s)
    scales[s] = int8_t((((sc[s % 8] >> (4 * (s / 8))) & 15) | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4)) - 32);
  std::memcpy(out + 208, b + 108, 2);
  for (int i = 0; i < kSuper / kGroup; ++i) {  // weights 32 i + l: n = i / 4, t = i % 4
    const int n = i / 4, t = i % 4;
    for (int l = 0; l < kGroup; ++l) {
      const int code = ((qs[32 * n + l] >> (2 * t)) & 3) + 28 + 4 * ((hmask[l] >> i) & 1);
      ql[64 * n + 32 * (t % 2) + l] |= uint8_t((code & 15) << (4 * (t / 2)));
      qh[32 * n + l] |= uint8_t((code >> 4) << (2 * t));
    }
  }
}

struct Dequantizer {
  int64_t type, block_bytes;
  void (*values)(const uint8_t*, float*);
};

// By GGML type id (ggml.h's enum, gguf's GGMLQuantizationType).
constexpr Dequantizer kDequantizers[] = {{10, 84, q2_k}};

// 32 weights → a Q8_0 block (float16 d, then 32 int8 codes).
void q8_0_block(const float* w, uint8_t* out) {
  float amax = 0.0f;
  for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(w[i]));
  const c10::Half d(amax / 127.0f);
  const float df = float(d);
  std::memcpy(out, &d.x, 2);
  int8_t* q = reinterpret_cast<int8_t*>(out + 2);
  if (!(df > 0.0f)) {
    std::memset(q, 0, kGroup);
    return;
  }
  for (int i = 0; i < kGroup; ++i) q[i] = int8_t(std::clamp(std::rint(w[i] / df), -127.0f, 127.0f));
}

}  // namespace

at::Tensor requantize_q8_0(const at::Tensor& w, int64_t type, int64_t K) {
  const Dequantizer* t = std::find_if(std::begin(kDequantizers), std::end(kDequantizers),
                                      [type](const Dequantizer& d) { return d.type == type; });
  TORCH_CHECK(t != std::end(kDequantizers), "requantize_q8_0: no dequantizer for GGML type ", type);
  TORCH_CHECK(K > 0 && K % kSuper == 0, "requantize_q8_0: in_features ", K, " are not whole 256-weight blocks");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) == K / kSuper * t->block_bytes &&
                  w.is_contiguous(),
              "requantize_q8_0: w uint8 [N, ", K / kSuper * t->block_bytes, "], contiguous");
  const int64_t N = w.size(0), in_row = w.size(1), out_row = K / kGroup * kQ8Bytes;
  at::Tensor out = at::empty({N, out_row}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float values[kSuper];
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t s = 0; s < K / kSuper; ++s) {
        t->values(src + n * in_row + s * t->block_bytes, values);
        for (int64_t g = 0; g < kSuper / kGroup; ++g)
          q8_0_block(values + g * kGroup, dst + n * out_row + (s * kSuper / kGroup + g) * kQ8Bytes);
      }
    }
  });
  return out;
}

at::Tensor q3_k_as_q6_k(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(K > 0 && K % kSuper == 0, "q3_k_as_q6_k: in_features ", K, " are not whole 256-weight blocks");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) == K / kSuper * 110 && w.is_contiguous(),
              "q3_k_as_q6_k: w uint8 [N, ", K / kSuper * 110, "], contiguous");
  const int64_t N = w.size(0), blocks = K / kSuper;
  at::Tensor out = at::empty({N, blocks * 210}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N * blocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) q3_k_as_q6_k(src + b * 110, dst + b * 210);
  });
  return out;
}

std::vector<int64_t> requantized_types() {
  std::vector<int64_t> ids;
  for (const Dequantizer& d : kDequantizers) ids.push_back(d.type);
  return ids;
}
