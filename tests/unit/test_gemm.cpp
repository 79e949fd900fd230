#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/column_sums.hpp"
#include "core/error.hpp"
#include "core/gemm.hpp"
#include "core/grouped_gemm.hpp"
#include "core/segments.hpp"

namespace kmoe {
namespace {

// C = alpha op(A) op(B) + beta C in ctx's precision against a naive triple loop, all four
// transpose combinations. bf16: the loop multiplies the bf16-rounded inputs (MODEL.md section
// 8), and most elements must be farther than the tolerance from the product of the unrounded
// ones.
void check_gemm(Trans ta, Trans tb, int m, int n, int k, float alpha, float beta,
                const RunContext& ctx = RunContext()) {
  const bool bf16 = ctx.bf16();
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
  std::vector<double> expect(static_cast<size_t>(m) * n), exact(expect.size());
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0, s_exact = 0;
      for (int p = 0; p < k; ++p) {
        const float a = ta == Trans::N ? hA(i, p) : hA(p, i);
        const float b = tb == Trans::N ? hB(p, j) : hB(j, p);
        s += bf16 ? double(round_bf16(a)) * round_bf16(b) : double(a) * b;
        s_exact += double(a) * b;
      }
      expect[i * n + j] = alpha * s + beta * hC(i, j);
      exact[i * n + j] = alpha * s_exact + beta * hC(i, j);
    }
  Kokkos::deep_copy(A, hA);
  Kokkos::deep_copy(B, hB);
  Kokkos::deep_copy(C, hC);
  gemm(ctx, ta, tb, alpha, as_cmat(A), as_cmat(B), beta, as_mat(C));
  Kokkos::deep_copy(hC, C);
  int away = 0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      ASSERT_NEAR(hC(i, j), expect[i * n + j], 1e-4) << i << "," << j;
      away += std::abs(hC(i, j) - exact[i * n + j]) > 1e-4;
    }
  if (bf16) {
    EXPECT_GT(away, m * n / 2) << "bf16 products no farther from the fp32 ones than fp32's error";
  }
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
  gemm(RunContext(), Trans::T, Trans::N, 1.0f, as_cmat(A), as_cmat(B), 0.0f, as_mat(C));
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), C);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) EXPECT_EQ(h(i, j), 0.0f);
  Kokkos::deep_copy(C, 5.0f);
  gemm(RunContext(), Trans::T, Trans::N, 1.0f, as_cmat(A), as_cmat(B), 0.5f, as_mat(C));
  Kokkos::deep_copy(h, C);
  EXPECT_EQ(h(2, 3), 2.5f);
  check_gemm(Trans::N, Trans::N, 3, 4, 0, 1.0f, 0.25f);
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  const float ulp = std::ldexp(1.0f, -7);  // bf16's spacing in [1, 2)
  EXPECT_EQ(round_bf16(1.0f), 1.0f);
  EXPECT_EQ(round_bf16(1.0f + 0.5f * ulp), 1.0f);                        // tie: to even (down)
  EXPECT_EQ(round_bf16(1.0f + 1.5f * ulp), 1.0f + 2 * ulp);              // tie: to even (up)
  EXPECT_EQ(round_bf16(1.0f + 0.5f * ulp + std::ldexp(1.0f, -20)), 1.0f + ulp);  // past the tie
  EXPECT_EQ(round_bf16(-3.0f - 0.25f * ulp), -3.0f);
  EXPECT_EQ(bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  const float big = std::numeric_limits<float>::max();
  EXPECT_TRUE(std::isinf(round_bf16(big)) && round_bf16(big) > 0);  // beyond bf16's largest
  EXPECT_TRUE(std::isinf(round_bf16(-std::numeric_limits<float>::infinity())));
  EXPECT_TRUE(std::isnan(round_bf16(std::numeric_limits<float>::quiet_NaN())));
  const float tiny = std::ldexp(1.0f, -130);  // a subnormal, kept as bf16 subnormal
  EXPECT_EQ(round_bf16(tiny), tiny);
  EXPECT_EQ(round_bf16(0.0f), 0.0f);
}

TEST(Gemm, Bf16ProductsSumRoundedInputsInFp32) {
  const RunContext bf = make_run_context(Precision::Bf16);
  ASSERT_TRUE(bf.bf16());
  for (Trans ta : {Trans::N, Trans::T})
    for (Trans tb : {Trans::N, Trans::T}) check_gemm(ta, tb, 7, 5, 9, 0.7f, 0.3f, bf);
  // The router's products keep fp32 inputs in a bf16 run.
  check_gemm(Trans::N, Trans::T, 6, 4, 11, 1.0f, 0.0f, bf.exact_fp32());
}

