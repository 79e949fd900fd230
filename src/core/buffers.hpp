// Work buffers whose size depends on the data (rows received from other ranks, the rows of the
// busiest expert): grown to fit, never shrunk, so a steady run allocates only in its first
// steps.
#pragma once

#include <cstdint>
#include <string>

#include "core/kokkos_types.hpp"

namespace kmoe {

// Grows v to at least n elements (with a quarter of headroom); the contents are not kept.
template <class V>
void ensure_size(V& v, std::int64_t n, const std::string& label) {
  if (std::int64_t(v.extent(0)) < n) v = V(label, n + n / 4);
}

}  // namespace kmoe
