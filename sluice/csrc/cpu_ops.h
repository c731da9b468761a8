// The CPU ops of the one extension built from csrc/*.cpp (see sluice/native.py); bindings.cpp exports them.
#pragma once
// ATen's tensor and the two factories the kernels call, not torch/types.h (all of ATen's operators: twice the
// compile time of a kernel file) nor torch/extension.h (the C++ frontend and pybind11: six times). Only
// bindings.cpp includes the latter.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <string>
#include <tuple>
#include <vector>

// y = x @ dequant(q).T for Q4_1 weights (float16 scale d and minimum m per 32 inputs, element = q * d + m) with the
// activations quantized to int8 per group of 32, as llama.cpp runs Q4_1. Weights packed 16 outputs to a block
// (int4_linear.cpp says how): qs uint8 [ceil(N / 16), K / 32, 4, 16, 4], scale and minimum float16
// [ceil(N / 16), K / 32, 16]. x float32 [M, K], K a multiple of 32; y float32 [M, N].
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& minimum, int64_t N);
// The same kernel on Q4_0 weights, their codes packed as int4_linear's, d float16 [ceil(N / 16), K / 32, 16];
// element = (q - 8) d.
at::Tensor q4_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, int64_t N);
// The same kernel on IQ4_NL weights, packed as Q4_0's, each nibble the index of one of its 16 levels; element =
// level * d.
at::Tensor iq4_nl_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, int64_t N);
// The same kernel on Q4_K weights, their codes packed as int4_linear's and their scales as the file has them:
// scales_mins uint8 [ceil(N / 16), K / 32, 2, 16] (each group's 6-bit scale sc and minimum m), supers float16
// [ceil(N / 16), K / 256, 2, 16] (d and -dmin per 256 inputs); element = q * d * sc + m * (-dmin). K a multiple
// of 256.
at::Tensor q4_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales_mins,
                       const at::Tensor& supers, int64_t N);
// The same kernel on Q5_K weights: Q4_K's with a fifth bit per code; per group high_scales_mins uint8
// [ceil(N / 16), K / 32, 96] (the fifth bits as q5_0_linear's, then the 6-bit scale and minimum [2, 16]); supers as
// Q4_K's.
at::Tensor q5_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& high_scales_mins,
                       const at::Tensor& supers, int64_t N);
// The same kernel on IQ4_XS weights: nibbles packed as int4_linear's, each the index of one of IQ4_NL's 16 levels;
// scales int8 [ceil(N / 16), K / 32, 16] (the file's 6-bit scale less 32), d float16 supers [ceil(N / 16), K / 256,
// 16]; element = d * sc * level. K a multiple of 256.
at::Tensor iq4_xs_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                         const at::Tensor& supers, int64_t N);
// The same kernel on Q5_0 and Q5_1 weights: their low four bits packed as int4_linear's, the fifth bits as
// int4_linear.cpp lays them out (fifth uint8 [ceil(N / 16), K / 32, 16, 4]), d float16 [ceil(N / 16), K / 32, 16]
// (Q5_0: element = (q - 16) d) or d and m [ceil(N / 16), K / 32, 2, 16] (Q5_1: element = q d + m).
at::Tensor q5_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& fifth, const at::Tensor& scale,
                       int64_t N);
at::Tensor q5_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& fifth,
                       const at::Tensor& scale_min, int64_t N);
// The same kernel on Q6_K weights: the codes' low four bits packed as int4_linear's; per group high_scales uint8
// [ceil(N / 16), K / 32, 160] (the codes' bits 4 and 5 in the fifth bits' layout, then the int8 scale of each 16
// inputs [2, 16]); d float16 supers [ceil(N / 16), K / 256, 16]; element = d * sc * (q - 32). K a multiple of 256.
at::Tensor q6_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& high_scales,
                       const at::Tensor& supers, int64_t N);
// The same kernel on Q3_K weights: the 3-bit codes q + 4 packed as int4_linear's nibbles; scales int8
// [ceil(N / 16), K / 32, 2, 16] (the file's 6-bit scale less 32, per 16 inputs); d float16 supers [ceil(N / 16),
// K / 256, 16]; element = d * sc * q, q in -4..3. K a multiple of 256.
at::Tensor q3_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& supers,
                       int64_t N);
// The same kernel on Q2_K weights, their 2-bit codes four to a byte: qs uint8 [ceil(N / 16), K / 32, 2, 16, 4] (chunk
// c, output o, byte t: in bits 2p, 2p + 1 the code of input 16c + 4p + t); scales_mins uint8 [ceil(N / 16), K / 32,
// 2, 2, 16] (each 16 inputs' 4-bit scale sc, then minimum m); supers float16 [ceil(N / 16), K / 256, 2, 16] (d and
// -dmin); element = d * sc * q - dmin * m. K a multiple of 256.
at::Tensor q2_k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales_mins,
                       const at::Tensor& supers, int64_t N);