// Nothing outside the context decides a product's precision: fp32 and bf16 contexts used in
// turn in one process each give their own products.
TEST(Gemm, ContextsOfTwoPrecisionsSideBySide) {
  const RunContext bf = make_run_context(Precision::Bf16), fp = make_run_context(Precision::Fp32);
  for (int round = 0; round < 2; ++round) {
    check_gemm(Trans::N, Trans::T, 7, 5, 9, 1.0f, 0.0f, bf);
    check_gemm(Trans::N, Trans::T, 7, 5, 9, 1.0f, 0.0f, fp);
  }
}

#if !defined(KOKKOS_ENABLE_CUDA)
// No TF32 without cuBLAS (CPUs, HIP): an error naming the key.
TEST(Gemm, Tf32WithoutCublasIsAnError) {
  try {
    make_run_context(Precision::Tf32);
    FAIL() << "tf32 accepted on " << ExecSpace::name();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.precision = tf32"), std::string::npos) << e.what();
  }
}
#endif

TEST(Gemm, ZeroOuterExtentIsNoop) { check_gemm(Trans::N, Trans::T, 0, 4, 3, 1.0f, 0.0f); }

TEST(Gemm, ShapeMismatchThrows) {
  View2F A("A", 3, 4), B("B", 5, 6), C("C", 3, 6);
  EXPECT_THROW(
      gemm(RunContext(), Trans::N, Trans::N, 1.0f, as_cmat(A), as_cmat(B), 0.0f, as_mat(C)),
      Error);
}

// Grouped GEMMs against per-group double-precision loops: group sizes 0, 1, a tile edge and a
// few tiles (the row offsets only on the device), inner extents and widths off the tile sizes,
// both weight orientations, beta 0 and 1; rows outside the groups and the weights of a group
// without rows are untouched; a second run is bit-identical.
// bf16 contexts: the loops multiply the bf16-rounded inputs (the kernel rounds them as it loads
// them).
void check_grouped(const RunContext& ctx) {
  const bool bf16 = ctx.bf16();
  auto q = [bf16](float x) { return bf16 ? round_bf16(x) : x; };
  const std::vector<int> sizes = {5, 0, 33, 1, 70};
  const int G = static_cast<int>(sizes.size()), K = 40, n = 37, spare = 9;
  std::vector<int> off(G + 1, 0);
  for (int g = 0; g < G; ++g) off[g + 1] = off[g] + sizes[g];
  const int rows = off[G], cap = rows + spare;  // the bound the launch covers
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto random = [&](std::size_t count) {
    std::vector<float> v(count);
    for (auto& x : v) x = u(gen);
    return v;
  };
  auto upload = [](const std::vector<float>& h) {
    View1F v("v", h.size());
    Kokkos::deep_copy(v, Kokkos::View<const float*, HostSpace, Unmanaged>(h.data(), h.size()));
    return v;
  };
  auto download = [](const View1F& v) {
    auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), v);
    return std::vector<float>(h.data(), h.data() + h.size());
  };
  View1I d_off("off", G + 1);
  Kokkos::deep_copy(d_off, Kokkos::View<const int*, HostSpace, Unmanaged>(off.data(), G + 1));
  GroupedGemm gg(ctx, G);
  gg.plan(ConstIVec(d_off.data(), G + 1), cap);

  const auto A = random(std::size_t(cap) * K), W = random(std::size_t(G) * n * K);
  const auto C0 = random(std::size_t(cap) * n);
  for (Trans tw : {Trans::T, Trans::N})
    for (float beta : {0.0f, 1.0f}) {
      View1F dA = upload(A), dW = upload(W), dC = upload(C0);
      gg.rows(tw, 0.5f, dA.data(), K, dW.data(), std::int64_t(n) * K, beta, dC.data(), n);
      const auto got = download(dC);
      for (int g = 0; g < G; ++g)
        for (int r = off[g]; r < off[g + 1]; ++r)
          for (int j = 0; j < n; ++j) {
            double acc = 0.0;
            for (int p = 0; p < K; ++p) {
              const float w = tw == Trans::T ? W[(std::size_t(g) * n + j) * K + p]
                                             : W[(std::size_t(g) * K + p) * n + j];
              acc += double(q(A[std::size_t(r) * K + p])) * q(w);
            }
            const double want = 0.5 * acc + beta * C0[std::size_t(r) * n + j];
            ASSERT_NEAR(got[std::size_t(r) * n + j], want, 1e-4) << g << " " << r << " " << j;
          }
      for (std::size_t i = std::size_t(rows) * n; i < got.size(); ++i)
        ASSERT_EQ(got[i], C0[i]) << "row past the groups, element " << i;
      View1F again = upload(C0);
      gg.rows(tw, 0.5f, dA.data(), K, dW.data(), std::int64_t(n) * K, beta, again.data(), n);
      EXPECT_EQ(download(again), got);
    }

  // G_g (m x n) += alpha A_g^T B_g, A rows x m, B rows x n.
  const int m = K;
  const auto B = random(std::size_t(cap) * n), G0 = random(std::size_t(G) * m * n);
  View1F dA = upload(A), dB = upload(B), dG = upload(G0);
  gg.weight_grads(2.0f, dA.data(), m, dB.data(), n, dG.data(), std::int64_t(m) * n);
  const auto got = download(dG);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double acc = 0.0;
        for (int r = off[g]; r < off[g + 1]; ++r)
          acc += double(q(A[std::size_t(r) * m + i])) * q(B[std::size_t(r) * n + j]);
        const std::size_t at = (std::size_t(g) * m + i) * n + j;
        if (sizes[g] == 0)
          ASSERT_EQ(got[at], G0[at]) << "group without rows, " << i << "," << j;
        else
          ASSERT_NEAR(got[at], G0[at] + 2.0 * acc, 1e-4) << g << " " << i << " " << j;
      }
}

