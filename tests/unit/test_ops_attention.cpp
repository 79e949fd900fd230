// Attention and RoPE against naive double-precision references written from MODEL.md section 1,
// and the attention backward against central finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/gemm.hpp"
#include "full_attention.hpp"
#include "modules/attention/attention.hpp"
#include "modules/attention/fused_attention.hpp"
#include "modules/attention/rope.hpp"
#include "modules/attention/tiled_attention.hpp"
#include "op_test_util.hpp"

namespace kmoe {
namespace {

using namespace op_test;

const char* const kPrefix = "blocks.0.attn.";

// MODEL.md section 1 attention for nseq = a.rows / T sequences of T tokens, in double:
// projections, QK-norm over the whole q and k widths, NeoX RoPE with positions restarting at 0
// in every sequence, causal softmax scaled by 1/sqrt(dh), query head h reading kv head
// h / (H/Hkv), output projection. Position t reads keys [max(doc(t), t - window + 1), t]
// (doc: each row's document start, empty = 0; window 0 = none).
HostMat attention_ref(const ModelCfg& m, int T, const HostMat& a, const TensorTable& table,
                      const std::vector<float>& params, int window = 0,
                      const std::vector<int>& doc = {}) {
  const int N = a.rows, H = m.n_heads, Hkv = m.n_kv_heads, dh = m.d_model / H, half = dh / 2;
  auto p = [&](const char* n) { return param_mat(table, params, kPrefix + std::string(n)); };
  HostMat q = linear(a, p("wq")), k = linear(a, p("wk")), v = linear(a, p("wv"));
  if (m.qk_norm) {
    q = rmsnorm_ref(q, p("q_norm.weight").v, m.norm_eps);
    k = rmsnorm_ref(k, p("k_norm.weight").v, m.norm_eps);
  }
  auto rope = [&](HostMat& u, int heads) {
    for (int r = 0; r < N; ++r)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < half; ++i) {
          const double angle = (r % T) * std::pow(m.rope_theta, -2.0 * i / dh);
          const double x0 = u(r, h * dh + i), x1 = u(r, h * dh + i + half);
          u(r, h * dh + i) = x0 * std::cos(angle) - x1 * std::sin(angle);
          u(r, h * dh + i + half) = x1 * std::cos(angle) + x0 * std::sin(angle);
        }
  };
  rope(q, H);
  rope(k, Hkv);
  HostMat o(N, H * dh);
  for (int r = 0; r < N; ++r) {
    const int first = r - r % T, t = r % T;  // the sequence's first row, the position
    const int lo = std::max(doc.empty() ? 0 : doc[r], window > 0 ? t - window + 1 : 0);
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / Hkv);
      std::vector<double> score(t + 1);
      double mx = -1e300, sum = 0.0;
      for (int j = lo; j <= t; ++j) {
        double s = 0.0;
        for (int d = 0; d < dh; ++d) s += q(r, h * dh + d) * k(first + j, g * dh + d);
        score[j] = s / std::sqrt(static_cast<double>(dh));
        mx = std::max(mx, score[j]);
      }
      for (int j = lo; j <= t; ++j) sum += std::exp(score[j] - mx);
      for (int j = lo; j <= t; ++j)
        for (int d = 0; d < dh; ++d)
          o(r, h * dh + d) += std::exp(score[j] - mx) / sum * v(first + j, g * dh + d);
    }
  }
  return linear(o, p("wo"));
}

ModelCfg attention_cfg(int heads, int kv_heads, bool qk_norm) {
  ModelCfg m;
  m.d_model = 32;
  m.n_heads = heads;
  m.n_kv_heads = kv_heads;
  m.qk_norm = qk_norm;
  m.rope_theta = 1000.0;  // every frequency turns visibly over a few positions
  m.init_std = 0.3;
  return m;
}