// The same kernel's 8-bit sibling on Q8_0 weights, a byte per code: qs uint8 [ceil(N / 16), K / 32, 8, 16, 4]
// holding q + 128 (int4_linear.cpp, pack_q8_0), scale d float16 [ceil(N / 16), K / 32, 16]; element = q d.
at::Tensor q8_0_packed_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, int64_t N);
// The int4 kernel's instruction set: "avx512_vnni", "avx2" or "portable".
std::string int4_linear_isa();

// y = x @ w.T in float32 for few rows, on the plain weight (AVX2 where built for it, else scalar).
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w);

// y = x @ w.T in bfloat16 (float32 accumulation) for few rows; AVX512_BF16 where built for it, else scalar.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w);
// Whether bf16_linear was built with AVX512_BF16 (the only case where it beats torch's own bf16 linear).
bool bf16_linear_is_native();

// y = x @ W.T for few rows, W in oneDNN's prepacked layout at weight_ptr (packed_linear.cpp says which): N outputs
// in blocks of `block` columns, k_rows (K as oneDNN padded it) per block. fp32 with AVX-512 or AVX2 (else
// scalar); bf16 only where built with AVX512_BF16.
at::Tensor packed_linear_f32(const at::Tensor& x, int64_t weight_ptr, int64_t N, int64_t block, int64_t k_rows);
// The same fp32 kernel on a 16-bit weight (`--quantization f16 | bf16`) in its layout with 64-column blocks:
// w [ceil(N / 64), K, 64] float16 or bfloat16, w[n, k] at [n / 64, k, n % 64] (the last block zero-padded).
constexpr int64_t kHalfBlock = 64;
at::Tensor packed_linear_half(const at::Tensor& x, const at::Tensor& w, int64_t N);
// Refuses (naming `who`) a w that is not N outputs' worth of packed_linear_half's blocks.
void check_half_blocks(const at::Tensor& w, int64_t N, const char* who);
at::Tensor packed_linear_bf16(const at::Tensor& x, int64_t weight_ptr, int64_t N, int64_t block,
                              int64_t k_rows);
bool packed_linear_bf16_is_native();
// The fp32 kernel's column chunk: a packed block must be a multiple of it (bf16 blocks: of 64).
int64_t packed_linear_f32_chunk();

// Each row's argmax of logits float32 [B, V] as torch's max(dim=-1) picks it (the first largest, or the first NaN):
// int64 [B].
at::Tensor greedy_argmax(const at::Tensor& logits);

// transformers' Llama RMSNorm, one pass per row: weight * (x / sqrt(mean(x^2) + eps)); float32 or bfloat16.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rotary position embedding in place, as transformers' Llama applies it: q [T, H, D] and k [T, Hkv, D] (heads may be
// strided, the head dim contiguous), cos and sin [T, D]; float32 or bfloat16, bit for bit the eager result.
void rotary_embedding_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);

// A Llama-family decoder layer's work around its attention (llama_layer.cpp), on GGUF-block or packed float linears:
// before_attention(hidden [1, T, E], cos, sin [1, T, D]) -> {q [T, H, D], k, v [T, Hkv, D]}, the input norm, the
// fused q/k/v projection (its bias: Qwen2), the per-head q/k norms (Qwen3) and rotary applied;
// after_attention(attention [T, H, D], hidden) -> the layer's output [1, T, E]: o projection, residual,
// post-attention norm, fused gate/up, SiLU(gate) * up, down, residual.
class LlamaLayerOps {
 public:
  // One linear: parts side by side (a GGUF may store q and v in different types), each a GGML type id (quant_types.h)
  // with its tensors: where b is not empty, a, b, c are the type's packed buffers for its packed kernel (c empty for a
  // type with two), else a holds its rows of blocks as stored; or a float weight in oneDNN's packed layout; or a
  // 16-bit weight in 64-column blocks times float32 activations (packed_linear_half). n outputs in all; a part's
  // bias (none: undefined) is added to its own outputs.
  struct Linear {
    Linear(int64_t type, at::Tensor a, at::Tensor b, at::Tensor c, int64_t n, c10::optional<at::Tensor> bias);
    // A float weight in oneDNN's packed layout at `ptr` (packed_linear.cpp; `packed` keeps it alive).
    Linear(at::Tensor packed, int64_t ptr, int64_t block, int64_t k_rows, int64_t n, c10::optional<at::Tensor> bias);
    // A float16 or bfloat16 weight (`--quantization f16 | bf16`) in packed_linear_half's blocks [ceil(n / 64), K,
    // 64], float32 activations.
    Linear(at::Tensor weight, int64_t n, c10::optional<at::Tensor> bias);
    explicit Linear(const std::vector<Linear>& parts);  // the parts' outputs concatenated
    at::Tensor operator()(const at::Tensor& x) const;
    struct Part {
      int64_t type;
      at::Tensor a, b, c;
      int64_t n;
      int64_t ptr = 0, block = 0, k_rows = 0;  // the packed float layout's
      at::Tensor bias = at::Tensor();
    };
    std::vector<Part> parts;
    int64_t n;
  };
  // q_norm and k_norm [D] (Qwen3's per-head RMSNorms, eps qk_eps) both given or neither.
  LlamaLayerOps(at::Tensor input_norm, double input_eps, Linear qkv, int64_t heads, int64_t kv_heads,
                int64_t head_dim, Linear o, at::Tensor post_norm, double post_eps, Linear gate_up, Linear down,
                c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, double qk_eps);
  std::vector<at::Tensor> before_attention(const at::Tensor& hidden, const at::Tensor& cos,
                                           const at::Tensor& sin) const;
  at::Tensor after_attention(const at::Tensor& attended, const at::Tensor& hidden) const;

