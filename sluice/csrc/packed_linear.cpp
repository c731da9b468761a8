// Few-row linears that read oneDNN's own prepacked weight, so a weight has one copy that serves both the GEMV of
// decoding and oneDNN's GEMM for larger batches. The layouts (checked at pack time, service/executor/packed_gemv.py):
//   fp32: blocks of B output columns; a block holds K rows of B floats: w[n, k] at (n / B) * B * K + k * B + n % B.
//   bf16: the same blocks with inputs paired for vdpbf16ps: w[n, k] at (n / B) * B * Kp + (k / 2) * 2B + 2 (n % B)
//         + k % 2, Kp = K rounded up to even.
// A block is one contiguous stream, read once per block of rows; its columns stay in registers across all of K,
// so there are no horizontal sums. Threads split the column blocks (at::parallel_for, -fopenmp).
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SLUICE_PACKED_BF16 1
#endif
#include "row_blocks.h"
#include "simd.h"

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 4;  // 4 rows x 4 vectors of accumulators + 4 of weights: 24 of 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#elif defined(SLUICE_AVX2)
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t kRows = 2;  // 16 ymm registers: 2 rows x 4 vectors of accumulators + 4 of weights
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif

// A vector of weights as float32: float32 as it is, float16 and bfloat16 widened (`--quantization f16 | bf16`).
#if defined(__AVX512F__)
inline Vec vload_w(const float* p) { return vload(p); }
inline Vec vload_w(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec vload_w(const c10::BFloat16* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
#elif defined(SLUICE_AVX2)
inline Vec vload_w(const float* p) { return vload(p); }
inline Vec vload_w(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec vload_w(const c10::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
#endif

// Columns [c, c + V lanes) of one block (row stride B) of float32 or 16-bit weights (W) for R input rows, written
// to y (row stride ldy).
template <int R, int V = 4, typename W = float>
void f32_chunk(const float* x, int64_t K, const W* w, int64_t B, float* y, int64_t ldy, int64_t valid) {
#if defined(__AVX512F__) || defined(SLUICE_AVX2)
  Vec acc[R][V];
  for (int r = 0; r < R; ++r) for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * B;
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = vload_w(wk + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xr = vset1(x[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(xr, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[V * kLanes];
    for (int v = 0; v < V; ++v) vstore(out + v * kLanes, acc[r][v]);
    std::memcpy(y + r * ldy, out, sizeof(float) * std::min<int64_t>(valid, V * kLanes));
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < valid; ++c) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * static_cast<float>(w[k * B + c]);
      y[r * ldy + c] = s;
    }
  }
#endif
}

#if !defined(__AVX512F__) && !defined(SLUICE_AVX2)
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 4;
#endif

// Calls chunk_rows(block, column in block, first row, rows, valid columns) over every `width` columns of every
// block and every kRows rows.
template <typename Fn>
void for_each_block(int64_t M, int64_t N, int64_t B, int64_t width, Fn&& chunk_rows) {
  const int64_t blocks = (N + B - 1) / B;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t m = 0; m < M; m += kRows) {
        for (int64_t c = 0; c < B; c += width) {
          const int64_t n = b * B + c;
          if (n < N) chunk_rows(b, c, m, std::min(kRows, M - m), std::min(width, N - n));
        }
      }
    }
  });
}

#ifdef SLUICE_PACKED_BF16
// How many pair rows ahead a chunk of oneDNN's 32-column blocks (AMX machines) prefetches its column stream: on a
// Xeon with AMX the hardware prefetchers alone read 18 GB/s of bf16 blocks past the caches, against 23 GB/s for a
// plain sum. The 64-column blocks of AVX-512 machines without AMX stream without it: on 2 Zen 4 cores the
// prefetch made one-row bf16 steps slower (docs/history.md).
constexpr int64_t kPrefetchPairRows = 16;

// Columns [c, c + 16 V) of one bf16 block (a pair row holds 2B values) for R input rows: 16 columns per vector,
// each lane the dot product of one input pair with one column's pair (vdpbf16ps), accumulated in float32. V is 4
// for oneDNN's 64-column blocks (AVX-512 machines), 2 for its 32-column ones (AMX machines).
template <int R, int V>
void bf16_chunk(const uint16_t* x, int64_t Kp, const uint16_t* w, int64_t B, uint16_t* y, int64_t ldy,
                int64_t valid) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < Kp / 2; ++p) {
    const uint16_t* wp = w + p * 2 * B;
    if constexpr (V == 2) sluice::prefetch(wp + kPrefetchPairRows * 2 * B, 64 * V);  // the chunk's columns, ahead
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wp + 32 * v);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * Kp + 2 * p, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xr, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    uint16_t out[16 * V];
    for (int v = 0; v < V; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * v), (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
    }
    std::memcpy(y + r * ldy, out, sizeof(uint16_t) * std::min<int64_t>(valid, 16 * V));
  }
}
#endif

}  // namespace