// Forward against attention_ref on nseq sequences with buffers for max_seqs; backward (da and
// every parameter gradient) against finite differences of sum(out * R).
void check_attention(const ModelCfg& m, int max_seqs, int nseq) {
  const int T = 6, D = m.d_model, N = nseq * T;
  std::mt19937 gen(100 * m.n_heads + 10 * m.n_kv_heads + max_seqs + nseq + m.qk_norm);
  TensorTable table;
  Attention attn(RunContext(), m, kPrefix, max_seqs, T, table);
  table.allocate();
  table.initialize(11);
  randomize_params(table, gen, 0.35f);
  RopeTables rope(T, m.head_dim(), m.rope_theta);
  Workspace scratch;

  auto a = uniform(gen, N * D, -1.0f, 1.0f);
  const auto R = uniform(gen, N * D, -1.0f, 1.0f);
  View1F a_dev = device_copy(a), out_dev("out", N * D), R_dev = device_copy(R);
  View1F da_dev = device_copy(std::vector<float>(N * D, 1e3f));  // backward must assign da
  auto forward = [&] {
    attn.forward(table, rope, as_cmat(a_dev.data(), N, D), as_mat(out_dev.data(), N, D), scratch);
    return to_host(out_dev.data(), N * D);
  };

  const auto params = to_host(table.params.data(), table.total_elements());
  expect_close(attention_ref(m, T, HostMat(a.data(), N, D), table, params).v, forward(), 2e-5,
               "attention output");

  const auto grads = accumulated_grads(table, gen, [&] {
    attn.backward(table, rope, as_cmat(a_dev.data(), N, D), as_cmat(R_dev.data(), N, D),
                  as_mat(da_dev.data(), N, D), scratch);
  });
  const auto da = to_host(da_dev.data(), N * D);
  auto objective = [&] { return dot(forward(), R); };
  expect_fd_gradient(
      "da", a.data(), da.data(), N * D, [&] { to_device(a, a_dev.data()); }, objective);
  std::vector<std::string> names = {"wq", "wk", "wv", "wo"};
  if (m.qk_norm) names.insert(names.end(), {"q_norm.weight", "k_norm.weight"});
  for (const auto& n : names) expect_fd_param_gradient(table, kPrefix + n, grads, objective);
}

TEST(Attention, MultiHead) { check_attention(attention_cfg(4, 4, true), 2, 2); }
TEST(Attention, GroupedQuery) { check_attention(attention_cfg(4, 2, true), 2, 2); }
TEST(Attention, MultiQuery) { check_attention(attention_cfg(4, 1, true), 2, 2); }
TEST(Attention, GroupedQueryWithoutQkNorm) { check_attention(attention_cfg(4, 2, false), 2, 2); }
TEST(Attention, MultiHeadWithoutQkNorm) { check_attention(attention_cfg(2, 2, false), 2, 2); }

// A micro-batch shorter than the buffers (the last one of an epoch, evaluation).
TEST(Attention, FewerSequencesThanBuffers) {
  check_attention(attention_cfg(4, 2, true), 3, 2);
  check_attention(attention_cfg(4, 1, true), 3, 1);
}

// Blocked attention (tiles of TiledAttention::kTile positions, only the band a tile's keys need)
// against the full-matrix oracle (tests/unit/full_attention) on the same weights and inputs:
// output and input gradient within 1e-6 (relative to the tensor's norm), every parameter
// gradient within 2e-6 (the key and value gradients sum over the tiles one after another
// instead of in one product, which moves a reduction over all rows such as k_norm.weight's by
// about 1e-6 in fp32), and the output against the double reference; T = 150 is not a multiple of
// the tile, window 1, windows inside a tile and across tiles, W >= T (plain causal), document
// starts.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// A walk over each sequence of T tokens (MODEL.md section 1: a document starts at 0 or one past
// an end-of-document id `eod`), which the library's document_starts must reproduce.
std::vector<int> walked_starts(const std::vector<int>& ids, int nseq, int T, int eod) {
  std::vector<int> starts(ids.size());
  for (int q = 0; q < nseq; ++q)
    for (int t = 0, first = 0; t < T; ++t) {
      starts[q * T + t] = first;
      if (ids[q * T + t] == eod) first = t + 1;
    }
  return starts;
}

// The library's document_starts of the same ids, read back.
std::vector<int> library_starts(const std::vector<int>& ids, int nseq, int T, int eod) {
  const int N = nseq * T;
  View1I ids_dev("ids", N), starts_dev("starts", N);
  Kokkos::deep_copy(ids_dev, Kokkos::View<const int*, HostSpace, Unmanaged>(ids.data(), N));
  document_starts(ConstIVec(ids_dev.data(), N), nseq, T, eod, starts_dev);
  std::vector<int> starts(N);
  Kokkos::deep_copy(Kokkos::View<int*, HostSpace, Unmanaged>(starts.data(), N), starts_dev);
  return starts;
}

