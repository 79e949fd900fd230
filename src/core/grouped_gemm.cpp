#include "core/grouped_gemm.hpp"

#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/segments.hpp"

#if defined(KOKKOS_ENABLE_CUDA) && (defined(KOKKOS_ARCH_AMPERE) || defined(KOKKOS_ARCH_ADA89) || \
                                    defined(KOKKOS_ARCH_HOPPER) || defined(KOKKOS_ARCH_BLACKWELL))
#define KMOE_BF16_TENSOR_CORES 1  // nvcuda::wmma bf16 fragments: compute capability 8.0 and later
#include <cuda_bf16.h>
#include <mma.h>
#endif

namespace kmoe {
namespace {

using ScratchF = Kokkos::View<float*, ExecSpace::scratch_memory_space, Unmanaged>;
constexpr int kTile = GroupedGemm::tile, kDepth = GroupedGemm::depth;

// Two k-step tiles and the output tile, per team.
TeamPolicy tiled_policy(std::int64_t teams) {
  KMOE_REQUIRE(teams <= std::int64_t(INT32_MAX), "grouped gemm: " << teams << " tiles");
  const std::size_t bytes = 2 * ScratchF::shmem_size(kTile * kDepth) +
                            ScratchF::shmem_size(kTile * kTile);
  return team_policy(static_cast<int>(teams)).set_scratch_size(0, Kokkos::PerTeam(bytes));
}

KOKKOS_INLINE_FUNCTION int lesser(int a, int b) { return a < b ? a : b; }

// The group of row tile rt (below toff(G)): toff(g) <= rt < toff(g + 1).
KOKKOS_INLINE_FUNCTION int tile_group(const View1I& toff, int G, int rt) {
  return segment_of(toff, G, rt);
}

// The part of the output a rows() team computes: group g's rows [r0, r0 + nr) (nr <= kTile),
// columns [c0, c0 + nc). False for a team past the last group's rows (the launch's bound).
struct RowTile {
  int g;
  std::int64_t r0;
  int nr, c0, nc;
};
KOKKOS_INLINE_FUNCTION bool row_tile(int league, int col_tiles, const View1I& toff,
                                     const ConstIVec& off, int G, int n, RowTile& t) {
  const int rt = league / col_tiles, ct = league % col_tiles;
  if (rt >= toff(G)) return false;
  t.g = tile_group(toff, G, rt);
  t.r0 = off(t.g) + std::int64_t(rt - toff(t.g)) * kTile;
  t.nr = lesser(kTile, static_cast<int>(off(t.g + 1) - t.r0));
  t.c0 = ct * kTile;
  t.nc = lesser(kTile, n - t.c0);
  return true;
}

// The part of the weight gradients a weight_grads() team computes: group g's rows
// [i0, i0 + ni) and columns [j0, j0 + nj) of G_g (m x n, mt x nt tiles), summed over the
// group's rows [first, last) of A and B.
struct GradTile {
  int g, i0, j0, ni, nj, first, last;
};
KOKKOS_INLINE_FUNCTION GradTile grad_tile(int league, int mt, int nt, int m, int n,
                                          const ConstIVec& off) {
  GradTile t;
  t.g = league / (mt * nt);
  const int at = league % (mt * nt);
  t.i0 = (at / nt) * kTile;
  t.j0 = (at % nt) * kTile;
  t.ni = lesser(kTile, m - t.i0);
  t.nj = lesser(kTile, n - t.j0);
  t.first = off(t.g);
  t.last = off(t.g + 1);
  return t;
}


// ---- bf16 products on 16 x 16 x 16 fragments ------------------------------------------------
// The 32 x 32 output tiles of GroupedGemm's own kernels (below), the two inputs staged in team
// scratch as bf16 bits, kK of k at a time, each 16 x 16 quarter of the tile summed in one fp32
// accumulator fragment. With KMOE_BF16_TENSOR_CORES the fragments are nvcuda::wmma's (tensor
// cores), one warp per quarter, a team of four warps; elsewhere ScalarQuarters, one thread
// summing the four quarters in turn with the fragments' semantics.
namespace frag {
using Bits = std::uint16_t;
constexpr int kK = 32;      // k per staged pair of tiles
constexpr int kLd = 40;     // bf16 elements per staged row: 32 + 8 (80 bytes)
constexpr int kLdC = 36;    // floats per row of the output tile: 32 + 4 (144 bytes)
constexpr int kAlign = 32;  // bytes: every fragment's first element (16 rows or columns apart)
constexpr std::size_t kStage = std::size_t(32) * kLd * sizeof(Bits);
constexpr std::size_t kOut = std::size_t(32) * kLdC * sizeof(float);
#if defined(KMOE_BF16_TENSOR_CORES)
constexpr int kTeam = 128;  // four warps, a quarter each
#else
constexpr int kTeam = 1;
#endif

TeamPolicy policy(std::int64_t teams) {
  KMOE_REQUIRE(teams <= std::int64_t(INT32_MAX), "grouped gemm: " << teams << " tiles");
  return TeamPolicy(static_cast<int>(teams), kTeam)
      .set_scratch_size(0, Kokkos::PerTeam(2 * kStage + kOut + 3 * kAlign));
}

// A team's scratch: the staged A (32 x kK row-major, or kK x 32 k-major: `a_cols`), the staged
// B (kK x 32 row-major), both kLd apart, and the output tile (32 x 32, kLdC apart).
struct Staged {
  Bits* a;
  Bits* b;
  float* c;
};
KOKKOS_INLINE_FUNCTION Staged staged(const TeamMember& tm) {
  const auto& s = tm.team_scratch(0);
  const std::size_t stage = kStage, out = kOut;  // by value: no device copy of the constants
  Bits* a = static_cast<Bits*>(s.get_shmem_aligned(stage, kAlign));
  Bits* b = static_cast<Bits*>(s.get_shmem_aligned(stage, kAlign));
  float* c = static_cast<float*>(s.get_shmem_aligned(out, kAlign));
  return {a, b, c};
}

// Quarter q of the tile: rows from 16 (q / 2), columns from 16 (q % 2).
KOKKOS_INLINE_FUNCTION int q_row(int q) { return 16 * (q / 2); }
KOKKOS_INLINE_FUNCTION int q_col(int q) { return 16 * (q % 2); }
// The staged A's 16 x 16 block at rows r0, k from k0 (element (r, k) at p[r * kLd + k], or
// k-major at p[k * kLd + r]); B's block at k from k0, columns c0 (at p[k * kLd + c]).
KOKKOS_INLINE_FUNCTION const Bits* a_block(const Bits* a, bool a_cols, int r0, int k0) {
  return a_cols ? a + k0 * kLd + r0 : a + r0 * kLd + k0;
}
KOKKOS_INLINE_FUNCTION const Bits* b_block(const Bits* b, int k0, int c0) {
  return b + k0 * kLd + c0;
}

#if !(defined(KMOE_BF16_TENSOR_CORES) && defined(__CUDA_ARCH__))
// The four quarters on one thread: what the fragments compute, products summed in fp32 in
// ascending k.
struct ScalarQuarters {
  float acc[4][256];
  KOKKOS_INLINE_FUNCTION explicit ScalarQuarters(const TeamMember&) {
    for (auto& q : acc)
      for (float& v : q) v = 0.0f;
  }
  KOKKOS_INLINE_FUNCTION void mma(const Bits* a, bool a_cols, const Bits* b) {
    for (int q = 0; q < 4; ++q)
      for (int k0 = 0; k0 < kK; k0 += 16) {
        const Bits* pa = a_block(a, a_cols, q_row(q), k0);
        const Bits* pb = b_block(b, k0, q_col(q));
        for (int r = 0; r < 16; ++r)
          for (int c = 0; c < 16; ++c) {
            float s = acc[q][r * 16 + c];
            for (int k = 0; k < 16; ++k)
              s += bf16_to_float(a_cols ? pa[k * kLd + r] : pa[r * kLd + k]) *
                   bf16_to_float(pb[k * kLd + c]);
            acc[q][r * 16 + c] = s;
          }
      }
  }
  KOKKOS_INLINE_FUNCTION void store(float* c) const {
    for (int q = 0; q < 4; ++q)
      for (int r = 0; r < 16; ++r)
        for (int j = 0; j < 16; ++j) c[(q_row(q) + r) * kLdC + q_col(q) + j] = acc[q][r * 16 + j];
  }
};
#endif

#if defined(KMOE_BF16_TENSOR_CORES)
// One warp's quarter on the tensor cores (every lane of the warp calls each member).
struct WarpQuarter {
  int q;
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc;
  __device__ explicit WarpQuarter(const TeamMember& tm) : q(tm.team_rank() / 32) {
    nvcuda::wmma::fill_fragment(acc, 0.0f);
  }
  __device__ void mma(const Bits* a, bool a_cols, const Bits* b) {
    namespace wmma = nvcuda::wmma;
    for (int k0 = 0; k0 < kK; k0 += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, reinterpret_cast<const __nv_bfloat16*>(b_block(b, k0, q_col(q))),
                             kLd);
      const auto* pa = reinterpret_cast<const __nv_bfloat16*>(a_block(a, a_cols, q_row(q), k0));
      if (a_cols) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa;
        wmma::load_matrix_sync(fa, pa, kLd);
        wmma::mma_sync(acc, fa, fb, acc);
      } else {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, pa, kLd);
        wmma::mma_sync(acc, fa, fb, acc);
      }
    }
  }
  __device__ void store(float* c) const {
    nvcuda::wmma::store_matrix_sync(c + q_row(q) * kLdC + q_col(q), acc, kLdC,
                                    nvcuda::wmma::mem_row_major);
  }
};
#endif

