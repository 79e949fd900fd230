// The Engram layer (MODEL.md section 4, steps 6-10): every parameter's and the input's gradient
// against central finite differences (small tables so rows collide), and the spec's facts:
// gate exactly 0.5 at score 0, output = v while the convolution is zero, gradient only on
// looked-up rows.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "modules/engram/engram.hpp"
#include "op_test_util.hpp"

namespace kmoe {
namespace {

struct Fixture {
  ModelCfg m;
  EngramCfg g;
  std::vector<EngramHashPlan> plans;
  TensorTable table;
  std::unique_ptr<EngramLayer> layer;
  Workspace ws;  // the layer's backward temporaries
  int N, T = 8, nseq = 2;
  View2F x, out, dx, R;
  View1I tokens;

  explicit Fixture(const char* gate, StepStats* stats = nullptr) {
    m.d_model = 16;
    m.vocab_size = 32;
    g.layers = {0};
    g.max_ngram = 3;
    g.heads = 2;
    g.embed_per_ngram = 8;
    g.table_size = {11, 13};  // tiny: rows collide
    g.kernel = 3;
    g.gate = choice_from<EngramGate>(gate);
    g.init_std = 0.3;
    plans = engram_hash_plans(g, m.vocab_size);
    N = nseq * T;
    layer = std::make_unique<EngramLayer>(RunContext(), m, g, plans[0], "blocks.0.engram.", N, T, table,
                                          EngramSharding(), stats);
    table.allocate();
    table.initialize(9);
    std::mt19937 gen(4);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    auto hp = Kokkos::create_mirror_view_and_copy(HostSpace(), table.params);
    for (std::size_t i = 0; i < hp.extent(0); ++i) hp(i) += u(gen);  // conv, norms, biases too
    Kokkos::deep_copy(table.params, hp);
    x = View2F("x", N, m.d_model);
    out = View2F("out", N, m.d_model);
    dx = View2F("dx", N, m.d_model);
    R = View2F("R", N, m.d_model);
    for (View2F* v : {&x, &R}) {
      auto h = Kokkos::create_mirror_view(*v);
      for (int i = 0; i < N; ++i)
        for (int d = 0; d < m.d_model; ++d) h(i, d) = 2.0f * u(gen);
      Kokkos::deep_copy(*v, h);
    }
    tokens = View1I("tokens", N);
    auto ht = Kokkos::create_mirror_view(tokens);
    for (int i = 0; i < N; ++i) ht(i) = gen() % m.vocab_size;
    Kokkos::deep_copy(tokens, ht);
  }

