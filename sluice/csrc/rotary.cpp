// Rotary position embedding, in place on the query and key heads, as transformers' Llama computes it:
//   x' = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[D/2:], x[:D/2])
// Eager that is sixteen small ops per layer, more time at batch 1 than the layer's attention itself.
// Each product and the sum are rounded to the tensor's dtype as torch's separate ops round them, and no FMA
// contracts them, so the result is the eager one bit for bit.
#include "cpu_ops.h"

#include <ATen/Parallel.h>

namespace {

template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_heads(T* x, int64_t heads, int64_t head_stride,
                                                               int64_t half, const T* cos, const T* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * head_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
      const float lo = static_cast<float>(T(a * static_cast<float>(cos[i]))) +
                       static_cast<float>(T(-b * static_cast<float>(sin[i])));
      const float hi = static_cast<float>(T(b * static_cast<float>(cos[i + half]))) +
                       static_cast<float>(T(a * static_cast<float>(sin[i + half])));
      v[i] = T(lo);
      v[i + half] = T(hi);
    }
  }
}

template <typename T>
void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = q.size(0), half = q.size(2) / 2;
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  // Threads past 16 tokens a thread: one decode row's rotation is under a microsecond, a batch's several.
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cp + t * cos.stride(0);
      const T* s = sp + t * sin.stride(0);
      rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), half, c, s);
      rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), half, c, s);
    }
  });
}

}  // namespace

void rotary_embedding_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rotary_embedding_: float32 or bfloat16");
  TORCH_CHECK(k.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "rotary_embedding_: q, k, cos and sin of one dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && cos.dim() == 2 && sin.dim() == 2,
              "rotary_embedding_: q [T, H, D], k [T, Hkv, D], cos and sin [T, D]");
  const int64_t D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(2) == D && cos.size(1) == D && sin.size(1) == D, "rotary_embedding_: head dims");
  TORCH_CHECK(k.size(0) == q.size(0) && cos.size(0) == q.size(0) && sin.size(0) == q.size(0),
              "rotary_embedding_: one cos/sin row per token");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.stride(1) == 1 && sin.stride(1) == 1,
              "rotary_embedding_: the head dim must be contiguous");
  if (dtype == at::kBFloat16) {
    rotary<at::BFloat16>(q, k, cos, sin);
  } else {
    rotary<float>(q, k, cos, sin);
  }
}
