// The MoE layer's routing and dispatch facts (MODEL.md section 3): E=1, k=1 is the dense SwiGLU
// layer; an expert without tokens gets exactly zero gradient and no stale rows; capacity drops
// the tail of each expert's assignments in token order, deterministically. Gradients are
// checked against finite differences in test_model_grad.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/gemm.hpp"
#include "core/grouped_gemm.hpp"
#include "modules/moe/moe.hpp"

namespace kmoe {
namespace {

using HostVec = Kokkos::View<float*, HostSpace>;

ModelCfg model(int D) {
  ModelCfg m;
  m.d_model = D;
  m.init_std = 0.3;
  return m;
}

MoeCfg moe(int E, int k, int Fe) {
  MoeCfg e;
  e.experts = E;
  e.top_k = k;
  e.expert_hidden = Fe;
  e.lb_coef = 0.0;
  e.z_coef = 0.0;
  return e;
}

View2F random_input(int N, int D, unsigned seed) {
  View2F x("x", N, D);
  auto h = Kokkos::create_mirror_view(x);
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int i = 0; i < N; ++i)
    for (int d = 0; d < D; ++d) h(i, d) = nd(gen);
  Kokkos::deep_copy(x, h);
  return x;
}

std::vector<float> to_host(const View2F& v) {
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.size());
}

// A forward and its report (read back from the device).
MoeStats forward_report(MoeLayer& layer, const TensorTable& table, const View2F& x, View2F& y,
                        Workspace& s) {
  layer.forward(table, as_cmat(x), as_mat(y), s);
  return layer.report();
}

TEST(Moe, OneExpertTopOneIsTheDenseLayer) {
  const int N = 24, D = 16, F = 20;
  const ModelCfg m = model(D);
  TensorTable table;
  SwigluMlp dense(RunContext(), "dense.", m, F, N, table);
  MoeLayer layer(RunContext(), m, moe(1, 1, F), "moe.", N, table);
  table.allocate();
  table.initialize(5);
  // Copy the dense weights into the single expert: w1 [1, F, D], w3, w2 [1, D, F].
  for (const char* w : {"w1", "w3", "w2"}) {
    const auto& src = table.entry(table.find(std::string("dense.") + w));
    const auto& dst = table.entry(table.find(std::string("moe.experts.") + w));
    Kokkos::deep_copy(
        Kokkos::subview(table.params, Kokkos::make_pair(dst.offset, dst.offset + dst.size)),
        Kokkos::subview(table.params, Kokkos::make_pair(src.offset, src.offset + src.size)));
  }
  View2F x = random_input(N, D, 1), y_dense("yd", N, D), y_moe("ym", N, D);
  Workspace ms;
  Workspace mos;
  dense.forward(table, as_cmat(x), as_mat(y_dense), ms);
  layer.forward(table, as_cmat(x), as_mat(y_moe), mos);
  const auto a = to_host(y_dense), b = to_host(y_moe);
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-6f * (1 + std::fabs(a[i])));

  // Gradients: the expert's equal the dense layer's; the router gets none (p = 1 always).
  View2F dy = random_input(N, D, 2), dx_dense("dxd", N, D), dx_moe("dxm", N, D);
  Kokkos::deep_copy(table.grads, 0.0f);
  dense.backward(table, as_cmat(x), as_cmat(dy), as_mat(dx_dense), ms);
  layer.backward(table, as_cmat(x), as_cmat(dy), as_mat(dx_moe), mos, 1.0f);
  const auto c = to_host(dx_dense), d = to_host(dx_moe);
  for (std::size_t i = 0; i < c.size(); ++i) ASSERT_NEAR(c[i], d[i], 1e-5f * (1 + std::fabs(c[i])));
  auto g = Kokkos::create_mirror_view_and_copy(HostSpace(), table.grads);
  for (const char* w : {"w1", "w3", "w2"}) {
    const auto& src = table.entry(table.find(std::string("dense.") + w));
    const auto& dst = table.entry(table.find(std::string("moe.experts.") + w));
    for (std::int64_t i = 0; i < src.size; ++i)
      ASSERT_NEAR(g(src.offset + i), g(dst.offset + i), 1e-5f * (1 + std::fabs(g(src.offset + i))))
          << w << " " << i;
  }
  const auto& router = table.entry(table.find("moe.router"));
  for (std::int64_t i = 0; i < router.size; ++i) EXPECT_NEAR(g(router.offset + i), 0.0f, 1e-6f);
}

