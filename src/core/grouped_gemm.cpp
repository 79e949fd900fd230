#include "core/grouped_gemm.hpp"

#include "core/bf16.hpp"
#include "core/error.hpp"

namespace kmoe {
namespace {

using ScratchF = Kokkos::View<float*, ExecSpace::scratch_memory_space, Unmanaged>;
constexpr int kTile = GroupedGemm::tile, kDepth = GroupedGemm::depth;

// Two k-step tiles and the output tile, per team.
TeamPolicy tiled_policy(std::int64_t teams) {
  KMOE_REQUIRE(teams <= std::int64_t(INT32_MAX), "grouped gemm: " << teams << " tiles");
  const std::size_t bytes = 2 * ScratchF::shmem_size(kTile * kDepth) +
                            ScratchF::shmem_size(kTile * kTile);
  return TeamPolicy(static_cast<int>(teams), Kokkos::AUTO)
      .set_scratch_size(0, Kokkos::PerTeam(bytes));
}

KOKKOS_INLINE_FUNCTION int lesser(int a, int b) { return a < b ? a : b; }

}  // namespace

GroupedGemm::GroupedGemm(int groups)
    : groups_(groups), tile_off_("grouped_gemm::tile_off", groups + 1) {
  KMOE_REQUIRE(groups >= 1, "grouped gemm: " << groups << " groups");
}

void GroupedGemm::plan(ConstIVec off, std::int64_t max_rows) {
  KMOE_REQUIRE(std::int64_t(off.extent(0)) == groups_ + 1 && max_rows >= 0,
               "grouped gemm: " << off.extent(0) << " offsets for " << groups_ << " groups, "
                                << max_rows << " rows");
  off_ = off;
  max_rows_ = max_rows;
  const int G = groups_;
  auto toff = tile_off_;
  Kokkos::parallel_for(
      "grouped_gemm::plan", Range(0, 1), KOKKOS_LAMBDA(int) {
        toff(0) = 0;
        for (int g = 0; g < G; ++g) toff(g + 1) = toff(g) + (off(g + 1) - off(g) + kTile - 1) / kTile;
      });
}

void GroupedGemm::rows(Trans tw, float alpha, GroupedSrc As_, int K, GroupedSrc Ws_,
                       std::int64_t w_stride, float beta, float* C, int n) const {
  if (n == 0 || max_rows_ == 0) return;
  const int G = groups_, col_tiles = (n + kTile - 1) / kTile;
  const std::int64_t row_tiles = (max_rows_ + kTile - 1) / kTile + G;
  const bool wt = tw == Trans::T;
  const bool bf = gemm_precision() == Precision::Bf16;  // inputs rounded as they are loaded
  KMOE_REQUIRE(bf || (!As_.b16 && !Ws_.b16),
               "grouped gemm: a bf16 input in a product with fp32 inputs");
  const float* A = As_.f32;
  const std::uint16_t* A16 = As_.b16;
  const float* W = Ws_.f32;
  const std::uint16_t* W16 = Ws_.b16;
  auto off = off_;
  auto toff = tile_off_;
  Kokkos::parallel_for(
      "grouped_gemm::rows", tiled_policy(row_tiles * col_tiles),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        const int rt = tm.league_rank() / col_tiles, ct = tm.league_rank() % col_tiles;
        if (rt >= toff(G)) return;  // the whole team: past the last group's rows
        int lo = 0, hi = G;         // toff(lo) <= rt < toff(hi): lo is the tile's group
        while (hi - lo > 1) {
          const int mid = (lo + hi) / 2;
          if (toff(mid) <= rt) lo = mid; else hi = mid;
        }
        const int g = lo;
        const std::int64_t r0 = off(g) + std::int64_t(rt - toff(g)) * kTile;
        const int nr = lesser(kTile, static_cast<int>(off(g + 1) - r0));
        const int c0 = ct * kTile, nc = lesser(kTile, n - c0);
        const std::int64_t wg = g * w_stride;
        ScratchF As(tm.team_scratch(0), kTile * kDepth), Bs(tm.team_scratch(0), kDepth * kTile),
            Cs(tm.team_scratch(0), kTile * kTile);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kTile),
                             [&](int e) { Cs(e) = 0.0f; });
        for (int k0 = 0; k0 < K; k0 += kDepth) {
          const int nk = lesser(kDepth, K - k0);
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kDepth), [&](int e) {
            const int i = e / kDepth, kk = e % kDepth;
            const std::int64_t at = (r0 + i) * K + k0 + kk;
            const float a = i < nr && kk < nk ? (A16 ? bf16_to_float(A16[at]) : A[at]) : 0.0f;
            As(e) = bf ? round_bf16(a) : a;
          });
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kDepth * kTile), [&](int e) {
            // Neighbouring threads read neighbouring addresses of W either way.
            const int j = wt ? e / kDepth : e % kTile, kk = wt ? e % kDepth : e / kTile;
            float v = 0.0f;
            if (kk < nk && j < nc) {
              const std::int64_t at = wg + (wt ? std::int64_t(c0 + j) * K + k0 + kk
                                               : std::int64_t(k0 + kk) * n + c0 + j);
              v = W16 ? bf16_to_float(W16[at]) : W[at];
            }
            Bs(kk * kTile + j) = bf ? round_bf16(v) : v;
          });
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kTile), [&](int e) {
            const int i = e / kTile, j = e % kTile;
            float acc = 0.0f;
            for (int kk = 0; kk < nk; ++kk) acc += As(i * kDepth + kk) * Bs(kk * kTile + j);
            Cs(e) += acc;
          });
        }
        tm.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kTile), [&](int e) {
          const int i = e / kTile, j = e % kTile;
          if (i >= nr || j >= nc) return;
          float& c = C[(r0 + i) * n + c0 + j];
          c = beta == 0.0f ? alpha * Cs(e) : alpha * Cs(e) + beta * c;
        });
      });
}

