// bf16 linear for the few-row batches of decoding on CPUs with AVX512_BF16 (vdpbf16ps: 32 bf16 products per
// instruction, accumulated in float32), reading the plain [N, K] weight that torch's own bf16 path uses too, so
// no second copy: oneDNN's GEMV streamed SmolLM2's bf16 weights at ~8 GB/s on 2 Zen 4 cores.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include "row_blocks.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define SLUICE_BF16_NATIVE 1
#endif

namespace {

inline float to_float(const uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

template <int Rows>
void rows_dot(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, uint16_t* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * K;
    float sum[Rows];
    int64_t k = 0;
#ifdef SLUICE_BF16_NATIVE
    __m512 acc[2][Rows];
    for (int r = 0; r < Rows; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (; k + 64 <= K; k += 64) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
      for (int r = 0; r < Rows; ++r) {
        acc[0][r] = _mm512_dpbf16_ps(acc[0][r], (__m512bh)_mm512_loadu_si512(x + r * K + k), w0);
        acc[1][r] = _mm512_dpbf16_ps(acc[1][r], (__m512bh)_mm512_loadu_si512(x + r * K + k + 32), w1);
      }
    }
    for (; k + 32 <= K; k += 32) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      for (int r = 0; r < Rows; ++r) {
        acc[0][r] = _mm512_dpbf16_ps(acc[0][r], (__m512bh)_mm512_loadu_si512(x + r * K + k), w0);
      }
    }
    for (int r = 0; r < Rows; ++r) sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
#else
    for (int r = 0; r < Rows; ++r) sum[r] = 0.f;
#endif
    for (; k < K; ++k) {
      const float wk = to_float(row[k]);
      for (int r = 0; r < Rows; ++r) sum[r] += to_float(x[r * K + k]) * wk;
    }
    for (int r = 0; r < Rows; ++r) y[r * N + n] = c10::BFloat16(sum[r]).x;
  }
}

}  // namespace

bool bf16_linear_is_native() {
#ifdef SLUICE_BF16_NATIVE
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "bf16_linear: bfloat16 x and contiguous bfloat16 w");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    sluice::for_each_tile(M, n0, n1, K * int64_t(sizeof(uint16_t)), [&](auto rows, int64_t m, int64_t t0, int64_t t1) {
      rows_dot<rows>(xp + m * K, K, wp, t0, t1, yp + m * N, N);
    });
  });
  return y;
}