// Router rows 0 and 1 are opposite and large, rows 2 and 3 zero: with k = 1 every token goes to
// expert 0 or 1, so experts 2 and 3 receive nothing.
void route_to_first_two(TensorTable& table, int D) {
  auto p = Kokkos::create_mirror_view_and_copy(HostSpace(), table.params);
  const auto& r = table.entry(table.find("moe.router"));
  for (int d = 0; d < D; ++d) {
    p(r.offset + d) = 2.0f + 0.1f * d;
    p(r.offset + D + d) = -(2.0f + 0.1f * d);
    p(r.offset + 2 * D + d) = 0.0f;
    p(r.offset + 3 * D + d) = 0.0f;
  }
  Kokkos::deep_copy(table.params, p);
}

TEST(Moe, ExpertWithoutTokensGetsExactlyZeroGradientAndNoStaleRows) {
  const int N = 32, D = 8, Fe = 6;
  const ModelCfg m = model(D);
  MoeCfg e = moe(4, 1, Fe);
  e.lb_coef = 0.1;
  TensorTable table;
  MoeLayer layer(RunContext(), m, e, "moe.", N, table);
  table.allocate();
  table.initialize(3);
  View2F x = random_input(N, D, 4), y("y", N, D), dy = random_input(N, D, 5), dx("dx", N, D);
  Workspace s;
  // First a batch routed over all experts (random router), leaving rows behind ...
  layer.forward(table, as_cmat(x), as_mat(y), s);
  // ... then the routing that starves experts 2 and 3.
  route_to_first_two(table, D);
  Kokkos::deep_copy(table.grads, 1.0f);
  Kokkos::deep_copy(table.grads, 0.0f);  // the trainer zeroes gradients every step
  const MoeStats st = forward_report(layer, table, x, y, s);
  EXPECT_EQ(st.load[2], 0);
  EXPECT_EQ(st.load[3], 0);
  EXPECT_EQ(st.load[0] + st.load[1], N);
  layer.backward(table, as_cmat(x), as_cmat(dy), as_mat(dx), s, 1.0f);
  auto g = Kokkos::create_mirror_view_and_copy(HostSpace(), table.grads);
  for (const char* w : {"w1", "w3", "w2"}) {
    const auto& t = table.entry(table.find(std::string("moe.experts.") + w));
    const std::int64_t per = t.size / 4;
    double used = 0.0;
    for (std::int64_t i = 0; i < 2 * per; ++i) used += std::fabs(g(t.offset + i));
    EXPECT_GT(used, 0.0) << w;
    for (std::int64_t i = 2 * per; i < t.size; ++i)
      ASSERT_EQ(g(t.offset + i), 0.0f) << w << " " << i;
  }
  // A fresh layer with the same weights gives the same output: nothing stale was read.
  TensorTable fresh_table;
  MoeLayer fresh(RunContext(), m, e, "moe.", N, fresh_table);
  fresh_table.allocate();
  Kokkos::deep_copy(fresh_table.params, table.params);
  View2F y2("y2", N, D);
  fresh.forward(fresh_table, as_cmat(x), as_mat(y2), s);
  EXPECT_EQ(to_host(y), to_host(y2));
}

