#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/error.hpp"
#include "core/gemm.hpp"

namespace kmoe {
namespace {

// C = alpha op(A) op(B) + beta C against a naive triple loop, all four transpose combinations.
void check_gemm(Trans ta, Trans tb, int m, int n, int k, float alpha, float beta) {
  std::mt19937 gen(m * 131 + n * 17 + k);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int ar = ta == Trans::N ? m : k, ac = ta == Trans::N ? k : m;
  const int br = tb == Trans::N ? k : n, bc = tb == Trans::N ? n : k;
  View2F A("A", ar, ac), B("B", br, bc), C("C", m, n);
  auto hA = Kokkos::create_mirror_view(A);
  auto hB = Kokkos::create_mirror_view(B);
  auto hC = Kokkos::create_mirror_view(C);
  for (int i = 0; i < ar; ++i)
    for (int j = 0; j < ac; ++j) hA(i, j) = u(gen);
  for (int i = 0; i < br; ++i)
    for (int j = 0; j < bc; ++j) hB(i, j) = u(gen);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) hC(i, j) = u(gen);
  std::vector<double> expect(static_cast<size_t>(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int p = 0; p < k; ++p) {
        const double a = ta == Trans::N ? hA(i, p) : hA(p, i);
        const double b = tb == Trans::N ? hB(p, j) : hB(j, p);
        s += a * b;
      }
      expect[i * n + j] = alpha * s + beta * hC(i, j);
    }
  Kokkos::deep_copy(A, hA);
  Kokkos::deep_copy(B, hB);
  Kokkos::deep_copy(C, hC);
  gemm(ta, tb, alpha, as_cmat(A), as_cmat(B), beta, as_mat(C));
  Kokkos::deep_copy(hC, C);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) ASSERT_NEAR(hC(i, j), expect[i * n + j], 1e-4) << i << "," << j;
}

TEST(Gemm, AllTransposeCombinations) {
  for (Trans ta : {Trans::N, Trans::T})
    for (Trans tb : {Trans::N, Trans::T}) check_gemm(ta, tb, 7, 5, 9, 0.7f, 0.3f);
}

TEST(Gemm, BetaOneAccumulates) { check_gemm(Trans::T, Trans::N, 4, 6, 3, 1.0f, 1.0f); }

// An expert that received no tokens: k = 0 must still apply beta (0 -> zeros, not stale C).
TEST(Gemm, ZeroInnerExtentAppliesBeta) {
  View2F A("A", 0, 3), B("B", 0, 4), C("C", 3, 4);
  Kokkos::deep_copy(C, 5.0f);
  gemm(Trans::T, Trans::N, 1.0f, as_cmat(A), as_cmat(B), 0.0f, as_mat(C));
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), C);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) EXPECT_EQ(h(i, j), 0.0f);
  Kokkos::deep_copy(C, 5.0f);
  gemm(Trans::T, Trans::N, 1.0f, as_cmat(A), as_cmat(B), 0.5f, as_mat(C));
  Kokkos::deep_copy(h, C);
  EXPECT_EQ(h(2, 3), 2.5f);
  check_gemm(Trans::N, Trans::N, 3, 4, 0, 1.0f, 0.25f);
}

TEST(Gemm, ZeroOuterExtentIsNoop) { check_gemm(Trans::N, Trans::T, 0, 4, 3, 1.0f, 0.0f); }

TEST(Gemm, ShapeMismatchThrows) {
  View2F A("A", 3, 4), B("B", 5, 6), C("C", 3, 6);
  EXPECT_THROW(gemm(Trans::N, Trans::N, 1.0f, as_cmat(A), as_cmat(B), 0.0f, as_mat(C)), Error);
}

}  // namespace
}  // namespace kmoe
