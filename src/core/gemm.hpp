// C = alpha * op(A) op(B) + beta * C on contiguous row-major views, one KokkosBlas::gemm call
// (vendor BLAS underneath). Shapes are checked here: Kokkos Kernels checks only in debug builds.
#pragma once

#include "core/kokkos_types.hpp"

namespace kmoe {

enum class Trans { N, T };

// op(A): [m, k], op(B): [k, n], C: [m, n].
void gemm(Trans ta, Trans tb, float alpha, ConstMat A, ConstMat B, float beta, Mat C);

}  // namespace kmoe
