// Contiguous segments of a range (the MoE experts' row blocks, a grouped GEMM's row tiles, a
// dispatch's received blocks), each given by its first position: the one search every kernel
// that maps a position to its segment uses.
#pragma once

#include <cstdint>

#include "core/kokkos_types.hpp"

namespace kmoe {

// The segment holding position i: with `starts` (anything indexable with operator(): a View,
// on the device) ascending first positions of `segments` segments and starts(0) <= i, the last
// s in [0, segments) with starts(s) <= i. Empty segments (a start equal to the next) are never
// returned unless the last; a binary search, log2(segments) steps.
template <class Starts>
KOKKOS_INLINE_FUNCTION int segment_of(const Starts& starts, int segments, std::int64_t i) {
  int lo = 0, hi = segments;  // starts(lo) <= i < starts(hi), starts(segments) = past the end
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (starts(mid) <= i)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace kmoe
