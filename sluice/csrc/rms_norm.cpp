// RMSNorm in one pass per row (float32 or bf16 rows), as transformers' Llama RMSNorm computes it:
//   out = weight * (x * 1 / sqrt(mean(x^2) + eps))
// At batch 1 the eager version is eight small ops per norm, two norms per layer: a noticeable share of a decode
// step once the linears are quantized. Rows are split among threads only when there are many.
#include "cpu_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>
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

// bf16 in and out, as transformers computes it: float32 statistics, the normalized row rounded to bf16, then the
// product with the bf16 weight rounded again.
void rms_norm_bf16(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t r0, int64_t r1, int64_t H,
                   float eps, float* row) {
  for (int64_t r = r0; r < r1; ++r) {
    const at::BFloat16* xr = x + r * H;
    for (int64_t k = 0; k < H; ++k) row[k] = static_cast<float>(xr[k]);
    const float inv = 1.f / std::sqrt(sum_of_squares(row, H) / static_cast<float>(H) + eps);
    at::BFloat16* orow = out + r * H;
    for (int64_t k = 0; k < H; ++k) {
      const float normed = static_cast<float>(at::BFloat16(row[k] * inv));
      orow[k] = at::BFloat16(static_cast<float>(w[k]) * normed);
    }
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "rms_norm: x and weight both float32 or both bfloat16");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), "rms_norm: weight [H]");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = H ? xc.numel() / H : 0;
  const float e = static_cast<float>(eps);
  // Threads past 16K elements a thread: one decode row's norm is a microsecond, less than a fork and join, but a
  // batch of 48 rows takes several, and the other thread would wait them out at the next linear.
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(H, 1)), [&](int64_t r0, int64_t r1) {
    if (dtype == at::kBFloat16) {
      std::vector<float> row(static_cast<size_t>(H));
      rms_norm_bf16(xc.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), r0,
                    r1, H, e, row.data());
      return;
    }
    const float* xp = xc.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float* orow = op + r * H;
      const float inv = 1.f / std::sqrt(sum_of_squares(xr, H) / static_cast<float>(H) + e);
      for (int64_t k = 0; k < H; ++k) orow[k] = wp[k] * (xr[k] * inv);
    }
  });
  return out;
}