// The accumulators of the thread running the kernel body.
#if defined(KMOE_BF16_TENSOR_CORES) && defined(__CUDA_ARCH__)
using Quarters = WarpQuarter;
#else
using Quarters = ScalarQuarters;
#endif

// The bits a staged element holds: a bf16 input as it is, an fp32 one rounded.
KOKKOS_INLINE_FUNCTION Bits bits_of(const float* f32, const Bits* b16, std::int64_t at) {
  return b16 ? b16[at] : bf16_bits(f32[at]);
}

// rows() in bf16: C_g = alpha A_g op(W_g) + beta C_g.
void rows(int G, ConstIVec off, View1I toff, std::int64_t row_tiles, bool wt, float alpha,
          GroupedSrc As_, int K, GroupedSrc Ws_, std::int64_t w_stride, float beta, float* C,
          int n) {
  const int col_tiles = (n + kTile - 1) / kTile;
  const float* A = As_.f32;
  const Bits* A16 = As_.b16;
  const float* W = Ws_.f32;
  const Bits* W16 = Ws_.b16;
  Kokkos::parallel_for(
      "grouped_gemm::rows_bf16", policy(row_tiles * col_tiles),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        RowTile t;
        if (!row_tile(tm.league_rank(), col_tiles, toff, off, G, n, t)) return;  // the whole team
        const std::int64_t r0 = t.r0, wg = t.g * w_stride;
        const int nr = t.nr, c0 = t.c0, nc = t.nc;
        const Staged st = staged(tm);
        Quarters acc(tm);
        for (int k0 = 0; k0 < K; k0 += kK) {
          const int nk = lesser(kK, K - k0);
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kK), [&](int e) {
            const int i = e / kK, kk = e % kK;
            st.a[i * kLd + kk] = i < nr && kk < nk ? bits_of(A, A16, (r0 + i) * K + k0 + kk) : 0;
          });
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kK * kTile), [&](int e) {
            // Neighbouring threads read neighbouring addresses of W either way.
            const int j = wt ? e / kK : e % kTile, kk = wt ? e % kK : e / kTile;
            st.b[kk * kLd + j] = kk < nk && j < nc
                                     ? bits_of(W, W16,
                                               wg + (wt ? std::int64_t(c0 + j) * K + k0 + kk
                                                        : std::int64_t(k0 + kk) * n + c0 + j))
                                     : 0;
          });
          tm.team_barrier();
          acc.mma(st.a, false, st.b);
        }
        tm.team_barrier();  // K = 0: a block's previous league rank may still read st.c
        acc.store(st.c);
        tm.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kTile), [&](int e) {
          const int i = e / kTile, j = e % kTile;
          if (i >= nr || j >= nc) return;
          float& c = C[(r0 + i) * n + c0 + j];
          const float v = st.c[i * kLdC + j];
          c = beta == 0.0f ? alpha * v : alpha * v + beta * c;
        });
      });
}

