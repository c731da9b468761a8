// Read bandwidth of a bf16 GEMV's weight stream (3.4 GB, a 1.7B model's bf16 weights) under several access
// patterns, against a plain sum: whether a different walk would read faster than Sluice's bf16_linear.cpp (one
// contiguous range of rows per thread). docs/history.md quotes it. Needs AVX512_BF16:
//   g++ -O3 -mavx512f -mavx512bw -mavx512bf16 -fopenmp bench/read_patterns.cpp -o /tmp/read_patterns
//   OMP_NUM_THREADS=2 /tmp/read_patterns 4
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int64_t K = 2048;  // inputs per row (SmolLM2-1.7B's hidden size)

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

float dot_row(const uint16_t* row, const uint16_t* x) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 64) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(row + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32), (__m512bh)_mm512_loadu_si512(row + k + 32));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// Four rows from four streams at once: more misses in flight per thread.
void dot_four(const uint16_t* const* rows, const uint16_t* x, float* out) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
    for (int s = 0; s < 4; ++s) a[s] = _mm512_dpbf16_ps(a[s], xv, (__m512bh)_mm512_loadu_si512(rows[s] + k));
  }
  for (int s = 0; s < 4; ++s) out[s] = _mm512_reduce_add_ps(a[s]);
}

}  // namespace

int main(int argc, char** argv) {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::fprintf(stderr, "read_patterns: this CPU has no AVX512_BF16\n");
    return 2;
  }
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 4;
  const int64_t N = int64_t(3.4e9) / (K * 2);
  auto* w = static_cast<uint16_t*>(std::aligned_alloc(64, N * K * 2));
#pragma omp parallel for
  for (int64_t i = 0; i < N * K; ++i) w[i] = 0x3f80 + (i & 7);  // touched by the threads that read it
  std::vector<uint16_t> x(K, 0x3f80);
  std::vector<float> y(N);
  const char* names[] = {"contiguous", "contiguous+prefetch", "four streams", "interleaved by 64", "plain sum"};
  for (int r = 0; r < rounds; ++r) {
    for (int v = 0; v < 5; ++v) {
      const double t0 = now();
      if (v == 0) {  // bf16_linear.cpp's walk
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) y[n] = dot_row(w + n * K, x.data());
      } else if (v == 1) {  // plus a software prefetch two rows ahead
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
          if (n + 2 < N)
            for (int64_t o = 0; o < K * 2; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w + (n + 2) * K) + o, _MM_HINT_T0);
          y[n] = dot_row(w + n * K, x.data());
        }
      } else if (v == 2) {
#pragma omp parallel
        {
          const int t = omp_get_thread_num(), T = omp_get_num_threads();
          const int64_t a = N * t / T, b = N * (t + 1) / T, q = (b - a) / 4;
          for (int64_t i = 0; i < q; ++i) {
            const uint16_t* rows[4] = {w + (a + i) * K, w + (a + q + i) * K, w + (a + 2 * q + i) * K,
                                       w + (a + 3 * q + i) * K};
            float o[4];
            dot_four(rows, x.data(), o);
            for (int s = 0; s < 4; ++s) y[a + s * q + i] = o[s];
          }
          for (int64_t n = a + 4 * q; n < b; ++n) y[n] = dot_row(w + n * K, x.data());
        }
      } else if (v == 3) {  // the threads take turns by 64 rows: both read near each other
#pragma omp parallel for schedule(static, 64)
        for (int64_t n = 0; n < N; ++n) y[n] = dot_row(w + n * K, x.data());
      } else {
        std::vector<float> total(omp_get_max_threads());
#pragma omp parallel
        {
          __m512 a = _mm512_setzero_ps();
#pragma omp for schedule(static)
          for (int64_t i = 0; i < N * K / 32; ++i) a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_loadu_si512(w + i * 32)));
          total[omp_get_thread_num()] = _mm512_reduce_add_ps(a);
        }
        y[0] = total[0];
      }
      const double t = now() - t0;
      std::printf("%s %.1f GB/s%s", names[v], N * K * 2 / t / 1e9, v == 4 ? "\n" : " | ");
    }
    std::fflush(stdout);
  }
  std::free(w);
  return y[1] == 12345.f ? 1 : 0;
}