TEST(GroupedGemm, RowsAndWeightGradientsMatchPerGroupProducts) { check_grouped(RunContext()); }

TEST(GroupedGemm, Bf16RoundsTheInputsAsTheyLoad) {
  std::printf("bf16 grouped products on %s\n",
              grouped_gemm_tensor_cores() ? "tensor cores" : "the scalar tiled kernel");
  check_grouped(make_run_context(Precision::Bf16));
}

// The tensor-core kernel's tiling (bf16 staged in scratch 32 of k at a time, 16 x 16 quarters,
// k-major A for the weight gradients) on every build: where there are no tensor cores one
// thread computes its fragments.
TEST(GroupedGemm, Bf16FragmentTilesMatchPerGroupProducts) {
  RunContext tiles = make_run_context(Precision::Bf16);
  tiles.fragment_tiles = true;
  check_grouped(tiles);
}

// segment_of for positions [0, n) on the device (a kernel: outside a TEST body, which nvcc
// cannot host).
std::vector<int> segments_of(const std::vector<int>& starts, int segments, int n) {
  View1I d("starts", starts.size()), got("got", n);
  Kokkos::deep_copy(d, Kokkos::View<const int*, HostSpace, Unmanaged>(starts.data(), starts.size()));
  Kokkos::parallel_for(
      "test::segment_of", Range(0, n), KOKKOS_LAMBDA(int i) { got(i) = segment_of(d, segments, i); });
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), got);
  return std::vector<int>(h.data(), h.data() + n);
}

// The one segment search (grouped GEMM tiles, MoE expert blocks, dispatch blocks): the last
// segment starting at or before a position, empty segments skipped.
TEST(Segments, PositionToItsSegment) {
  // 6 segments; 1 and 4 are empty.
  EXPECT_EQ(segments_of({0, 3, 3, 4, 9, 9, 12}, 6, 12),
            (std::vector<int>{0, 0, 0, 2, 3, 3, 3, 3, 3, 5, 5, 5}));
  EXPECT_EQ(segments_of({0, 5}, 1, 5), (std::vector<int>(5, 0)));
}

TEST(GroupedGemm, OffsetsOfTheWrongLengthThrow) {
  GroupedGemm gg(RunContext(), 3);
  View1I off("off", 3);
  EXPECT_THROW(gg.plan(ConstIVec(off.data(), 3), 10), Error);
}

// A strided batch against one gemm() per product (on CUDA builds: cublasSgemmStridedBatched, and
// cublasGemmStridedBatchedEx with bf16 inputs), fp32 and bf16.
TEST(Gemm, StridedBatchMatchesOneProductEach) {
  const int batch = 3, m = 6, n = 5, k = 7;
  for (Precision p : {Precision::Fp32, Precision::Bf16})
  for (Trans ta : {Trans::N, Trans::T})
    for (Trans tb : {Trans::N, Trans::T}) {
      const RunContext ctx = make_run_context(p);
      const int ar = ta == Trans::N ? m : k, ac = ta == Trans::N ? k : m;
      const int br = tb == Trans::N ? k : n, bc = tb == Trans::N ? n : k;
      const std::int64_t sa = ar * ac + 3, sb = br * bc + 1, sc = m * n + 2;  // gaps between
      std::mt19937 gen(7);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      auto filled = [&](std::int64_t count) {
        View1F v("v", count);
        auto h = Kokkos::create_mirror_view(v);
        for (std::int64_t i = 0; i < count; ++i) h(i) = u(gen);
        Kokkos::deep_copy(v, h);
        return v;
      };
      View1F A = filled(sa * batch), B = filled(sb * batch), C = filled(sc * batch);
      View1F want("want", C.extent(0));
      Kokkos::deep_copy(want, C);
      for (int b = 0; b < batch; ++b)
        gemm(ctx, ta, tb, 0.5f, as_cmat(A.data() + b * sa, ar, ac), as_cmat(B.data() + b * sb, br, bc),
             0.25f, as_mat(want.data() + b * sc, m, n));
      gemm_strided_batched(ctx, ta, tb, 0.5f, {A.data(), ar, ac, sa}, {B.data(), br, bc, sb}, 0.25f,
                           C.data(), m, n, sc, batch);
      auto got = Kokkos::create_mirror_view_and_copy(HostSpace(), C);
      auto ref = Kokkos::create_mirror_view_and_copy(HostSpace(), want);
      for (std::size_t i = 0; i < got.extent(0); ++i) ASSERT_NEAR(got(i), ref(i), 1e-5) << i;
    }
}