 private:
  at::Tensor input_norm_;
  double input_eps_;
  Linear qkv_;
  int64_t heads_, kv_heads_, head_dim_;
  Linear o_;
  at::Tensor post_norm_;
  double post_eps_;
  Linear gate_up_, down_;
  at::Tensor q_norm_, k_norm_;  // undefined: no per-head norms
  double qk_eps_;
};

// Decode attention over the paged KV cache, one query token per sequence (paged_decode.cpp). A plan holds what
// every layer of one decode step shares: block_tables [n, blocks], seq_lens [n] (this step's token included) and
// slot_mapping [n] (where each new K/V row goes; none: the caller stored them), all contiguous int64 on the CPU.
// step(query [n, H, D], key, value [n, Hkv, D] or none, key_cache, value_cache [blocks, block_size, Hkv, D]) stores
// the new rows, then attends: -> out [n, H, D]; float32 or bfloat16, float32 arithmetic.
class PagedDecodePlan {
 public:
  PagedDecodePlan(at::Tensor block_tables, at::Tensor seq_lens, c10::optional<at::Tensor> slot_mapping,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double scale,
                  int64_t num_threads);
  at::Tensor step(const at::Tensor& query, const c10::optional<at::Tensor>& key,
                  const c10::optional<at::Tensor>& value, at::Tensor key_cache,
                  at::Tensor value_cache) const;

 private:
  at::Tensor block_tables_, seq_lens_;
  c10::optional<at::Tensor> slot_mapping_;
  int64_t num_heads_, num_kv_heads_, head_dim_, block_size_;
  double scale_;
  int64_t num_threads_;
  std::vector<int64_t> items_;  // (first row, row count) of each run of rows the kernel attends together
  void plan_runs();
};
// The decode kernel's vector path: "avx512", "avx2" or "portable".
std::string paged_decode_isa();
// Whether the vector path attends heads of this shape (else each row runs the portable loop on its own).
bool paged_decode_vector_covers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
// Linears on GGUF blocks (gguf_linear.cpp), each type's kernels found by GGML type id in its kQuantTypes
// (quant_types.h). gguf_linear and gguf_dequantize: on blocks as stored, w uint8 [N, row_bytes]: y = x @ W.T for few
// rows of x float32 [M, K], activations quantized to int8 per 32; W as float32 [N, K]. quant_linear: the same on a
// type's packed layout (buffers a, b, c; c empty for a type with two). quant_types: the table's rows (name, id,
// block size, block bytes, has a packed kernel).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type);
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t K);
at::Tensor quant_linear(const at::Tensor& x, int64_t type, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor& c, int64_t N);
std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, bool>> quant_types();
// Q2_K rows uint8 [N, K / 256 * 84], Q3_K rows [N, K / 256 * 110], Q4_K rows [N, K / 256 * 144], Q5_K rows
// [N, K / 256 * 176] and Q6_K rows [N, K / 256 * 210] → q2_k_linear's to q6_k_linear's buffers (gguf_packs.py's
// pack_q2_k to pack_q6_k, the same bytes; k_quant_pack.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q2_k(const at::Tensor& data);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q3_k(const at::Tensor& data);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q4_k(const at::Tensor& data);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q5_k(const at::Tensor& data);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_q6_k(const at::Tensor& data);

// How many threads at::parallel_for really runs on (1 where the build lost OpenMP).
int64_t parallel_threads();
