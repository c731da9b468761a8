// The GGUF quant types the kernels serve: one row each in gguf_linear.cpp's kQuantTypes, keyed by GGML type id as
// service/executor/layers/quant_types.py's table is (tests/executor/layers/test_quant_types.py checks that they
// agree). A row names the type's kernels; the bindings, gguf_linear and llama_layer.cpp find them here by id.
#pragma once

#include <ATen/core/Tensor.h>

namespace sluice {

// IQ4_NL's 16 non-linear levels (llama.cpp's kvalues_iq4nl): each nibble of an IQ4_NL or IQ4_XS block picks one.
inline constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// On a weight's blocks as stored, w uint8 [N, row_bytes]: y = x @ W.T for few rows of x float32 [M, K]
// (activations rounded to int8 per 32), and W as float32 rows [N, K].
using StoredLinear = at::Tensor (*)(const at::Tensor& x, const at::Tensor& w);
using StoredDequantize = at::Tensor (*)(const at::Tensor& w, int64_t K);
// On a weight regrouped 16 output rows together for int4_linear.cpp (the type's pack_* in gguf_packs.py): its
// buffers a, b, c (c empty for a type with two), N outputs.
using PackedLinear = at::Tensor (*)(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                                    const at::Tensor& c, int64_t N);

struct QuantTraits {
  const char* name;
  int64_t id, block_size, block_bytes;
  StoredLinear stored_linear;
  StoredDequantize stored_dequantize;
  PackedLinear packed_linear;  // nullptr: the type is read as stored
};

// The row of GGML type `id`; an error naming it where there is none.
const QuantTraits& quant_traits(int64_t id);

}  // namespace sluice