// Operands whose rows lie further apart than their columns (a column range of wider matrices):
// the same products as contiguous copies of them, fp32 and bf16; the bytes between rows of C
// untouched. On builds without such products (HIP) the call is an error.
TEST(Gemm, StridedBatchWithRowsApart) {
  const int batch = 2, m = 5, n = 4, k = 3, pad = 3;
  for (Precision p : {Precision::Fp32, Precision::Bf16})
    for (Trans ta : {Trans::N, Trans::T})
      for (Trans tb : {Trans::N, Trans::T}) {
        const RunContext ctx = make_run_context(p);
        const int ar = ta == Trans::N ? m : k, ac = ta == Trans::N ? k : m;
        const int br = tb == Trans::N ? k : n, bc = tb == Trans::N ? n : k;
        const int lda = ac + pad, ldb = bc + 1, ldc = n + 2;
        const std::int64_t sa = ar * lda, sb = br * ldb, sc = m * ldc;
        std::mt19937 gen(11);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::vector<float> a(sa * batch), b(sb * batch), c(sc * batch);
        for (auto* v : {&a, &b, &c})
          for (auto& x : *v) x = u(gen);
        auto dev = [](const std::vector<float>& h) {
          View1F v("v", h.size());
          Kokkos::deep_copy(
              v, Kokkos::View<const float*, HostSpace, Unmanaged>(h.data(), h.size()));
          return v;
        };
        // Contiguous copies: product i's operands and C, and the want through gemm().
        auto packed = [](const std::vector<float>& x, std::int64_t stride, int rows, int cols,
                         int ld, int i) {
          std::vector<float> out(std::size_t(rows) * cols);
          for (int r = 0; r < rows; ++r)
            for (int j = 0; j < cols; ++j) out[r * cols + j] = x[i * stride + r * ld + j];
          return out;
        };
        View1F A = dev(a), B = dev(b), C = dev(c);
        if (!gemm_rows_apart()) {
          EXPECT_THROW(gemm_strided_batched(ctx, ta, tb, 0.5f, {A.data(), ar, ac, sa, nullptr, lda},
                                            {B.data(), br, bc, sb, nullptr, ldb}, 0.25f, C.data(),
                                            m, n, sc, batch, ldc),
                       Error);
          continue;
        }
        gemm_strided_batched(ctx, ta, tb, 0.5f, {A.data(), ar, ac, sa, nullptr, lda},
                             {B.data(), br, bc, sb, nullptr, ldb}, 0.25f, C.data(), m, n, sc,
                             batch, ldc);
        auto got = Kokkos::create_mirror_view_and_copy(HostSpace(), C);
        for (int i = 0; i < batch; ++i) {
          View1F pa = dev(packed(a, sa, ar, ac, lda, i)), pb = dev(packed(b, sb, br, bc, ldb, i)),
                 pc = dev(packed(c, sc, m, n, ldc, i));
          gemm(ctx, ta, tb, 0.5f, as_cmat(pa.data(), ar, ac), as_cmat(pb.data(), br, bc), 0.25f,
               as_mat(pc.data(), m, n));
          auto want = Kokkos::create_mirror_view_and_copy(HostSpace(), pc);
          for (int r = 0; r < m; ++r)
            for (int j = 0; j < ldc; ++j) {
              const std::int64_t at = i * sc + r * ldc + j;
              if (j < n)
                ASSERT_NEAR(got(at), want(r * n + j), 1e-6) << i << " " << r << " " << j;
              else
                ASSERT_EQ(got(at), c[at]) << "between rows " << i << " " << r << " " << j;
            }
        }
      }
}

