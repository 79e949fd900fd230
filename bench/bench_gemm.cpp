// Measures the sgemm rate kmoe reaches through its GEMM helper (the peak MFU is quoted against).
#include <chrono>
#include <cstdio>

#include "core/gemm.hpp"

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  using namespace kmoe;
  const RunContext ctx;  // fp32 products
  // The tiny model's projection shapes, then large squares for the machine's peak.
  const int sizes[][3] = {
      {2048, 768, 256}, {2048, 256, 768}, {1024, 1024, 1024}, {2048, 2048, 2048}};
  double peak = 0.0;
  for (const auto& s : sizes) {
    const int m = s[0], n = s[1], k = s[2];
    View2F a("a", m, k), b("b", n, k), c("c", m, n);
    Kokkos::deep_copy(a, 0.5f);
    Kokkos::deep_copy(b, 0.25f);
    gemm(ctx, Trans::N, Trans::T, 1.0f, as_cmat(a), as_cmat(b), 0.0f, as_mat(c));
    const int reps = m * n * k > (1 << 30) ? 4 : 20;
    Kokkos::fence();
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r)
      gemm(ctx, Trans::N, Trans::T, 1.0f, as_cmat(a), as_cmat(b), 0.0f, as_mat(c));
    Kokkos::fence();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double rate = 2.0 * m * n * k * reps / dt / 1e9;
    peak = rate > peak ? rate : peak;
    std::printf("sgemm %dx%dx%d (A B^T): %.1f GFLOP/s\n", m, n, k, rate);
  }
  std::printf("sgemm_peak_gflops %.1f\n", peak);
  return 0;
}