// bf16 (train.precision = bf16): both kernels round the same inputs and keep bf16 probabilities,
// so they differ by the order of fp32 sums and the rare probability rounded the other way
// (measured at most: 1e-7 in the outputs, 8e-6 in a gradient); against the double reference by
// bf16's rounding (measured at most 5.5e-3).
//
// The fused core (train.attention = fused) against the same oracle: in fp32 within the same
// bounds (the online softmax's rescaling and its block-by-block sums move the last bits only;
// measured at most 2.3e-7 in the outputs, 4.3e-7 in da, 8.8e-7 in a parameter gradient). In
// bf16 it rounds the same operands, but its probabilities are exp(S - lse) rather than the
// oracle's exp(S - max) / sum, so more of them round the other way: measured at most 6.0e-5,
// 5.9e-5 and 1.0e-4.
void check_blocked(const ModelCfg& m, int T, int nseq, int window, bool documents,
                   bool planned = false, Precision precision = Precision::Fp32,
                   AttentionKernel kernel = AttentionKernel::Tiled) {
  const int D = m.d_model, N = nseq * T, max_seqs = nseq + 1;
  SCOPED_TRACE("H " + std::to_string(m.n_heads) + " Hkv " + std::to_string(m.n_kv_heads) + " T " +
               std::to_string(T) + " window " + std::to_string(window) +
               (documents ? " documents" : "") + (planned ? " planned" : "") + " " +
               choice_name(precision) + " " + choice_name(kernel));
  RunContext ctx = make_run_context(precision);  // the products and kept operands
  ctx.attention = kernel;
  const bool bf16 = precision == Precision::Bf16, fused = kernel == AttentionKernel::Fused;
  const double tol = bf16 ? (fused ? 5e-4 : 1e-5) : 1e-6,
               grad_tol = bf16 ? (fused ? 1e-3 : 1e-4) : 2e-6, ref_tol = bf16 ? 2e-2 : 2e-6;
  std::mt19937 gen(T + window + 7 * m.n_kv_heads + documents);
  TensorTable ta, tb;
  Attention blocked(ctx, m, kPrefix, max_seqs, T, ta, window);
  oracle::FullMatrixAttention full(ctx, m, kPrefix, max_seqs, T, tb, window);
  ASSERT_STREQ(blocked.core().name(), fused ? "fused" : "tiled");
  ta.allocate();
  tb.allocate();
  ta.initialize(11);
  randomize_params(ta, gen, 0.35f);
  ASSERT_EQ(ta.total_elements(), tb.total_elements());
  Kokkos::deep_copy(tb.params, ta.params);
  RopeTables rope(T, m.head_dim(), m.rope_theta);
  Workspace wa, wb;

  // Documents: ends at a few positions of each sequence (one right at a tile's edge).
  std::vector<int> doc(N, 0), tile_start;
  View1I doc_dev("doc", N);
  DocStarts docs;
  if (documents) {
    std::vector<int> ids(N, 1);
    for (int e : {5, 63, 64, 101}) ids[e] = 0;
    for (int e : {30, 127, 128}) ids[std::min(N - 1, T + e)] = 0;
    if (nseq > 2)  // a third sequence like the second: one run of two in the plan
      for (int e : {30, 127, 128}) ids[std::min(N - 1, 2 * T + e)] = 0;
    doc = walked_starts(ids, nseq, T, 0);
    ASSERT_EQ(library_starts(ids, nseq, T, 0), doc) << "document_starts against the test's walk";
    Kokkos::deep_copy(doc_dev, Kokkos::View<const int*, HostSpace, Unmanaged>(doc.data(), N));
    docs = DocStarts{ConstIVec(doc_dev.data(), N)};
    if (planned) {  // the host's plan: the blocked kernel skips keys before a tile's document
      document_tile_starts(ids.data(), nseq, T, 0, TiledAttention::kTile, tile_start);
      docs.tile_start = tile_start.data();
      docs.tile_rows = TiledAttention::kTile;
      docs.tiles = static_cast<int>(tile_start.size()) / nseq;
      for (int s = 0; s < nseq; ++s)
        for (int i = 0; i < docs.tiles; ++i)
          ASSERT_EQ(tile_start[s * docs.tiles + i], doc[s * T + i * TiledAttention::kTile]);
    }
  }

  const auto a = uniform(gen, N * D, -1.0f, 1.0f), R = uniform(gen, N * D, -1.0f, 1.0f);
  View1F a_dev = device_copy(a), R_dev = device_copy(R);
  View1F oa("oa", N * D), ob("ob", N * D), da("da", N * D), db("db", N * D);
  // A pass without documents first leaves every band entry written: keys a planned pass skips
  // hold stale scores, which no row may read.
  blocked.forward(ta, rope, as_cmat(a_dev.data(), N, D), as_mat(oa.data(), N, D), wa);
  const std::int64_t band =
      std::int64_t(nseq) * m.n_heads * TiledAttention::band_elements(T, window);
  EXPECT_EQ(blocked.scores_computed(), fused ? 0 : band);
  blocked.forward(ta, rope, as_cmat(a_dev.data(), N, D), as_mat(oa.data(), N, D), wa, docs);
  // Planned: each (sequence, tile) computes its keys from max(k0, first row's document start).
  std::int64_t want = fused ? 0 : band;  // the fused core keeps no scores
  if (planned && gemm_rows_apart() && !fused) {
    want = 0;
    const auto tiles = TiledAttention::tiles(T, window);
    for (int s = 0; s < nseq; ++s)
      for (std::size_t i = 0; i < tiles.size(); ++i) {
        const int k = std::max(tiles[i].k0, doc[s * T + tiles[i].r0]);
        want += std::int64_t(m.n_heads) * tiles[i].rows * (tiles[i].r0 + tiles[i].rows - k);
      }
    if (window != 1) {
      EXPECT_LT(want, band) << "documents that skip nothing test nothing";
    }
  }
  EXPECT_EQ(blocked.scores_computed(), want);
  full.forward(tb, rope, as_cmat(a_dev.data(), N, D), as_mat(ob.data(), N, D), wb, docs);
  const auto out_a = to_host(oa.data(), N * D), out_b = to_host(ob.data(), N * D);
  EXPECT_LT(rel_diff(out_a, out_b), tol) << "output";
  const auto params = to_host(ta.params.data(), ta.total_elements());
  EXPECT_LT(rel_diff(out_a,
                     [&] {
                       const auto r =
                           attention_ref(m, T, HostMat(a.data(), N, D), ta, params, window, doc);
                       return std::vector<float>(r.v.begin(), r.v.end());
                     }()),
            ref_tol)
      << "output against the double reference";

  Kokkos::deep_copy(ta.grads, 0.0f);
  Kokkos::deep_copy(tb.grads, 0.0f);
  blocked.backward(ta, rope, as_cmat(a_dev.data(), N, D), as_cmat(R_dev.data(), N, D),
                   as_mat(da.data(), N, D), wa);
  full.backward(tb, rope, as_cmat(a_dev.data(), N, D), as_cmat(R_dev.data(), N, D),
                as_mat(db.data(), N, D), wb);
  EXPECT_LT(rel_diff(to_host(da.data(), N * D), to_host(db.data(), N * D)), tol) << "da";
  const auto ga = to_host(ta.grads.data(), ta.total_elements());
  const auto gb = to_host(tb.grads.data(), tb.total_elements());
  for (const auto& t : ta.entries()) {
    const std::vector<float> x(ga.begin() + t.offset, ga.begin() + t.offset + t.size),
        y(gb.begin() + t.offset, gb.begin() + t.offset + t.size);
    EXPECT_LT(rel_diff(x, y), grad_tol) << t.spec.name;
  }
}