  double objective() {  // sum(out * R) in double
    layer->forward(table, as_cmat(x), ConstIVec(tokens.data(), N), as_mat(out));
    auto ho = Kokkos::create_mirror_view_and_copy(HostSpace(), out);
    auto hr = Kokkos::create_mirror_view_and_copy(HostSpace(), R);
    double s = 0.0;
    for (int i = 0; i < N; ++i)
      for (int d = 0; d < m.d_model; ++d) s += double(ho(i, d)) * hr(i, d);
    return s;
  }
};

void check_gradients(const char* gate) {
  Fixture f(gate);
  f.objective();
  Kokkos::deep_copy(f.table.grads, 0.0f);
  f.layer->backward(f.table, as_cmat(f.x), as_cmat(f.R), as_mat(f.dx), f.ws);
  auto hg = Kokkos::create_mirror_view_and_copy(HostSpace(), f.table.grads);
  auto hp = Kokkos::create_mirror_view_and_copy(HostSpace(), f.table.params);
  const float eps = 3e-3f;
  const auto objective = [&] { return f.objective(); };
  for (const auto& e : f.table.entries()) {
    std::vector<op_test::FdPoint> points;
    for (int k = 0; k < std::min<std::int64_t>(e.size, 16); ++k) {
      const std::int64_t j = e.offset + (k * 7919) % e.size;
      points.push_back({&hp(j), hg(j)});
    }
    op_test::expect_fd_gradient(
        e.spec.name, points, [&] { Kokkos::deep_copy(f.table.params, hp); }, objective, eps);
  }
  // The block input (through the gate's RMSNorm_q).
  auto hx = Kokkos::create_mirror_view_and_copy(HostSpace(), f.x);
  auto hdx = Kokkos::create_mirror_view_and_copy(HostSpace(), f.dx);
  std::vector<op_test::FdPoint> points;
  for (int k = 0; k < 24; ++k) {
    const int i = (k * 37) % f.N, d = (k * 5) % f.m.d_model;
    points.push_back({&hx(i, d), hdx(i, d)});
  }
  op_test::expect_fd_gradient(
      "block input", points, [&] { Kokkos::deep_copy(f.x, hx); }, objective, eps);
}

TEST(Engram, GradientsSigmoidGate) { check_gradients("sigmoid"); }
TEST(Engram, GradientsSignedSqrtGate) { check_gradients("signed_sqrt"); }

TEST(Engram, GateHalfAtZeroScoreAndOutputIsVWithoutConv) {
  Fixture f("sigmoid");
  auto hp = Kokkos::create_mirror_view_and_copy(HostSpace(), f.table.params);
  for (const char* n : {"wk", "bk", "conv"}) {  // key = 0 -> score 0; conv = 0 -> out = v
    const auto& e = f.table.entry(f.table.find(std::string("blocks.0.engram.") + n));
    for (std::int64_t i = 0; i < e.size; ++i) hp(e.offset + i) = 0.0f;
  }
  Kokkos::deep_copy(f.table.params, hp);
  f.objective();
  EXPECT_DOUBLE_EQ(f.layer->mean_gate(), 0.5);
  // With Wv = 0 too, val = bv; silu(0) = 0 exactly, so out = v = 0.5 * bv on every token.
  const auto& bv = f.table.entry(f.table.find("blocks.0.engram.bv"));
  const auto& wv = f.table.entry(f.table.find("blocks.0.engram.wv"));
  for (std::int64_t i = 0; i < wv.size; ++i) hp(wv.offset + i) = 0.0f;
  Kokkos::deep_copy(f.table.params, hp);
  f.objective();
  auto h0 = Kokkos::create_mirror_view_and_copy(HostSpace(), f.out);
  for (int t = 0; t < f.N; ++t)
    for (int d = 0; d < f.m.d_model; ++d) ASSERT_EQ(h0(t, d), 0.5f * hp(bv.offset + d));
}

TEST(Engram, OnlyLookedUpRowsGetGradient) {
  Fixture f("sigmoid");
  f.objective();
  Kokkos::deep_copy(f.table.grads, 0.0f);
  f.layer->backward(f.table, as_cmat(f.x), as_cmat(f.R), as_mat(f.dx), f.ws);
  EngramHasher hasher(f.plans[0], f.g.max_ngram, f.g.heads, f.g.pad_id);
  Kokkos::View<int**, Layout, MemSpace> rows("rows", f.N, hasher.heads_total());
  hasher.rows(ConstIVec(f.tokens.data(), f.N), f.T, rows);
  auto hr = Kokkos::create_mirror_view_and_copy(HostSpace(), rows);
  std::set<int> used;
  for (int t = 0; t < f.N; ++t)
    for (int j = 0; j < hasher.heads_total(); ++j) used.insert(hr(t, j));
  auto hg = Kokkos::create_mirror_view_and_copy(HostSpace(), f.table.grads);
  const auto& tab = f.table.entry(f.table.find("blocks.0.engram.table"));
  const int dh = f.g.embed_per_ngram / f.g.heads;
  int touched = 0;
  for (std::int64_t r = 0; r < tab.spec.shape[0]; ++r) {
    double norm = 0.0;
    for (int i = 0; i < dh; ++i) norm += std::fabs(hg(tab.offset + r * dh + i));
    if (used.count(r)) {
      EXPECT_GT(norm, 0.0) << "row " << r;
      ++touched;
    } else {
      EXPECT_EQ(norm, 0.0) << "row " << r;
    }
  }
  EXPECT_LT(touched, tab.spec.shape[0]) << "some rows must stay untouched for the test to bite";
}

// The layer's statistics: the gate column is the mean over micro-batches of each forward's
// mean gate; finish_step makes rows_touched the fraction of table rows any forward looked up.
TEST(Engram, StatisticsAreTheMeanGateAndTheRowsTouched) {
  StepStats stats;
  Fixture f("sigmoid", &stats);
  EXPECT_EQ(stats.names(), (std::vector<std::string>{"engram0_gate", "engram0_rows_touched"}));
  EngramHasher hasher(f.plans[0], f.g.max_ngram, f.g.heads, f.g.pad_id);
  Kokkos::View<int**, Layout, MemSpace> rows("rows", f.N, hasher.heads_total());
  std::set<int> used;
  auto note_rows = [&] {
    hasher.rows(ConstIVec(f.tokens.data(), f.N), f.T, rows);
    auto hr = Kokkos::create_mirror_view_and_copy(HostSpace(), rows);
    for (int t = 0; t < f.N; ++t)
      for (int j = 0; j < hasher.heads_total(); ++j) used.insert(hr(t, j));
  };
  f.objective();  // an evaluation forward before the step: begin_step forgets it
  stats.begin_step();
  double gates = 0.0;
  for (int micro = 0; micro < 2; ++micro) {
    if (micro == 1) {  // other tokens for the second micro-batch
      auto ht = Kokkos::create_mirror_view_and_copy(HostSpace(), f.tokens);
      for (int i = 0; i < f.N; ++i) ht(i) = (ht(i) * 7 + 3) % f.m.vocab_size;
      Kokkos::deep_copy(f.tokens, ht);
    }
    f.objective();
    gates += f.layer->mean_gate();
    note_rows();
  }
  Communicator self(MPI_COMM_SELF, "self", 60.0);
  f.layer->finish_step(stats, self, self, /*write=*/true);  // on the device: before the gather
  stats.gather_device();
  const auto finished = stats.finish(2);
  const auto& tab = f.table.entry(f.table.find("blocks.0.engram.table"));
  EXPECT_NEAR(finished[0].second, gates / 2, 1e-12);
  EXPECT_EQ(finished[1].second, double(used.size()) / tab.spec.shape[0]);
  EXPECT_LT(used.size(), std::size_t(tab.spec.shape[0])) << "some rows must stay untouched";
}

}  // namespace
}  // namespace kmoe
