// Small element-wise kernels shared by modules.
#pragma once

#include <cstdint>

#include "core/bf16.hpp"
#include "core/kokkos_types.hpp"

namespace kmoe {

// out = a + b, all (rows, cols); out may alias a or b. out16 (bf16 runs): where out is also
// written rounded to bf16 (rows x cols, contiguous), for products.
inline void add(ConstMat a, ConstMat b, Mat out, std::uint16_t* out16 = nullptr) {
  const int cols = static_cast<int>(out.extent(1));
  Kokkos::parallel_for(
      "elementwise::add", Range2({0, 0}, {static_cast<int>(out.extent(0)), cols}),
      KOKKOS_LAMBDA(int i, int j) {
        const float v = a(i, j) + b(i, j);
        out(i, j) = v;
        if (out16) out16[std::int64_t(i) * cols + j] = bf16_bits(v);
      });
}

// out16 = x rounded to bf16 (rows x cols, contiguous).
inline void round_to_bf16(ConstMat x, std::uint16_t* out16) {
  const int cols = static_cast<int>(x.extent(1));
  Kokkos::parallel_for(
      "elementwise::round_to_bf16", Range2({0, 0}, {static_cast<int>(x.extent(0)), cols}),
      KOKKOS_LAMBDA(int i, int j) { out16[std::int64_t(i) * cols + j] = bf16_bits(x(i, j)); });
}

}  // namespace kmoe
