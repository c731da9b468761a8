// How the few-row linears walk their input: blocks of up to kRowBlock rows, each block one pass over the weights.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace sluice {

// Rows per pass: each weight element loaded is used this many times, and 4 rows x 2 accumulators fit in registers.
constexpr int64_t kRowBlock = 4;

// Calls fn(std::integral_constant<int, R>{}, m) for each block [m, m + R) of M rows, R a compile-time 1..4, so
// the kernel's per-row arrays and loops unroll.
template <typename Fn>
inline void for_each_row_block(int64_t M, Fn&& fn) {
  for (int64_t m = 0; m < M; m += kRowBlock) {
    switch (std::min(kRowBlock, M - m)) {
      case 1: fn(std::integral_constant<int, 1>{}, m); break;
      case 2: fn(std::integral_constant<int, 2>{}, m); break;
      case 3: fn(std::integral_constant<int, 3>{}, m); break;
      default: fn(std::integral_constant<int, 4>{}, m); break;
    }
  }
}

}  // namespace sluice