// A strided batch's products side by side on the host threads (RunContext::batch_threads, the
// OpenMP path): bit for bit the products one after the other, and within 1e-5 of a double loop;
// contiguous and rows apart, fp32 and bf16, every transpose, a single-column product (Kokkos
// Kernels' gemv: never side by side) among them. GPU builds keep their library's batch.
TEST(Gemm, StridedBatchSideBySideMatchesOneAfterTheOther) {
  if (!Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible) GTEST_SKIP();
  if (make_run_context(Precision::Fp32, 4).batch_threads == 1)
    GTEST_SKIP() << "no host-thread GEMM batches (no host BLAS on host memory, or device paths)";
  if (Kokkos::DefaultHostExecutionSpace().concurrency() < 2)
    GTEST_SKIP() << "one host thread: side by side is one after the other here";
  const int batch = 9, m = 17, k = 11;
  for (int n : {13, 1})
    for (int pad : {0, 2})
      for (Precision p : {Precision::Fp32, Precision::Bf16})
        for (Trans ta : {Trans::N, Trans::T})
          for (Trans tb : {Trans::N, Trans::T}) {
            const int ar = ta == Trans::N ? m : k, ac = ta == Trans::N ? k : m;
            const int br = tb == Trans::N ? k : n, bc = tb == Trans::N ? n : k;
            const int lda = ac + pad, ldb = bc + pad, ldc = n + pad;
            if (pad > 0 && !gemm_rows_apart()) continue;
            const std::int64_t sa = ar * lda + 1, sb = br * ldb + 2, sc = m * ldc + 3;
            std::mt19937 gen(5);
            std::uniform_real_distribution<float> u(-1.0f, 1.0f);
            std::vector<float> a(sa * batch), b(sb * batch), c(sc * batch);
            for (auto* v : {&a, &b, &c})
              for (auto& x : *v) x = p == Precision::Bf16 ? round_bf16(u(gen)) : u(gen);
            View1F A("A", a.size()), B("B", b.size());
            Kokkos::deep_copy(A,
                              Kokkos::View<const float*, HostSpace, Unmanaged>(a.data(), a.size()));
            Kokkos::deep_copy(B,
                              Kokkos::View<const float*, HostSpace, Unmanaged>(b.data(), b.size()));
            auto run = [&](int threads) {
              const RunContext ctx = make_run_context(p, threads);
              EXPECT_EQ(ctx.batch_threads, threads);
              View1F C("C", c.size());
              Kokkos::deep_copy(
                  C, Kokkos::View<const float*, HostSpace, Unmanaged>(c.data(), c.size()));
              gemm_strided_batched(ctx, ta, tb, 0.5f, {A.data(), ar, ac, sa, nullptr, pad ? lda : 0},
                                   {B.data(), br, bc, sb, nullptr, pad ? ldb : 0}, 0.25f, C.data(),
                                   m, n, sc, batch, pad ? ldc : 0);
              Kokkos::fence();
              auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), C);
              return std::vector<float>(h.data(), h.data() + h.extent(0));
            };
            const std::vector<float> one = run(1), side = run(4);
            for (std::size_t i = 0; i < one.size(); ++i)
              ASSERT_EQ(side[i], one[i]) << "n " << n << " pad " << pad << " at " << i;
            for (int i = 0; i < batch; ++i)
              for (int r = 0; r < m; ++r)
                for (int j = 0; j < ldc; ++j) {
                  const std::int64_t at = i * sc + std::int64_t(r) * ldc + j;
                  if (j >= n) {
                    ASSERT_EQ(side[at], c[at]) << "between rows";
                    continue;
                  }
                  double want = 0.25 * c[at];
                  for (int q = 0; q < k; ++q) {
                    const float x =
                        ta == Trans::N ? a[i * sa + r * lda + q] : a[i * sa + q * lda + r];
                    const float y =
                        tb == Trans::N ? b[i * sb + q * ldb + j] : b[i * sb + j * ldb + q];
                    want += 0.5 * double(x) * y;
                  }
                  ASSERT_NEAR(side[at], want, 1e-5) << i << " " << r << " " << j;
                }
          }
}

