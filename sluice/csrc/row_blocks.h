// How the few-row linears walk their input: blocks of up to kRowBlock rows, each block one pass over the weights.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace sluice {

// Rows per pass: each weight element loaded is used this many times, and 4 rows x 2 accumulators fit in registers.
constexpr int64_t kRowBlock = 4;

// How far ahead of what it reads a linear prefetches its weight stream. Unpacking blocks is compute enough that
// the hardware prefetchers fall behind on some CPUs (a Q4_K GEMV over weights past the caches read 6.4 GB/s on
// 2 Xeon cores that stream 23); a weight's rows are contiguous, so the distance runs on into the next row.
constexpr int64_t kPrefetchBytes = 2048;

// Prefetches the cache lines of [p, p + bytes): a hint, never a fault (past an allocation's end it is dropped).
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at);
}

// Calls fn(std::integral_constant<int, R>{}) with R = rows (1..kMax, kMax at most 8) known at compile time, so the
// kernel's per-row arrays and loops unroll.
template <int kMax = kRowBlock, typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  static_assert(kMax >= 1 && kMax <= 8);
  const auto call = [&](auto r) {
    if constexpr (decltype(r)::value <= kMax) fn(r);
  };
  switch (std::min<int64_t>(rows, kMax)) {
    case 1: call(std::integral_constant<int, 1>{}); break;
    case 2: call(std::integral_constant<int, 2>{}); break;
    case 3: call(std::integral_constant<int, 3>{}); break;
    case 4: call(std::integral_constant<int, 4>{}); break;
    case 5: call(std::integral_constant<int, 5>{}); break;
    case 6: call(std::integral_constant<int, 6>{}); break;
    case 7: call(std::integral_constant<int, 7>{}); break;
    default: call(std::integral_constant<int, 8>{}); break;
  }
}

// Calls fn(std::integral_constant<int, R>{}, m) for each block [m, m + R) of M rows, R up to kMax (see with_rows).
template <int kMax = kRowBlock, typename Fn>
inline void for_each_row_block(int64_t M, Fn&& fn) {
  for (int64_t m = 0; m < M; m += kMax) {
    with_rows<kMax>(M - m, [&](auto rows) { fn(rows, m); });
  }
}

// Bytes of weights a tile holds when several row blocks read them: they stay in L2 (at least 512 KiB on the CPUs
// these kernels build for) from the first block's pass to the last's.
constexpr int64_t kTileBytes = 128 * 1024;

// Calls fn(std::integral_constant<int, R>{}, m, t0, t1) for each block [m, m + R) of M rows over each tile
// [t0, t1) of the output units [u0, u1), a tile holding about kTileBytes of weights (unit_bytes a unit): past
// kMax rows the row blocks then take turns on a tile in cache instead of each streaming the weights again.
template <int kMax = kRowBlock, typename Fn>
inline void for_each_tile(int64_t M, int64_t u0, int64_t u1, int64_t unit_bytes, Fn&& fn) {
  const int64_t tile = M <= kMax ? u1 - u0 : std::max<int64_t>(1, kTileBytes / std::max<int64_t>(1, unit_bytes));
  for (int64_t t0 = u0; t0 < u1; t0 += tile) {
    const int64_t t1 = std::min(u1, t0 + tile);
    for_each_row_block<kMax>(M, [&](auto rows, int64_t m) { fn(rows, m, t0, t1); });
  }
}

}  // namespace sluice