TEST(Moe, CapacityDropsTheTailInTokenOrderDeterministically) {
  const int N = 40, D = 8, Fe = 6, E = 4, k = 2;
  const ModelCfg m = model(D);
  MoeCfg dropless = moe(E, k, Fe);
  MoeCfg capped = dropless;
  capped.capacity_factor = 0.6;  // ceil(0.6 * 40 * 2 / 4) = 12 per expert
  TensorTable table;
  MoeLayer a(RunContext(), m, dropless, "moe.", N, table);
  TensorTable table_b;
  MoeLayer b(RunContext(), m, capped, "moe.", N, table_b);
  table.allocate();
  table.initialize(11);
  table_b.allocate();
  Kokkos::deep_copy(table_b.params, table.params);
  View2F x = random_input(N, D, 6), y_all("ya", N, D), y_cap("yc", N, D), y_cap2("yc2", N, D);
  Workspace sa, sb;
  a.forward(table, as_cmat(x), as_mat(y_all), sa);
  const MoeStats st = forward_report(b, table_b, x, y_cap, sb);
  const int cap = 12;
  std::int64_t expected_drops = 0;
  for (int e = 0; e < E; ++e) expected_drops += std::max<std::int64_t>(0, st.load[e] - cap);
  EXPECT_GT(expected_drops, 0) << "the test routing must overflow some expert";
  EXPECT_EQ(st.dropped, expected_drops);

  // Which tokens lost a slot: per expert, its assignments beyond the first `cap` in token order.
  auto sel = Kokkos::create_mirror_view_and_copy(
      HostSpace(),
      Kokkos::View<const int*, Layout, MemSpace, Unmanaged>(b.selected().data(), N * k));
  std::vector<int> seen(E, 0);
  std::vector<bool> lost(N, false);
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j)
      if (++seen[sel(t * k + j)] > cap) lost[t] = true;
  const auto ya = to_host(y_all), yc = to_host(y_cap);
  for (int t = 0; t < N; ++t) {
    bool differs = false;
    for (int d = 0; d < D; ++d) differs = differs || ya[t * D + d] != yc[t * D + d];
    EXPECT_EQ(differs, lost[t]) << "token " << t;
  }
  const MoeStats st2 = forward_report(b, table_b, x, y_cap2, sb);
  EXPECT_EQ(st2.dropped, st.dropped);
  EXPECT_EQ(to_host(y_cap), to_host(y_cap2));
}

// Aux-loss-free balancing: with the starving router above and no load-balancing loss, the bias
// updates (bias_e += gamma sign(mean C - C_e)) bring the idle experts into use.
TEST(Moe, RouterBiasMovesTowardBalance) {
  const int N = 64, D = 8, Fe = 6, E = 4;
  const ModelCfg m = model(D);
  MoeCfg e = moe(E, 1, Fe);
  e.bias_update_rate = 0.05;
  TensorTable table;
  MoeLayer layer(RunContext(), m, e, "moe.", N, table);
  table.allocate();
  table.initialize(3);
  ASSERT_GE(layer.bias_index(), 0);
  EXPECT_FALSE(table.entry(layer.bias_index()).spec.trainable);
  route_to_first_two(table, D);
  View2F x = random_input(N, D, 4), y("y", N, D);
  auto imbalance = [&](const MoeStats& st) {
    return double(*std::max_element(st.load.begin(), st.load.end())) / (double(N) / E);
  };
  Workspace s;
  const MoeStats first = forward_report(layer, table, x, y, s);
  EXPECT_EQ(first.load[2] + first.load[3], 0);
  MoeStats st = first;
  for (int step = 0; step < 60; ++step) {
    update_router_bias(table, layer.bias_index(),
                       std::vector<double>(st.load.begin(), st.load.end()), e.bias_update_rate);
    st = forward_report(layer, table, x, y, s);
  }
  EXPECT_GT(st.load[2] + st.load[3], 0);
  EXPECT_LT(imbalance(st), imbalance(first));
}