// A grouped batch (attention's products: groups of different shapes in one call) against one
// strided batch per group: fp32 and bf16 inputs (fp32 values and a bf16 operand), every
// transpose, rows apart where the build has them, C's elements between rows untouched; on the
// host threads side by side, bit for bit the products one after the other.
TEST(Gemm, GroupedBatchMatchesOneStridedBatchPerGroup) {
  struct Shape {
    int m, n, k, count;
  };
  const std::vector<Shape> shapes = {{6, 5, 7, 3}, {3, 9, 4, 1}, {1, 2, 5, 2}, {4, 4, 4, 0}};
  for (Precision p : {Precision::Fp32, Precision::Bf16})
    for (int pad : {0, 2})
      for (Trans ta : {Trans::N, Trans::T})
        for (Trans tb : {Trans::N, Trans::T}) {
          if (pad > 0 && !gemm_rows_apart()) continue;
          // Every group's operands and results in one buffer each, groups one after another.
          std::vector<std::int64_t> a_at, b_at, c_at;
          std::vector<std::array<int, 3>> ld;  // lda, ldb, ldc
          std::int64_t na = 0, nb = 0, nc = 0;
          for (const Shape& x : shapes) {
            const int ar = ta == Trans::N ? x.m : x.k, ac = ta == Trans::N ? x.k : x.m;
            const int br = tb == Trans::N ? x.k : x.n, bc = tb == Trans::N ? x.n : x.k;
            ld.push_back({ac + pad, bc + pad, x.n + pad});
            a_at.push_back(na);
            b_at.push_back(nb);
            c_at.push_back(nc);
            na += std::int64_t(x.count) * ar * (ac + pad) + 1;
            nb += std::int64_t(x.count) * br * (bc + pad) + 3;
            nc += std::int64_t(x.count) * x.m * (x.n + pad) + 2;
          }
          std::mt19937 gen(13);
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          std::vector<float> a(na), b(nb), c(nc);
          for (auto* v : {&a, &b, &c})
            for (auto& x : *v) x = u(gen);
          std::vector<std::uint16_t> a16(na);
          for (std::int64_t i = 0; i < na; ++i) a16[i] = bf16_bits(a[i]);
          auto dev = [](const auto& h) {
            using T = typename std::decay_t<decltype(h)>::value_type;
            Kokkos::View<T*, Layout, MemSpace> v("v", h.size());
            Kokkos::deep_copy(v, Kokkos::View<const T*, HostSpace, Unmanaged>(h.data(), h.size()));
            return v;
          };
          const View1F A = dev(a), B = dev(b);
          const auto A16 = dev(a16);
          for (bool b16 : {false, true}) {
            if (b16 && p != Precision::Bf16) continue;
            auto groups_for = [&](float* C) {
              std::vector<GemmGroup> groups;
              for (std::size_t g = 0; g < shapes.size(); ++g) {
                const Shape& x = shapes[g];
                const int ar = ta == Trans::N ? x.m : x.k, ac = ta == Trans::N ? x.k : x.m;
                const int br = tb == Trans::N ? x.k : x.n, bc = tb == Trans::N ? x.n : x.k;
                const std::int64_t sa = std::int64_t(ar) * ld[g][0], sb = std::int64_t(br) * ld[g][1];
                Strided sa_op{b16 ? nullptr : A.data() + a_at[g], ar, ac, sa,
                              b16 ? A16.data() + a_at[g] : nullptr, pad ? ld[g][0] : 0};
                groups.push_back({sa_op, {B.data() + b_at[g], br, bc, sb, nullptr, pad ? ld[g][1] : 0},
                                  C + c_at[g], x.m, x.n, std::int64_t(x.m) * ld[g][2], x.count,
                                  pad ? ld[g][2] : 0});
              }
              return groups;
            };
            auto run = [&](int threads, bool grouped) {
              const RunContext ctx = make_run_context(p, threads);
              View1F C = dev(c);
              const auto groups = groups_for(C.data());
              GemmGroupTables tables;
              if (grouped) {
                gemm_grouped_batched(ctx, ta, tb, 0.5f, 0.25f, groups, tables);
              } else {
                for (const GemmGroup& g : groups)
                  gemm_strided_batched(ctx, ta, tb, 0.5f, g.A, g.B, 0.25f, g.C, g.c_rows,
                                       g.c_cols, g.c_stride, g.count, g.c_ld);
              }
              Kokkos::fence();
              auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), C);
              return std::vector<float>(h.data(), h.data() + h.extent(0));
            };
            const std::vector<float> got = run(1, true), want = run(1, false);
            for (std::size_t g = 0; g < shapes.size(); ++g)
              for (int i = 0; i < shapes[g].count; ++i)
                for (int r = 0; r < shapes[g].m; ++r)
                  for (int j = 0; j < ld[g][2]; ++j) {
                    const std::int64_t at =
                        c_at[g] + (std::int64_t(i) * shapes[g].m + r) * ld[g][2] + j;
                    if (j < shapes[g].n)
                      ASSERT_NEAR(got[at], want[at], 1e-5) << "group " << g << " product " << i;
                    else
                      ASSERT_EQ(got[at], c[at]) << "between rows, group " << g;
                  }
            for (std::size_t g = 0; g + 1 < shapes.size(); ++g)  // the gaps between groups
              for (std::int64_t at = c_at[g + 1] - 2; at < c_at[g + 1]; ++at)
                ASSERT_EQ(got[at], c[at]) << "after group " << g;
            if (make_run_context(p, 4).batch_threads > 1) {
              const std::vector<float> side = run(4, true);
              for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(side[i], got[i]) << i;
            }
          }
        }
  // A bf16 operand in a product with fp32 inputs, and groups that mix the two, are refused.
  View1F X("X", 64), Y("Y", 64);
  Kokkos::View<std::uint16_t*, Layout, MemSpace> X16("X16", 64);
  GemmGroupTables tables;
  const GemmGroup f32{{X.data(), 2, 2, 4}, {Y.data(), 2, 2, 4}, Y.data() + 32, 2, 2, 4, 1};
  GemmGroup b16 = f32;
  b16.A = {nullptr, 2, 2, 4, X16.data()};
  b16.C = Y.data() + 48;
  EXPECT_THROW(gemm_grouped_batched(make_run_context(Precision::Fp32), Trans::N, Trans::N, 1.0f,
                                    0.0f, {b16}, tables),
               Error);
  EXPECT_THROW(gemm_grouped_batched(make_run_context(Precision::Bf16), Trans::N, Trans::N, 1.0f,
                                    0.0f, {f32, b16}, tables),
               Error);
}

