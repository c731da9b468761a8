// A Llama decoder layer's work before and after its attention, as two C++ calls instead of a dozen Python ones
// (module calls, views, splits, in-place ops between the kernels). This runs the same ops in the same order as
// models/llama.py's Python path (the same kernels, at::silu, mul_, add_), so the results are that path's bit for
// bit; the attention itself stays in Python (paged_attention covers every kind of step). A GGUF linear's kernels are
// found by its type id in the quant-type table (quant_types.h).
#include "cpu_ops.h"
#include "quant_types.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/silu.h>

namespace {

constexpr int64_t kPackedFloat = -1;  // float32 or bfloat16 (the activations' type) in oneDNN's packed layout
constexpr int64_t kPackedHalf = -2;  // a float16 or bfloat16 weight in 64-column blocks, float32 activations

bool has_packs(const at::Tensor& b) { return b.defined() && b.numel() > 0; }

at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "LayerLinear: a bias of ", n,
              " contiguous values");
  return *bias;
}

// Qwen3's per-head RMSNorm weight: [D] on the CPU, or none.
at::Tensor checked_head_norm(const c10::optional<at::Tensor>& norm, int64_t head_dim) {
  if (!norm.has_value() || !norm->defined()) return at::Tensor();
  TORCH_CHECK(norm->dim() == 1 && norm->size(0) == head_dim, "LlamaLayerOps: a q/k norm of ", head_dim, " values");
  return *norm;
}

}  // namespace

LlamaLayerOps::Linear::Linear(int64_t type, at::Tensor a, at::Tensor b, at::Tensor c, int64_t n,
                              c10::optional<at::Tensor> bias)
    : parts{{type, std::move(a), std::move(b), std::move(c), n, 0, 0, 0, checked_bias(bias, n)}}, n(n) {
  const sluice::QuantTraits& traits = sluice::quant_traits(type);  // an error for a type without kernels
  TORCH_CHECK(!has_packs(parts[0].b) || traits.packed_linear != nullptr, "LlamaLayerOps: ", traits.name,
              " has no packed kernel");
}

LlamaLayerOps::Linear::Linear(at::Tensor packed, int64_t ptr, int64_t block, int64_t k_rows, int64_t n,
                              c10::optional<at::Tensor> bias)
    : parts{{kPackedFloat, std::move(packed), at::Tensor(), at::Tensor(), n, ptr, block, k_rows, checked_bias(bias, n)}},
      n(n) {
  TORCH_CHECK(ptr != 0 && block > 0 && k_rows > 0, "LlamaLayerOps: a packed float linear needs its layout");
}

LlamaLayerOps::Linear::Linear(at::Tensor weight, int64_t n, c10::optional<at::Tensor> bias)
    : parts{{kPackedHalf, weight, at::Tensor(), at::Tensor(), n, 0, 0, 0, checked_bias(bias, n)}}, n(n) {
  check_half_blocks(weight, n, "LlamaLayerOps");
}

LlamaLayerOps::Linear::Linear(const std::vector<Linear>& linears) : n(0) {
  for (const Linear& linear : linears) {
    parts.insert(parts.end(), linear.parts.begin(), linear.parts.end());
    n += linear.n;
  }
  TORCH_CHECK(!parts.empty(), "LlamaLayerOps: a linear of no parts");
}

at::Tensor LlamaLayerOps::Linear::operator()(const at::Tensor& x) const {
  std::vector<at::Tensor> outs;
  for (const Part& p : parts) {
    if (p.type == kPackedHalf) {
      outs.push_back(packed_linear_half(x, p.a, p.n));
    } else if (p.type == kPackedFloat) {
      outs.push_back(x.scalar_type() == at::kBFloat16 ? packed_linear_bf16(x, p.ptr, p.n, p.block, p.k_rows)
                                                      : packed_linear_f32(x, p.ptr, p.n, p.block, p.k_rows));
    } else {
      const sluice::QuantTraits& traits = sluice::quant_traits(p.type);
      outs.push_back(has_packs(p.b) ? traits.packed_linear(x, p.a, p.b, p.c, p.n) : traits.stored_linear(x, p.a));
    }
    if (p.bias.defined()) outs.back().add_(p.bias);  // in place on the fresh output, as the Python path adds it
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
}
LlamaLayerOps::LlamaLayerOps(at::Tensor input_norm, double input_eps, Linear qkv, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, Linear o, at::Tensor post_norm, double post_eps, Linear gate_up,
                             Linear down, c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                             double qk_eps)
    : input_norm_(std::move(input_norm)), input_eps_(input_eps), qkv_(std::move(qkv)), heads_(heads),
      kv_heads_(kv_heads), head_dim_(head_dim), o_(std::move(o)), post_norm_(std::move(post_norm)),
      post_eps_(post_eps), gate_up_(std::move(gate_up)), down_(std::move(down)),
      q_norm_(checked_head_norm(q_norm, head_dim)), k_norm_(checked_head_norm(k_norm, head_dim)), qk_eps_(qk_eps) {
  TORCH_CHECK(q_norm_.defined() == k_norm_.defined(), "LlamaLayerOps: q and k norms both or neither");
  TORCH_CHECK(qkv_.n == (heads + 2 * kv_heads) * head_dim, "LlamaLayerOps: q, k and v rows do not match the heads");
  TORCH_CHECK(gate_up_.n % 2 == 0, "LlamaLayerOps: gate and up have one size");
}

std::vector<at::Tensor> LlamaLayerOps::before_attention(const at::Tensor& hidden, const at::Tensor& cos,
                                                        const at::Tensor& sin) const {
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "before_attention: hidden float32 or bfloat16 [1, T, E]");
  const int64_t tokens = hidden.size(1), D = head_dim_;
  const at::Tensor x = rms_norm(hidden, input_norm_, input_eps_);
  const at::Tensor qkv = qkv_(x.view({tokens, -1}));
  at::Tensor q = qkv.narrow(1, 0, heads_ * D).view({tokens, heads_, D});
  at::Tensor k = qkv.narrow(1, heads_ * D, kv_heads_ * D).view({tokens, kv_heads_, D});
  at::Tensor v = qkv.narrow(1, (heads_ + kv_heads_) * D, kv_heads_ * D).view({tokens, kv_heads_, D});
  if (q_norm_.defined()) {  // Qwen3: each head normed before rotary (fresh contiguous tensors, as in Python)
    q = rms_norm(q, q_norm_, qk_eps_);
    k = rms_norm(k, k_norm_, qk_eps_);
  }
  rotary_embedding_(q, k, cos.select(0, 0), sin.select(0, 0));
  return {q, k, v};
}

at::Tensor LlamaLayerOps::after_attention(const at::Tensor& attended, const at::Tensor& hidden) const {
  const int64_t tokens = hidden.size(1);
  // The residual adds go in place on the fresh outputs, as in Python: o(attn) + h, then down(...) + that.
  at::Tensor h = o_(attended.reshape({tokens, -1})).add_(hidden.view({tokens, -1}));
  const at::Tensor gate_up = gate_up_(rms_norm(h, post_norm_, post_eps_));
  const int64_t inner = gate_up_.n / 2;
  // SiLU out of place: a fresh contiguous tensor for the down projection, not the gate's strided slice copied.
  at::Tensor act = at::silu(gate_up.narrow(1, 0, inner));
  act.mul_(gate_up.narrow(1, inner, inner));
  return down_(act).add_(h).view({1, tokens, -1});
}