// The layer's statistics over two micro-batches: lb and rz averaged, the loads summed (their max
// over mean the column's value), drops over all assignments; after_optimizer_step moves the
// router bias exactly as update_router_bias does with the step's counts.
TEST(Moe, StatisticsAndTheRouterBiasHook) {
  const int N = 40, D = 8, Fe = 6, E = 4, k = 2;
  const ModelCfg m = model(D);
  MoeCfg e = moe(E, k, Fe);
  e.capacity_factor = 0.6;
  e.bias_update_rate = 0.05;
  StepStats stats;
  TensorTable table;
  MoeLayer layer(RunContext(), m, e, "blocks.3.moe.", N, table, nullptr, nullptr, &stats, 3);
  table.allocate();
  table.initialize(11);
  EXPECT_EQ(stats.names(),
            (std::vector<std::string>{"moe3_lb", "moe3_rz", "moe3_load_max_mean", "moe3_drop"}));
  View2F x1 = random_input(N, D, 6), x2 = random_input(N, D, 7), y("y", N, D);
  Workspace s;
  layer.forward(table, as_cmat(x1), as_mat(y), s);  // e.g. an evaluation forward: forgotten
  stats.begin_step();
  const MoeStats a = forward_report(layer, table, x1, y, s);
  const MoeStats b = forward_report(layer, table, x2, y, s);
  EXPECT_EQ(b.aux, e.lb_coef * b.lb + e.z_coef * b.rz);
  std::vector<double> counts(E);
  double most = 0.0, total = 0.0;
  for (int x = 0; x < E; ++x) {
    counts[x] = double(a.load[x]) + double(b.load[x]);
    most = std::max(most, counts[x]);
    total += counts[x];
  }
  ASSERT_GT(a.dropped + b.dropped, 0) << "the capacity must bite for the drop column to count";
  stats.gather_device();  // the layer adds on the device
  const auto f = stats.finish(2);
  EXPECT_EQ(f[0].second, (a.lb + b.lb) / 2);
  EXPECT_EQ(f[1].second, (a.rz + b.rz) / 2);
  EXPECT_EQ(f[2].second, most / (total / E));
  EXPECT_EQ(f[3].second, double(a.dropped + b.dropped) / total);

  TensorTable expected;  // the same layer's bias moved by hand
  MoeLayer twin(RunContext(), m, e, "blocks.3.moe.", N, expected);
  expected.allocate();
  Kokkos::deep_copy(expected.params, table.params);
  update_router_bias(expected, twin.bias_index(), counts, e.bias_update_rate);
  layer.after_optimizer_step(table, stats);
  const auto& bias = table.entry(layer.bias_index());
  auto got = Kokkos::create_mirror_view_and_copy(HostSpace(), table.params);
  auto want = Kokkos::create_mirror_view_and_copy(HostSpace(), expected.params);
  bool moved = false;
  for (std::int64_t i = bias.offset; i < bias.offset + bias.size; ++i) {
    EXPECT_EQ(got(i), want(i)) << i - bias.offset;
    moved = moved || got(i) != 0.0f;
  }
  EXPECT_TRUE(moved);
}

// One layer's forward and backward on fixed random inputs: outputs, input and every gradient.
struct LayerRun {
  std::vector<float> y, dx, grads;
  MoeStats st;
};
// `starve`: positive inputs and a router that sends every token to experts 0 and 1 only.
LayerRun forward_backward(const RunContext& ctx, const ModelCfg& m, const MoeCfg& c, int N,
                          bool starve = false) {
  const int D = m.d_model;
  TensorTable table;
  MoeLayer layer(ctx, m, c, "moe.", N, table);
  table.allocate();
  table.initialize(11);
  View2F x = random_input(N, D, 6), y("y", N, D), dy = random_input(N, D, 7), dx("dx", N, D);
  if (starve) {
    auto hx = Kokkos::create_mirror_view_and_copy(HostSpace(), x);
    for (std::size_t i = 0; i < hx.size(); ++i) hx.data()[i] = std::fabs(hx.data()[i]);
    Kokkos::deep_copy(x, hx);
    auto p = Kokkos::create_mirror_view_and_copy(HostSpace(), table.params);
    const auto& r = table.entry(table.find("moe.router"));
    for (int e = 0; e < c.experts; ++e)
      for (int d = 0; d < D; ++d) p(r.offset + e * D + d) = e < 2 ? 1.0f + 0.1f * e : -10.0f;
    Kokkos::deep_copy(table.params, p);
  }
  Workspace s;
  LayerRun r;
  r.st = forward_report(layer, table, x, y, s);
  layer.backward(table, as_cmat(x), as_cmat(dy), as_mat(dx), s, 0.5f);
  r.y = to_host(y);
  r.dx = to_host(dx);
  auto g = Kokkos::create_mirror_view_and_copy(HostSpace(), table.grads);
  r.grads.assign(g.data(), g.data() + g.size());
  return r;
}

