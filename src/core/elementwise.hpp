// Small element-wise kernels shared by modules.
#pragma once

#include "core/kokkos_types.hpp"

namespace kmoe {

// out = a + b, all (rows, cols); out may alias a or b.
inline void add(ConstMat a, ConstMat b, Mat out) {
  Kokkos::parallel_for(
      "elementwise::add",
      Range2({0, 0}, {static_cast<int>(out.extent(0)), static_cast<int>(out.extent(1))}),
      KOKKOS_LAMBDA(int i, int j) { out(i, j) = a(i, j) + b(i, j); });
}

}  // namespace kmoe