// weight_grads() in bf16: G_g += alpha A_g^T B_g for every group with rows.
void weight_grads(int G, ConstIVec off, float alpha, GroupedSrc As_, int m, GroupedSrc Bs_, int n,
                  float* Gm, std::int64_t g_stride) {
  const int mt = (m + kTile - 1) / kTile, nt = (n + kTile - 1) / kTile;
  const float *A = As_.f32, *B = Bs_.f32;
  const Bits *A16 = As_.b16, *B16 = Bs_.b16;
  Kokkos::parallel_for(
      "grouped_gemm::weight_grads_bf16", policy(std::int64_t(G) * mt * nt),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        const GradTile t = grad_tile(tm.league_rank(), mt, nt, m, n, off);
        if (t.first == t.last) return;  // the whole team: no rows, no gradient
        const int g = t.g, i0 = t.i0, j0 = t.j0, ni = t.ni, nj = t.nj, first = t.first,
                  last = t.last;
        const Staged st = staged(tm);
        Quarters acc(tm);
        for (int r0 = first; r0 < last; r0 += kK) {
          const int nk = lesser(kK, last - r0);
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kK * kTile), [&](int e) {
            const int kk = e / kTile, i = e % kTile;
            const std::int64_t ia = std::int64_t(r0 + kk) * m + i0 + i,
                               ib = std::int64_t(r0 + kk) * n + j0 + i;
            st.a[kk * kLd + i] = kk < nk && i < ni ? bits_of(A, A16, ia) : 0;
            st.b[kk * kLd + i] = kk < nk && i < nj ? bits_of(B, B16, ib) : 0;
          });
          tm.team_barrier();
          acc.mma(st.a, true, st.b);
        }
        acc.store(st.c);
        tm.team_barrier();
        float* Gg = Gm + g * g_stride;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kTile * kTile), [&](int e) {
          const int i = e / kTile, j = e % kTile;
          if (i < ni && j < nj) Gg[std::int64_t(i0 + i) * n + j0 + j] += alpha * st.c[i * kLdC + j];
        });
      });
}
}  // namespace frag

