// RMSNorm in one pass per row, as transformers' Llama RMSNorm computes it in float32:
//   out = weight * (x * 1 / sqrt(mean(x^2) + eps))
// At batch 1 the eager version is eight small ops per norm, two norms per layer: a noticeable share of a decode
// step once the linears are quantized. Rows are split among threads only when there are many.
#include "cpu_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include "simd.h"

namespace {

float sum_of_squares(const float* x, int64_t H) {
  int64_t k = 0;
  float total = 0.f;
#ifdef SLUICE_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; k + 16 <= H; k += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + k), v1 = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  total = sluice::hsum(_mm256_add_ps(a0, a1));
#endif
  for (; k < H; ++k) total += x[k] * x[k];
  return total;
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 x and weight");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), "rms_norm: weight [H]");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty_like(xc);
  const int64_t rows = H ? xc.numel() / H : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Threads only for prefill-sized inputs: a decode batch's norm is microseconds of work, less than a fork and join.
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(H, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float* orow = op + r * H;
      const float inv = 1.f / std::sqrt(sum_of_squares(xr, H) / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t k = 0; k < H; ++k) orow[k] = wp[k] * (xr[k] * inv);
    }
  });
  return out;
}