// The per-expert GEMMs side by side on the host threads (one expert's products and SwiGLU per
// thread) against one after the other: the same calls, so bit for bit, with experts of uneven
// rows, one without rows, and a capacity that drops. Only fp32 runs take that path.
// Which layers take that path (expert_threads): the rule alone, on any build.
TEST(Moe, ExpertThreadsRule) {
  const RunContext threads = make_run_context(Precision::Fp32, 3);
  if (threads.batch_threads == 1) GTEST_SKIP() << "no host-thread GEMM batches (no host BLAS on host memory, or device paths)";
  MoeCfg per = moe(8, 2, 24), grouped = per, one_wide = per;
  per.expert_gemm = ExpertGemm::PerExpert;
  grouped.expert_gemm = ExpertGemm::Grouped;
  one_wide.expert_gemm = ExpertGemm::PerExpert;
  one_wide.expert_hidden = 1;
  EXPECT_EQ(expert_threads(threads, per, 16, 8, false), 3);
  EXPECT_EQ(expert_threads(threads, per, 16, 2, false), 2);
  EXPECT_EQ(expert_threads(threads, per, 16, 1, false), 1);
  EXPECT_EQ(expert_threads(threads, per, 16, 8, true), 1) << "bf16 stays one after the other";
  EXPECT_EQ(expert_threads(make_run_context(Precision::Bf16, 3), per, 16, 8, false), 1)
      << "bf16 products";
  EXPECT_EQ(expert_threads(RunContext(), per, 16, 8, false), 1) << "one thread";
  EXPECT_EQ(expert_threads(threads, grouped, 16, 8, false), 1);
  EXPECT_EQ(expert_threads(threads, one_wide, 16, 8, false), 1)
      << "single-column products are gemv";
  EXPECT_EQ(expert_threads(threads, per, 1, 8, false), 1) << "single-column products are gemv";
}

TEST(Moe, PerExpertGemmsSideBySideMatchOneAfterTheOther) {
  const RunContext threads = make_run_context(Precision::Fp32, 3);
  if (threads.batch_threads == 1) GTEST_SKIP() << "no host-thread GEMM batches (no host BLAS on host memory, or device paths)";
  if (Kokkos::DefaultHostExecutionSpace().concurrency() < 2)
    GTEST_SKIP() << "one host thread: side by side is one after the other here";
  const int N = 40, D = 16, Fe = 24;
  const ModelCfg m = model(D);
  for (int variant = 0; variant < 3; ++variant) {
    const double capacity = variant == 1 ? 0.6 : 0.0;
    const bool starve = variant == 2;
    MoeCfg e = moe(/*E=*/9, /*k=*/2, Fe);
    e.expert_gemm = ExpertGemm::PerExpert;
    e.lb_coef = 0.1;
    e.capacity_factor = capacity;
    e.shared_experts = 1;
    e.shared_hidden = 12;
    const LayerRun one = forward_backward(RunContext(), m, e, N, starve);
    const LayerRun side = forward_backward(threads, m, e, N, starve);
    EXPECT_EQ(side.st.load, one.st.load) << variant;
    if (capacity > 0) {
      EXPECT_GT(one.st.dropped, 0) << "the capacity must bite";
    }
    if (starve) {
      EXPECT_EQ(one.st.load[0] + one.st.load[1], 2 * N) << "experts 2..8 get no rows";
    }
    EXPECT_EQ(side.y, one.y) << variant;
    EXPECT_EQ(side.dx, one.dx) << variant;
    EXPECT_EQ(side.grads, one.grads) << variant;
  }
}