TEST(BlockedAttention, MatchesFullMatrix) {
  for (const auto& hk : {std::pair{4, 2}, std::pair{4, 1}, std::pair{2, 2}})
    for (int window : {0, 1, 20, 70, 150, 200}) {
      check_blocked(attention_cfg(hk.first, hk.second, true), 150, 2, window, false);
      check_blocked(attention_cfg(hk.first, hk.second, true), 150, 2, window, true);
      check_blocked(attention_cfg(hk.first, hk.second, true), 150, 2, window, true, true);
    }
  check_blocked(attention_cfg(4, 2, false), 64, 2, 0, true);  // one whole tile
  check_blocked(attention_cfg(4, 2, true), 40, 3, 7, true);   // less than a tile
  // Three sequences (runs of equal skips and not), windows on and off, the host's plan.
  check_blocked(attention_cfg(4, 2, true), 200, 3, 0, true, true);
  check_blocked(attention_cfg(4, 1, false), 200, 3, 90, true, true);
}

TEST(BlockedAttention, MatchesFullMatrixInBf16) {
  for (int window : {0, 70})
    for (bool planned : {false, true})
      check_blocked(attention_cfg(4, 2, true), 200, 3, window, true, planned, Precision::Bf16);
  check_blocked(attention_cfg(4, 2, true), 150, 2, 0, false, false, Precision::Bf16);
  check_blocked(attention_cfg(4, 2, true), 200, 1, 64, false);
}

