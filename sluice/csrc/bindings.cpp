// The Python module of the CPU ops; each op lives in its own file. pybind11 with torch's tensor casters, not
// torch/extension.h (the whole C++ frontend): this file compiles in half the time, and it is the longest of the
// build.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "cpu_ops.h"

#include <ATen/Parallel.h>

#include <mutex>
#include <set>
#include <thread>

int64_t parallel_threads() {
  std::mutex lock;
  std::set<std::thread::id> seen;
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(seen.size());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "int4 linear (Q4_1 weights, int8 activations), few rows");
  m.def("q4_0_linear", &q4_0_linear, "int4 linear on Q4_0 weights (packed codes, no minimum)");
  m.def("q4_k_linear", &q4_k_linear, "int4 linear on Q4_K weights (packed codes, the file's scales), few rows");
  m.def("iq4_nl_linear", &iq4_nl_linear, "int4 linear on IQ4_NL weights (packed level indices, as Q4_0's)");
  m.def("q5_k_linear", &q5_k_linear, "int4 linear on Q5_K weights (packed codes and fifth bits, the file's scales)");
  m.def("iq4_xs_linear", &iq4_xs_linear, "int4 linear on IQ4_XS weights (packed level indices, the file's scales)");
  m.def("q5_0_linear", &q5_0_linear, "int4 linear on Q5_0 weights (packed codes and fifth bits)");
  m.def("q5_1_linear", &q5_1_linear, "int4 linear on Q5_1 weights (packed codes and fifth bits)");
  m.def("q6_k_linear", &q6_k_linear, "int4 linear on Q6_K weights (packed codes, their two high bits, the scales)");
  m.def("q2_k_linear", &q2_k_linear, "int4 linear on Q2_K weights (2-bit codes, a scale and minimum per 16 inputs)");
  m.def("q3_k_linear", &q3_k_linear, "int4 linear on Q3_K weights (packed 3-bit codes, the scales per 16 inputs)");
  m.def("q8_0_packed_linear", &q8_0_packed_linear, "the int4 kernel's 8-bit sibling on packed Q8_0 weights");
  m.def("int4_linear_isa", &int4_linear_isa, "the int4 kernel's instruction set");
  m.def("packed_linear_f32", &packed_linear_f32, "float32 linear on a oneDNN-packed weight, few rows");
  m.def("packed_linear_bf16", &packed_linear_bf16, "bfloat16 linear on a oneDNN-packed weight, few rows");
  m.def("packed_linear_half", &packed_linear_half, "float32 linear on a 16-bit weight in 64-column blocks, few rows");
  m.def("packed_linear_f32_chunk", &packed_linear_f32_chunk, "columns per fp32 kernel chunk");
  m.def("packed_linear_bf16_is_native", &packed_linear_bf16_is_native, "built with AVX512_BF16");
  m.def("greedy_argmax", &greedy_argmax, "each row's argmax (first maximum, or first NaN), float32 logits");
  m.def("rms_norm", &rms_norm, "Llama RMSNorm, float32 or bfloat16");
  m.def("rotary_embedding_", &rotary_embedding_, "Llama rotary embedding of q and k, in place");
  m.def("f32_linear", &f32_linear, "float32 linear, few rows");
  m.def("bf16_linear", &bf16_linear, "bfloat16 linear, few rows");
  m.def("bf16_linear_is_native", &bf16_linear_is_native, "built with AVX512_BF16");
  m.def("gguf_linear", &gguf_linear, "linear on GGUF blocks as stored, few rows");
  m.def("gguf_dequantize", &gguf_dequantize, "GGUF blocks as stored to float32 rows");
  m.def("quant_linear", &quant_linear, "linear on a GGUF type's packed layout, its kernel found by type id");
  m.def("quant_types", &quant_types, "the quant-type table: (name, id, block size, block bytes, has a packed kernel)");
  m.def("pack_q4_k", &pack_q4_k, "Q4_K rows regrouped for q4_k_linear");
  m.def("pack_q5_k", &pack_q5_k, "Q5_K rows regrouped for q5_k_linear");
  m.def("pack_q2_k", &pack_q2_k, "Q2_K rows regrouped for q2_k_linear");
  m.def("pack_q3_k", &pack_q3_k, "Q3_K rows regrouped for q3_k_linear");
  m.def("pack_q6_k", &pack_q6_k, "Q6_K rows regrouped for q6_k_linear");
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for runs on");
  pybind11::class_<LlamaLayerOps::Linear>(m, "LayerLinear")
      .def(pybind11::init<int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t, c10::optional<at::Tensor>>())
      .def(pybind11::init<at::Tensor, int64_t, int64_t, int64_t, int64_t, c10::optional<at::Tensor>>())
      .def(pybind11::init<at::Tensor, int64_t, c10::optional<at::Tensor>>())
      .def(pybind11::init<const std::vector<LlamaLayerOps::Linear>&>());
  pybind11::class_<LlamaLayerOps>(m, "LlamaLayerOps")
      .def(pybind11::init<at::Tensor, double, LlamaLayerOps::Linear, int64_t, int64_t, int64_t,
                          LlamaLayerOps::Linear, at::Tensor, double, LlamaLayerOps::Linear,
                          LlamaLayerOps::Linear, c10::optional<at::Tensor>, c10::optional<at::Tensor>, double>())
      .def("before_attention", &LlamaLayerOps::before_attention, "input norm, q/k/v projection, rotary")
      .def("after_attention", &LlamaLayerOps::after_attention, "o projection, residual, norm, MLP, residual");
  m.def("paged_decode_isa", &paged_decode_isa, "the decode attention kernel's instruction set");
  m.def("paged_decode_vector_covers", &paged_decode_vector_covers, "the decode kernel's vector path takes these heads");
  pybind11::class_<PagedDecodePlan>(m, "PagedDecodePlan")
      .def(pybind11::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t, int64_t,
                          int64_t, double, int64_t>())
      // The GIL is let go for the kernel, as torch's own ops do: the server's other threads keep running.
      .def("step", &PagedDecodePlan::step, "store the new K/V (if given), then attend: out [n, H, D]",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