// The grouped expert GEMMs (moe.expert_gemm = grouped, row counts only on the device) against
// the per-expert vendor GEMMs: the same routing and statistics exactly, outputs and every
// gradient to fp32 rounding; dropless with a shared expert, and with a capacity that drops.
// Two grouped runs are bit-identical.
// In bf16 runs too (the grouped kernel reading the kept bf16 rows and activations), where the
// two paths round the same inputs but sum in other orders, so a value next to a bf16 rounding
// boundary may round the other way in a later product: 2e-3 there.
TEST(Moe, GroupedExpertGemmsMatchPerExpertGemms) {
  const int N = 48, D = 16, Fe = 20, E = 8, k = 2;
  const ModelCfg m = model(D);
  for (Precision p : {Precision::Fp32, Precision::Bf16})
  for (double capacity : {0.0, 0.6}) {
    const RunContext ctx = make_run_context(p);
    const double tol = p == Precision::Bf16 ? 2e-3 : 1e-5;
    MoeCfg e = moe(E, k, Fe);
    e.lb_coef = 0.1;
    e.z_coef = 0.01;
    e.capacity_factor = capacity;
    e.shared_experts = capacity == 0.0 ? 1 : 0;
    e.shared_hidden = 12;
    auto run = [&](ExpertGemm gemms) {
      MoeCfg c = e;
      c.expert_gemm = gemms;
      return forward_backward(ctx, m, c, N);
    };
    auto max_rel = [](const std::vector<float>& a, const std::vector<float>& b) {
      double num = 0.0, den = 0.0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        num = std::max(num, std::fabs(double(a[i]) - b[i]));
        den = std::max(den, std::fabs(double(b[i])));
      }
      return num / std::max(den, 1e-30);
    };
    const LayerRun per = run(ExpertGemm::PerExpert), grouped = run(ExpertGemm::Grouped);
    EXPECT_EQ(grouped.st.load, per.st.load) << capacity;
    EXPECT_EQ(grouped.st.dropped, per.st.dropped) << capacity;
    EXPECT_EQ(grouped.st.lb, per.st.lb) << capacity;
    EXPECT_EQ(grouped.st.rz, per.st.rz) << capacity;
    if (capacity > 0) {
      EXPECT_GT(per.st.dropped, 0) << "the capacity must bite";
    }
    std::printf("%s, capacity %.1f: grouped vs per-expert y %.1e dx %.1e grads %.1e\n",
                choice_name(p), capacity, max_rel(grouped.y, per.y), max_rel(grouped.dx, per.dx),
                max_rel(grouped.grads, per.grads));
    EXPECT_LE(max_rel(grouped.y, per.y), tol) << capacity;
    EXPECT_LE(max_rel(grouped.dx, per.dx), tol) << capacity;
    EXPECT_LE(max_rel(grouped.grads, per.grads), tol) << capacity;
    const LayerRun again = run(ExpertGemm::Grouped);
    EXPECT_EQ(again.y, grouped.y);
    EXPECT_EQ(again.dx, grouped.dx);
    EXPECT_EQ(again.grads, grouped.grads);
    if (p == Precision::Bf16) {  // the tensor-core kernel's tiling (scalar fragments on CPUs)
      const LayerRun tiles = [&] {
        RunContext on = ctx;
        on.fragment_tiles = true;
        MoeCfg c = e;
        c.expert_gemm = ExpertGemm::Grouped;
        return forward_backward(on, m, c, N);
      }();
      EXPECT_EQ(tiles.st.load, per.st.load) << capacity;
      std::printf("bf16, capacity %.1f: fragment tiles vs per-expert y %.1e dx %.1e grads %.1e\n",
                  capacity, max_rel(tiles.y, per.y), max_rel(tiles.dx, per.dx),
                  max_rel(tiles.grads, per.grads));
      EXPECT_LE(max_rel(tiles.y, per.y), tol) << capacity;
      EXPECT_LE(max_rel(tiles.dx, per.dx), tol) << capacity;
      EXPECT_LE(max_rel(tiles.grads, per.grads), tol) << capacity;
    }
  }
}

}  // namespace
}  // namespace kmoe