int64_t packed_linear_f32_chunk() { return 4 * kLanes; }

bool packed_linear_bf16_is_native() {
#ifdef SLUICE_PACKED_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor packed_linear_bf16(const at::Tensor& x, int64_t weight_ptr, int64_t N, int64_t block,
                              int64_t k_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "packed_linear_bf16: bfloat16 x [M, K]");
#ifdef SLUICE_PACKED_BF16
  TORCH_CHECK(block % 32 == 0, "packed_linear_bf16: block ", block, " is not a multiple of 32");
  TORCH_CHECK(k_rows >= x.size(1) && k_rows % 2 == 0, "packed_linear_bf16: k_rows ", k_rows, " for K ", x.size(1));
  // The pairs run over K rounded up to even; an odd K reads a zero after each row's last input.
  const at::Tensor xc = x.size(1) % 2 ? at::constant_pad_nd(x, {0, 1}) : x.contiguous();
  const int64_t M = xc.size(0), Kp = xc.size(1);  // the pairs of x; a block holds k_rows / 2 pair rows
  at::Tensor y = at::empty({M, N}, xc.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight_ptr);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t width = block % 64 ? 32 : 64;
  for_each_block(M, N, block, width, [&](int64_t b, int64_t c, int64_t m, int64_t rows, int64_t valid) {
    const uint16_t* w = wp + b * block * k_rows + 2 * c;
    uint16_t* out = yp + m * N + b * block + c;
    const uint16_t* xm = xp + m * Kp;
    sluice::with_rows(rows, [&](auto r) {
      if (width == 64) bf16_chunk<r, 4>(xm, Kp, w, block, out, N, valid);
      else bf16_chunk<r, 2>(xm, Kp, w, block, out, N, valid);
    });
  });
  return y;
#else
  TORCH_CHECK(false, "packed_linear_bf16: built without AVX512_BF16");
#endif
}

namespace {

// y = x @ W.T for the fp32 layout's blocks of W (float32 or 16-bit) at wp.
template <typename W>
at::Tensor packed_float_rows(const at::Tensor& x, const W* wp, int64_t N, int64_t block, int64_t k_rows) {
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // AVX2's chunk (4 vectors, 32 columns) is half a 64-column block, so a pass reads every other pair of cache lines.
  // One row's sums fit the registers for the whole block (8 vectors): the weights then stream in order.
  constexpr int64_t kWhole = 64 / kLanes;
  const bool whole = M == 1 && block % 64 == 0;
  for_each_block(M, N, block, whole ? 64 : 4 * kLanes, [&](int64_t b, int64_t c, int64_t m, int64_t rows,
                                                            int64_t valid) {
    const W* w = wp + b * block * k_rows + c;
    float* out = yp + m * N + b * block + c;
    const float* xm = xp + m * K;
    if (whole) return f32_chunk<1, kWhole>(xm, K, w, block, out, N, valid);
    sluice::with_rows(rows, [&](auto r) { f32_chunk<r>(xm, K, w, block, out, N, valid); });
  });
  return y;
}

}  // namespace

at::Tensor packed_linear_f32(const at::Tensor& x, int64_t weight_ptr, int64_t N, int64_t block,
                             int64_t k_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed_linear_f32: float32 x [M, K]");
  TORCH_CHECK(block % (4 * kLanes) == 0, "packed_linear_f32: block ", block, " is not a multiple of ", 4 * kLanes);
  TORCH_CHECK(k_rows >= x.size(1), "packed_linear_f32: k_rows ", k_rows, " for K ", x.size(1));
  return packed_float_rows(x, reinterpret_cast<const float*>(weight_ptr), N, block, k_rows);
}

void check_half_blocks(const at::Tensor& w, int64_t N, const char* who) {
  TORCH_CHECK((w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16) && w.is_contiguous() &&
                  w.dim() == 3 && w.size(2) == kHalfBlock && w.size(0) * kHalfBlock >= N,
              who, ": a 16-bit weight (float16 or bfloat16) in contiguous blocks [ceil(N / ", kHalfBlock, "), K, ",
              kHalfBlock, "] for N = ", N);
}

at::Tensor packed_linear_half(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed_linear_half: float32 x [M, K]");
  check_half_blocks(w, N, "packed_linear_half");
  TORCH_CHECK(w.size(1) == x.size(1), "packed_linear_half: w's blocks hold ", w.size(1), " inputs, x ", x.size(1));
  if (w.scalar_type() == at::kHalf) return packed_float_rows(x, w.data_ptr<c10::Half>(), N, kHalfBlock, x.size(1));
  return packed_float_rows(x, w.data_ptr<c10::BFloat16>(), N, kHalfBlock, x.size(1));
}