// The fused core on the same cases: GQA and not, every window, documents.
TEST(FusedAttention, MatchesFullMatrix) {
  EXPECT_EQ(FusedAttention::block_rows(8), 64);
  // 16 rows where the GPU's 48 KiB budget applies (GPU builds, device paths), 64 on CPUs.
  constexpr bool host = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
  EXPECT_EQ(FusedAttention::block_rows(64), host && !device_paths() ? 64 : 16);
  for (const auto& hk : {std::pair{4, 2}, std::pair{4, 1}, std::pair{2, 2}})
    for (int window : {0, 1, 20, 70, 150, 200})
      for (bool documents : {false, true})
        check_blocked(attention_cfg(hk.first, hk.second, true), 150, 2, window, documents, true,
                      Precision::Fp32, AttentionKernel::Fused);
  check_blocked(attention_cfg(4, 2, false), 64, 2, 0, true, false, Precision::Fp32,
                AttentionKernel::Fused);
  check_blocked(attention_cfg(4, 2, true), 40, 3, 7, true, false, Precision::Fp32,
                AttentionKernel::Fused);
  check_blocked(attention_cfg(4, 1, false), 200, 3, 90, true, false, Precision::Fp32,
                AttentionKernel::Fused);
  // dh 64: blocks of 16 rows under device paths (FusedAttention::block_rows), 64 on CPUs.
  ModelCfg wide = attention_cfg(2, 1, true);
  wide.d_model = 128;
  for (int window : {0, 20})
    check_blocked(wide, 150, 2, window, true, false, Precision::Fp32, AttentionKernel::Fused);
}

TEST(FusedAttention, MatchesFullMatrixInBf16) {
  for (int window : {0, 70})
    for (bool documents : {false, true})
      check_blocked(attention_cfg(4, 2, true), 200, 3, window, documents, false, Precision::Bf16,
                    AttentionKernel::Fused);
  check_blocked(attention_cfg(4, 1, true), 150, 2, 20, true, false, Precision::Bf16,
                AttentionKernel::Fused);
}

TEST(BlockedAttention, BandFollowsTheMask) {
  // Plain causal: about half of T * T; a window W: about W * T plus a tile's rounding.
  EXPECT_EQ(TiledAttention::band_elements(64, 0), 64 * 64);
  EXPECT_EQ(TiledAttention::band_elements(256, 0), 64 * 64 * (1 + 2 + 3 + 4));
  EXPECT_EQ(TiledAttention::band_elements(150, 0), 64 * 64 + 64 * 128 + 22 * 150);
  EXPECT_EQ(TiledAttention::band_elements(4096, 0), std::int64_t(64) * 64 * 64 * 65 / 2);
  EXPECT_EQ(TiledAttention::band_elements(256, 1), 64 * 64 * 4);
  EXPECT_EQ(TiledAttention::band_elements(4096, 4096), TiledAttention::band_elements(4096, 0));
  EXPECT_LT(TiledAttention::band_elements(4096, 1024), 4096 * (1024 + 2 * 64));
}

// The tables hold cos/sin of p * theta^(-2i/dh) computed in double, rounded to float once.
// document_starts (chunks of 64 positions on a team's threads) against a walk over each
// sequence: ends in the first and the last position, at chunk edges, two ends side by side,
// and gaps longer than two chunks (a chunk takes its start from several chunks back).
TEST(DocumentStarts, MatchTheWalkOverLongGaps) {
  const int T = 300, nseq = 3, N = nseq * T;
  std::vector<int> ids(N, 7);
  for (int e : {0, 63, 64, 65, 200}) ids[e] = 2;  // sequence 0
  for (int e : {T - 1}) ids[T + e] = 2;           // sequence 1: one end, in its last position
  // sequence 2: none
  const std::vector<int> want = walked_starts(ids, nseq, T, 2);
  const std::vector<int> got = library_starts(ids, nseq, T, 2);
  for (int i = 0; i < N; ++i)
    ASSERT_EQ(got[i], want[i]) << "sequence " << i / T << " position " << i % T;
}

TEST(RopeTables, DoubleAnglesRoundedOnce) {
  struct Case {
    int dh;
    double theta;
  };
  for (const Case c : {Case{8, 500000.0}, Case{16, 10000.0}}) {
    RopeTables rope(1024, c.dh, c.theta);
    auto hc = Kokkos::create_mirror_view_and_copy(HostSpace(), rope.cos);
    auto hs = Kokkos::create_mirror_view_and_copy(HostSpace(), rope.sin);
    ASSERT_EQ(hc.extent(0), 1024u);
    ASSERT_EQ(hc.extent(1), static_cast<std::size_t>(c.dh / 2));
    for (int p : {0, 1, 5, 777, 1023})
      for (int i = 0; i < c.dh / 2; ++i) {
        const double angle = p * std::pow(c.theta, -2.0 * i / c.dh);
        EXPECT_EQ(hc(p, i), static_cast<float>(std::cos(angle))) << "p " << p << " i " << i;
        EXPECT_EQ(hs(p, i), static_cast<float>(std::sin(angle))) << "p " << p << " i " << i;
      }
  }
}

}  // namespace
}  // namespace kmoe