// The grouped batch's device pointer tables: uploaded once for pointers that stay, again when
// they change, and after GemmGroupTables::kUploads uploads a change gives nullptr (the caller
// runs one strided batch per group rather than wait for an upload every call).
TEST(Gemm, GroupTablesUploadOnlyWhatChangesAndGiveUpOnPointersThatKeepChanging) {
  float x[8];
  GemmGroupTables tables;
  auto table = [&](int shift) {
    return std::vector<const void*>{x + shift, x + shift + 1, x + shift + 2};
  };
  auto read = [](const void* const* d, std::size_t i) {
    auto h = Kokkos::create_mirror_view_and_copy(
        HostSpace(), Kokkos::View<const std::uintptr_t*, Layout, MemSpace, Unmanaged>(
                         reinterpret_cast<const std::uintptr_t*>(d), i + 1));
    return reinterpret_cast<const void*>(h(i));
  };
  const void* const* d = tables.device(table(0));
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(read(d, 2), x + 2);
  EXPECT_EQ(tables.device(table(0)), d) << "the same pointers: the tables as they are";
  for (int change = 1; change < GemmGroupTables::kUploads; ++change) {
    d = tables.device(table(change));
    ASSERT_NE(d, nullptr) << "change " << change;
    EXPECT_EQ(read(d, 0), x + change);
  }
  EXPECT_FALSE(tables.varying());
  EXPECT_EQ(tables.device(table(5)), nullptr) << "pointers that keep changing";
  EXPECT_TRUE(tables.varying());
  EXPECT_NE(tables.device(table(GemmGroupTables::kUploads - 1)), nullptr)
      << "the last uploaded pointers still hold";
}

// One product on the calling host thread (what the MoE experts run side by side) is gemm()'s
// BLAS call: bit for bit gemm() for every transpose pair, beta applied on an empty inner
// extent, a bf16 operand refused.
TEST(Gemm, OnHostThreadIsGemmsCall) {
  if (!Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible) GTEST_SKIP();
  if (make_run_context(Precision::Fp32, 2).batch_threads == 1)
    GTEST_SKIP() << "no host-thread GEMM batches (no host BLAS on host memory, or device paths)";
  const RunContext ctx;
  const int m = 19, n = 23;
  for (int k : {0, 37})
    for (Trans ta : {Trans::N, Trans::T})
      for (Trans tb : {Trans::N, Trans::T}) {
        std::mt19937 gen(k + 3);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        const int ar = ta == Trans::N ? m : k, ac = ta == Trans::N ? k : m;
        const int br = tb == Trans::N ? k : n, bc = tb == Trans::N ? n : k;
        std::vector<float> a(ar * ac), b(br * bc), c(m * n);
        for (auto* v : {&a, &b, &c})
          for (auto& x : *v) x = u(gen);
        View2F A("A", ar, ac), B("B", br, bc), C1("C1", m, n), C2("C2", m, n);
        using HostMat = Kokkos::View<const float**, Layout, HostSpace, Unmanaged>;
        Kokkos::deep_copy(A, HostMat(a.data(), ar, ac));
        Kokkos::deep_copy(B, HostMat(b.data(), br, bc));
        Kokkos::deep_copy(C1, HostMat(c.data(), m, n));
        Kokkos::deep_copy(C2, C1);
        gemm(ctx, ta, tb, 0.75f, as_cmat(A), as_cmat(B), 0.5f, as_mat(C1));
        gemm_on_host_thread(ta, tb, 0.75f, operand(as_cmat(A)), operand(as_cmat(B)), 0.5f,
                            as_mat(C2));
        Kokkos::fence();
        auto h1 = Kokkos::create_mirror_view_and_copy(HostSpace(), C1);
        auto h2 = Kokkos::create_mirror_view_and_copy(HostSpace(), C2);
        for (int i = 0; i < m; ++i)
          for (int j = 0; j < n; ++j) {
            ASSERT_EQ(h2(i, j), h1(i, j)) << "k " << k << " at " << i << "," << j;
            if (k == 0) {
              ASSERT_EQ(h2(i, j), 0.5f * c[i * n + j]);
            }
          }
      }
  View1F x("x", 4);
  std::vector<std::uint16_t> bits(4, 0);
  const Operand b16{nullptr, bits.data(), 2, 2}, f32{x.data(), nullptr, 2, 2};
  EXPECT_THROW(
      gemm_on_host_thread(Trans::N, Trans::N, 1.0f, b16, f32, 0.0f, as_mat(x.data(), 2, 2)), Error);
}