void GroupedGemm::weight_grads(float alpha, GroupedSrc As_, int m, GroupedSrc Bs_, int n,
                               float* Gm, std::int64_t g_stride) const {
  if (m == 0 || n == 0) return;
  const int mt = (m + kTile - 1) / kTile, nt = (n + kTile - 1) / kTile;
  const bool bf = gemm_precision() == Precision::Bf16;
  KMOE_REQUIRE(bf || (!As_.b16 && !Bs_.b16),
               "grouped gemm: a bf16 input in a product with fp32 inputs");
  const float *A = As_.f32, *B = Bs_.f32;
  const std::uint16_t *A16 = As_.b16, *B16 = Bs_.b16;
  auto off = off_;
  Kokkos::parallel_for(
      "grouped_gemm::weight_grads", tiled_policy(std::int64_t(groups_) * mt * nt),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        const int g = tm.league_rank() / (mt * nt), t = tm.league_rank() % (mt * nt);
        const int i0 = (t / nt) * kTile, j0 = (t % nt) * kTile;
        const int ni = lesser(kTile, m - i0), nj = lesser(kTile, n - j0);
        const int first = off(g), last = off(g + 1);
        if (first == last) return;  // the whole team: no rows, no gradient
        ScratchF As(tm.team_scratch(0), kDepth * kTile), Bs(tm.team_scratch(0), kDepth * kTile),
            Cs(tm.team_scratch(0), kTile * kTile);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kTile),
                             [&](int e) { Cs(e) = 0.0f; });
        for (int r0 = first; r0 < last; r0 += kDepth) {
          const int nk = lesser(kDepth, last - r0);
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kDepth * kTile), [&](int e) {
            const int kk = e / kTile, i = e % kTile;
            const std::int64_t ia = std::int64_t(r0 + kk) * m + i0 + i,
                               ib = std::int64_t(r0 + kk) * n + j0 + i;
            const float a = kk < nk && i < ni ? (A16 ? bf16_to_float(A16[ia]) : A[ia]) : 0.0f;
            const float b = kk < nk && i < nj ? (B16 ? bf16_to_float(B16[ib]) : B[ib]) : 0.0f;
            As(e) = bf ? round_bf16(a) : a;
            Bs(e) = bf ? round_bf16(b) : b;
          });
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kTile), [&](int e) {
            const int i = e / kTile, j = e % kTile;
            float acc = 0.0f;
            for (int kk = 0; kk < nk; ++kk) acc += As(kk * kTile + i) * Bs(kk * kTile + j);
            Cs(e) += acc;
          });
        }
        tm.team_barrier();
        float* Gg = Gm + g * g_stride;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kTile), [&](int e) {
          const int i = e / kTile, j = e % kTile;
          if (i < ni && j < nj) Gg[std::int64_t(i0 + i) * n + j0 + j] += alpha * Cs(e);
        });
      });
}

}  // namespace kmoe
