// Measures the sgemm rate kmoe reaches through its GEMM helper (the peak MFU is quoted against).
#include <chrono>
#include <cstdio>

#include "core/gemm.hpp"

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  using namespace kmoe;
  const int sizes[][3] = {{2048, 768, 256}, {2048, 256, 768}, {1024, 1024, 1024}};
  for (const auto& s : sizes) {
    const int m = s[0], n = s[1], k = s[2];
    View2F a("a", m, k), b("b", n, k), c("c", m, n);
    Kokkos::deep_copy(a, 0.5f);
    Kokkos::deep_copy(b, 0.25f);
    gemm(Trans::N, Trans::T, 1.0f, as_cmat(a), as_cmat(b), 0.0f, as_mat(c));
    const int reps = 20;
    Kokkos::fence();
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) gemm(Trans::N, Trans::T, 1.0f, as_cmat(a), as_cmat(b), 0.0f, as_mat(c));
    Kokkos::fence();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("sgemm %dx%dx%d (A B^T): %.1f GFLOP/s\n", m, n, k, 2.0 * m * n * k * reps / dt / 1e9);
  }
  return 0;
}
