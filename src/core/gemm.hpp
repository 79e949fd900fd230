// C = alpha * op(A) op(B) + beta * C on contiguous row-major views, one KokkosBlas::gemm call
// (vendor BLAS underneath). Shapes are checked here: Kokkos Kernels checks only in debug builds.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.hpp"
#include "core/kokkos_types.hpp"

namespace kmoe {

enum class Trans { N, T };

// op(A): [m, k], op(B): [k, n], C: [m, n].
void gemm(Trans ta, Trans tb, float alpha, ConstMat A, ConstMat B, float beta, Mat C);

// A strided batch of products: for b in [0, batch), C_b = alpha op(A_b) op(B_b) + beta C_b, with
// X_b = X + b * stride_x, each a contiguous row-major matrix of the shape given (as gemm()'s
// operands). One cublasSgemmStridedBatched on CUDA builds with cuBLAS; gemm() per product
// elsewhere (vendor BLAS on CPUs).
struct Strided {
  const float* data;
  int rows, cols;
  std::int64_t stride;
};
void gemm_strided_batched(Trans ta, Trans tb, float alpha, Strided A, Strided B, float beta,
                          float* C, int c_rows, int c_cols, std::int64_t c_stride, int batch);

// train.precision for every later gemm(): fp32, or TF32 tensor cores (cuBLAS' TF32 math mode
// on the handle Kokkos Kernels calls through). Returns a line for the start-up log when the
// backend ignores the choice (CPUs; Kokkos Kernels without cuBLAS), else "". Throws on HIP,
// which has no TF32 path here.
std::string set_gemm_precision(Precision p);

}  // namespace kmoe