// Items side by side on two host threads cover each item once, each on a slot of its own, and
// an item's exception reaches the caller (not std::terminate inside the parallel region).
TEST(Gemm, HostItemsSideBySideCoverEachItemOnce) {
  if (Kokkos::DefaultHostExecutionSpace().concurrency() < 2)
    GTEST_SKIP() << "one host thread: side by side is one after the other here";
  std::vector<std::atomic<int>> seen(101);
  std::atomic<int> on_slot[2] = {0, 0};
  host_items_side_by_side("test::items", 101, 2, [&](int i, int slot) {
    if (slot == 0 || slot == 1) ++on_slot[slot];
    ++seen[i];  // each item by one thread
    // Hold the item a moment so the other thread takes some: both slots must work.
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (std::chrono::steady_clock::now() < until) {
    }
  });
  for (int i = 0; i < 101; ++i) ASSERT_EQ(seen[i].load(), 1) << i;
  EXPECT_EQ(on_slot[0] + on_slot[1], 101) << "every slot index is 0 or 1";
  EXPECT_GT(on_slot[0].load(), 0);
  EXPECT_GT(on_slot[1].load(), 0) << "the second thread took no item";
  EXPECT_THROW(host_items_side_by_side("test::throws", 9, 2,
                                       [&](int i, int) { KMOE_REQUIRE(i != 4, "item 4"); }),
               Error);
}

// out(c) += sum_r 2 x(r, c), outside a TEST body (nvcc refuses device lambdas in its private
// member function).
void twice_column_sums(ConstVec xv, int rows, int cols, Vec out) {
  column_sums(
      "test::column_sums", rows, cols, KOKKOS_LAMBDA(int r, int c) { return 2.0f * xv(r * cols + c); },
      out);
}

// The same with a fixed chunk width: 16 columns per work item (host backends) or 1 (GPUs and
// device paths).
template <int chunk>
void twice_column_sums_in_chunks(ConstVec xv, int rows, int cols, Vec out) {
  detail::column_sums_in_chunks<chunk>(
      "test::column_sums_chunks", rows, cols,
      KOKKOS_LAMBDA(int r, int c) { return 2.0f * xv(r * cols + c); }, out);
}

// Both chunk widths, whichever the build and mode use, sum every column in the same order:
// the same bits.
TEST(ColumnSums, ChunkWidthsGiveTheSameBits) {
  const int rows = 2 * kRowBlock + 5, cols = 41;
  View1F x("x", std::int64_t(rows) * cols), a("a", cols), b("b", cols);
  auto hx = Kokkos::create_mirror_view(x);
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < hx.extent(0); ++i) hx(i) = u(gen);
  Kokkos::deep_copy(x, hx);
  const ConstVec xv(x.data(), x.extent(0));
  twice_column_sums_in_chunks<16>(xv, rows, cols, Vec(a.data(), cols));
  twice_column_sums_in_chunks<1>(xv, rows, cols, Vec(b.data(), cols));
  auto ha = Kokkos::create_mirror_view_and_copy(HostSpace(), a);
  auto hb = Kokkos::create_mirror_view_and_copy(HostSpace(), b);
  for (int c = 0; c < cols; ++c) ASSERT_EQ(ha(c), hb(c)) << c;
}

// Vector lanes: one on host backends; up to a warp (32) with device paths and on CUDA, a
// wavefront (64) on HIP.
TEST(DevicePaths, VectorLanesFollowTheMode) {
  EXPECT_EQ(vector_lanes(64), device_paths() ? kMaxVectorLanes : 1);
  EXPECT_EQ(vector_lanes(12), device_paths() ? 8 : 1);
}

// Two-stage column sums against a double-precision loop, rows past one row block and columns
// past one chunk; the sums add to what out holds.
TEST(ColumnSums, MatchTheRowLoopAndAddToTheOutput) {
  const int rows = 3 * kRowBlock + 17, cols = 37;
  View1F x("x", std::int64_t(rows) * cols), out("out", cols);
  auto hx = Kokkos::create_mirror_view(x);
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < hx.extent(0); ++i) hx(i) = u(gen);
  Kokkos::deep_copy(x, hx);
  Kokkos::deep_copy(out, 1.0f);
  twice_column_sums(ConstVec(x.data(), x.extent(0)), rows, cols, Vec(out.data(), cols));
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), out);
  for (int c = 0; c < cols; ++c) {
    double want = 1.0;
    for (int r = 0; r < rows; ++r) want += 2.0 * hx(r * cols + c);
    ASSERT_NEAR(h(c), want, 1e-4) << c;
  }
}

}  // namespace
}  // namespace kmoe
