#include "core/gemm.hpp"

#include <KokkosBlas3_gemm.hpp>
#include <KokkosKernels_config.h>
#if defined(KOKKOS_ENABLE_CUDA) && defined(KOKKOSKERNELS_ENABLE_TPL_CUBLAS)
#include <KokkosBlas_tpl_spec.hpp>  // the cuBLAS handle Kokkos Kernels' gemm uses
#endif

#include "core/error.hpp"

namespace kmoe {

void gemm(Trans ta, Trans tb, float alpha, ConstMat A, ConstMat B, float beta, Mat C) {
  const int m = ta == Trans::N ? A.extent(0) : A.extent(1);
  const int ka = ta == Trans::N ? A.extent(1) : A.extent(0);
  const int kb = tb == Trans::N ? B.extent(0) : B.extent(1);
  const int n = tb == Trans::N ? B.extent(1) : B.extent(0);
  KMOE_REQUIRE(ka == kb && m == static_cast<int>(C.extent(0)) && n == static_cast<int>(C.extent(1)),
               "gemm: shape mismatch: op(A) " << m << "x" << ka << ", op(B) " << kb << "x" << n
                                              << ", C " << C.extent(0) << "x" << C.extent(1));
  if (m == 0 || n == 0) return;
  if (ka == 0) {
    // Kokkos Kernels returns early on an empty inner extent and would leave C stale.
    if (beta == 1.0f) return;
    Kokkos::parallel_for(
        "gemm::scale_c", Range2({0, 0}, {m, n}),
        KOKKOS_LAMBDA(int i, int j) { C(i, j) = beta == 0.0f ? 0.0f : beta * C(i, j); });
    return;
  }
  KokkosBlas::gemm(ta == Trans::N ? "N" : "T", tb == Trans::N ? "N" : "T", alpha, A, B, beta, C);
}

void gemm_strided_batched(Trans ta, Trans tb, float alpha, Strided A, Strided B, float beta,
                          float* C, int c_rows, int c_cols, std::int64_t c_stride, int batch) {
  if (batch == 0) return;
#if defined(KOKKOS_ENABLE_CUDA) && defined(KOKKOSKERNELS_ENABLE_TPL_CUBLAS)
  const int ka = ta == Trans::N ? A.cols : A.rows, kb = tb == Trans::N ? B.rows : B.cols;
  const int m = ta == Trans::N ? A.rows : A.cols, n = tb == Trans::N ? B.cols : B.rows;
  KMOE_REQUIRE(ka == kb && m == c_rows && n == c_cols,
               "gemm_strided_batched: shape mismatch: op(A) " << m << "x" << ka << ", op(B) " << kb
                                                              << "x" << n << ", C " << c_rows
                                                              << "x" << c_cols);
  if (m > 0 && n > 0 && ka > 0) {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's part comes first.
    auto& blas = KokkosBlas::Impl::CudaBlasSingleton::singleton();
    cublasStatus_t st = cublasSetStream(blas.handle, ExecSpace().cuda_stream());
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasSgemmStridedBatched(
          blas.handle, tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T,
          ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T, n, m, ka, &alpha, B.data, B.cols, B.stride,
          A.data, A.cols, A.stride, &beta, C, c_cols, c_stride, batch);
    cublasSetStream(blas.handle, nullptr);
    KMOE_REQUIRE(st == CUBLAS_STATUS_SUCCESS,
                 "cublasSgemmStridedBatched failed (" << int(st) << ")");
    return;
  }
#endif
  for (int b = 0; b < batch; ++b)
    gemm(ta, tb, alpha, as_cmat(A.data + b * A.stride, A.rows, A.cols),
         as_cmat(B.data + b * B.stride, B.rows, B.cols), beta,
         as_mat(C + b * c_stride, c_rows, c_cols));
}

std::string set_gemm_precision(Precision p) {
#if defined(KOKKOS_ENABLE_CUDA) && defined(KOKKOSKERNELS_ENABLE_TPL_CUBLAS)
  auto& blas = KokkosBlas::Impl::CudaBlasSingleton::singleton();
  const cublasStatus_t st = cublasSetMathMode(
      blas.handle, p == Precision::Tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH);
  KMOE_REQUIRE(st == CUBLAS_STATUS_SUCCESS,
               "train.precision = " << choice_name(p) << ": cublasSetMathMode failed (" << int(st)
                                    << ")");
  return "";
#elif defined(KOKKOS_ENABLE_CUDA)
  return p == Precision::Tf32 ? "train.precision = tf32 has no effect: Kokkos Kernels was built "
                                "without cuBLAS, GEMMs run in fp32"
                              : "";
#elif defined(KOKKOS_ENABLE_HIP)
  KMOE_REQUIRE(p == Precision::Fp32,
               "train.precision = tf32 is not available on HIP builds (no TF32 math mode is "
               "set through rocBLAS); use fp32");
  return "";
#else
  return p == Precision::Tf32 ? std::string("train.precision = tf32 has no effect on the ") +
                                    ExecSpace::name() + " backend: GEMMs run in fp32"
                              : "";
#endif
}

}  // namespace kmoe