// Whether a bf16 product takes the fragment kernels (RunContext::fragment_tiles).
bool fragment_tiles(bool bf16, bool asked) {
#if defined(KMOE_BF16_TENSOR_CORES)
  (void)asked;
  return bf16;
#else
  return bf16 && asked;
#endif
}

}  // namespace

bool grouped_gemm_tensor_cores() {
#if defined(KMOE_BF16_TENSOR_CORES)
  return true;
#else
  return false;
#endif
}

GroupedGemm::GroupedGemm(const RunContext& ctx, int groups)
    : bf16_(ctx.bf16()),
      fragments_(fragment_tiles(ctx.bf16(), ctx.fragment_tiles)),
      groups_(groups),
      tile_off_("grouped_gemm::tile_off", groups + 1) {
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
  // The groups' first row tiles: a prefix sum over the groups (integers: exact in any order).
  Kokkos::parallel_scan(
      "grouped_gemm::plan", Range(0, G), KOKKOS_LAMBDA(int g, int& before, bool final) {
        const int tiles = (off(g + 1) - off(g) + kTile - 1) / kTile;
        before += tiles;
        if (final) {
          if (g == 0) toff(0) = 0;
          toff(g + 1) = before;
        }
      });
}

void GroupedGemm::rows(Trans tw, float alpha, GroupedSrc As_, int K, GroupedSrc Ws_,
                       std::int64_t w_stride, float beta, float* C, int n) const {
  if (n == 0 || max_rows_ == 0) return;
  const int G = groups_, col_tiles = (n + kTile - 1) / kTile;
  const std::int64_t row_tiles = (max_rows_ + kTile - 1) / kTile + G;
  const bool wt = tw == Trans::T;
  const bool bf = bf16_;  // inputs rounded as they are loaded
  KMOE_REQUIRE(bf || (!As_.b16 && !Ws_.b16),
               "grouped gemm: a bf16 input in a product with fp32 inputs");
  if (fragments_) {
    frag::rows(G, off_, tile_off_, row_tiles, wt, alpha, As_, K, Ws_, w_stride, beta, C, n);
    return;
  }
  const float* A = As_.f32;
  const std::uint16_t* A16 = As_.b16;
  const float* W = Ws_.f32;
  const std::uint16_t* W16 = Ws_.b16;
  auto off = off_;
  auto toff = tile_off_;
  Kokkos::parallel_for(
      "grouped_gemm::rows", tiled_policy(row_tiles * col_tiles),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        RowTile t;
        if (!row_tile(tm.league_rank(), col_tiles, toff, off, G, n, t)) return;  // the whole team
        const std::int64_t r0 = t.r0, wg = t.g * w_stride;
        const int nr = t.nr, c0 = t.c0, nc = t.nc;
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
  const bool bf = bf16_;
  KMOE_REQUIRE(bf || (!As_.b16 && !Bs_.b16),
               "grouped gemm: a bf16 input in a product with fp32 inputs");
  if (fragments_) {
    frag::weight_grads(groups_, off_, alpha, As_, m, Bs_, n, Gm, g_stride);
    return;
  }
  const float *A = As_.f32, *B = Bs_.f32;
  const std::uint16_t *A16 = As_.b16, *B16 = Bs_.b16;
  auto off = off_;
  Kokkos::parallel_for(
      "grouped_gemm::weight_grads", tiled_policy(std::int64_t(groups_) * mt * nt),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        const GradTile t = grad_tile(tm.league_rank(), mt, nt, m, n, off);
        if (t.first == t.last) return;  // the whole team: no rows, no gradient
        const int g = t.g, i0 = t.i0, j0 = t.j0, ni = t.ni, nj = t.nj, first = t.first,
                  last = t.last;
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
