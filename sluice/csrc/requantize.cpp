// GGUF types without a kernel here, rewritten at load into a type with one (gguf_weights.py): Q2_K is requantized
// into Q8_0 rows (requantize_q8_0) in one pass over the file's bytes: each super-block of 256 weights is dequantized
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

std::vector<int64_t> requantized_types() {
  std::vector<int64_t> ids;
  for (const Dequantizer& d : kDequantizers) ids.push_back(d.type);
  return ids;
}
