// Units of the training loop against MODEL.md sections 5-7, with every reference written
// independently here: the learning-rate schedules, AdamW against a naive double-precision host
// implementation, the gradient norm, the TensorTable (layout, errors, deterministic
// layout-independent initialization), model_size() against a built Stage, and the parameter
// names, shapes and weight-decay groups a Stage declares.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/stop_signal.hpp"
#include "core/tensor_table.hpp"
#include "io/deck.hpp"
#include "modules/model/model_size.hpp"
#include "modules/model/stage.hpp"
#include "parallel/pipeline_schedule.hpp"
#include "train/memory_check.hpp"
#include "train/optimizer.hpp"

namespace kmoe {
namespace {

constexpr double kPi = 3.14159265358979323846;

// ---------------------------------------------------------------------------------------------
// Host helpers.

std::vector<float> to_host(const View1F& v) {
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

void from_host(const std::vector<float>& src, const View1F& v) {
  ASSERT_EQ(src.size(), v.extent(0));
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < src.size(); ++i) h(i) = src[i];
  Kokkos::deep_copy(v, h);
}

// The values of one tensor of a table, on the host.
std::vector<float> tensor_values(const TensorTable& t, const std::string& name) {
  const int i = t.find(name);
  EXPECT_GE(i, 0) << name;
  if (i < 0) return {};
  const auto all = to_host(t.params);
  const auto& e = t.entry(i);
  return std::vector<float>(all.begin() + e.offset, all.begin() + e.offset + e.size);
}

bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TensorSpec spec(const std::string& name, std::vector<std::int64_t> shape,
                InitKind init = InitKind::Normal, double init_std = 0.02, bool wd = false,
                double lr_mult = 1.0) {
  TensorSpec s;
  s.name = name;
  s.shape = std::move(shape);
  s.init = init;
  s.init_std = init_std;
  s.weight_decay = wd;
  s.lr_mult = lr_mult;
  return s;
}

// ---------------------------------------------------------------------------------------------
// 1. Learning-rate schedule (MODEL.md section 6), reference written from the text.

double ref_lr(const OptimizerCfg& o, int max_steps, int s) {
  const double lr = o.lr, lr_min = o.lr * o.final_lr_ratio;
  const int W = o.warmup_steps;
  if (W > 0 && s <= W) return lr * static_cast<double>(s) / W;
  if (o.schedule == LrSchedule::Constant) return lr;
  if (o.schedule == LrSchedule::Wsd) {
    if (s > max_steps - o.decay_steps)
      return lr_min + (lr - lr_min) * static_cast<double>(max_steps - s) / o.decay_steps;
    return lr;
  }
  // cosine
  return lr_min +
         (lr - lr_min) * 0.5 * (1.0 + std::cos(kPi * static_cast<double>(s - W) / (max_steps - W)));
}

OptimizerCfg schedule_cfg(const std::string& schedule, int warmup, int decay = 0) {
  OptimizerCfg o;
  o.lr = 3e-3;
  o.final_lr_ratio = 0.1;
  o.schedule = choice_from<LrSchedule>(schedule);
  o.warmup_steps = warmup;
  o.decay_steps = decay;
  return o;
}

void expect_lr_near(double expected, double got, const std::string& what) {
  EXPECT_NEAR(got, expected, 1e-12 * std::max(1.0, std::fabs(expected))) << what;
}

TEST(LearningRate, LinearWarmup) {
  for (const char* sched : {"cosine", "constant", "wsd"}) {
    const auto o = schedule_cfg(sched, 10, 20);
    for (int s = 1; s <= 10; ++s)
      expect_lr_near(o.lr * s / 10.0, learning_rate(o, 100, s),
                     std::string(sched) + " warmup step " + std::to_string(s));
    // The warmup ends exactly at the peak.
    EXPECT_DOUBLE_EQ(learning_rate(o, 100, 10), o.lr) << sched;
  }
}

TEST(LearningRate, Cosine) {
  const auto o = schedule_cfg("cosine", 10);
  const int max_steps = 110;
  const double lr_min = o.lr * o.final_lr_ratio;
  for (int s = 1; s <= max_steps; ++s)
    expect_lr_near(ref_lr(o, max_steps, s), learning_rate(o, max_steps, s),
                   "cosine step " + std::to_string(s));
  // Just after warmup: barely below the peak; at max_steps: lr_min; at the midpoint of the decay:
  // halfway between.
  const double after = learning_rate(o, max_steps, 11);
  EXPECT_LT(after, o.lr);
  EXPECT_NEAR(after, o.lr, 1e-3 * o.lr);
  expect_lr_near(lr_min, learning_rate(o, max_steps, max_steps), "cosine at max_steps");
  expect_lr_near(0.5 * (o.lr + lr_min), learning_rate(o, max_steps, 60), "cosine midpoint");
  // Non-increasing after warmup.
  for (int s = 11; s < max_steps; ++s)
    EXPECT_GE(learning_rate(o, max_steps, s), learning_rate(o, max_steps, s + 1)) << s;
}

TEST(LearningRate, Constant) {
  const auto o = schedule_cfg("constant", 5);
  for (int s = 6; s <= 50; ++s) EXPECT_DOUBLE_EQ(learning_rate(o, 50, s), o.lr) << s;
}

TEST(LearningRate, WarmupStableDecay) {
  const auto o = schedule_cfg("wsd", 5, 20);
  const int max_steps = 100;
  const double lr_min = o.lr * o.final_lr_ratio;
  // Flat until the last decay_steps steps.
  for (int s = 6; s <= max_steps - 20; ++s)
    EXPECT_DOUBLE_EQ(learning_rate(o, max_steps, s), o.lr) << s;
  // Linear decay over steps 81..100.
  for (int s = max_steps - 19; s <= max_steps; ++s) {
    const double expected = lr_min + (o.lr - lr_min) * (max_steps - s) / 20.0;
    expect_lr_near(expected, learning_rate(o, max_steps, s), "wsd step " + std::to_string(s));
  }
  expect_lr_near(lr_min, learning_rate(o, max_steps, max_steps), "wsd at max_steps");
  expect_lr_near(o.lr - (o.lr - lr_min) / 20.0, learning_rate(o, max_steps, 81), "wsd step 81");
  for (int s = 1; s <= max_steps; ++s)
    expect_lr_near(ref_lr(o, max_steps, s), learning_rate(o, max_steps, s),
                   "wsd step " + std::to_string(s));
}

TEST(LearningRate, NoWarmup) {
  const int max_steps = 40;
  for (const char* sched : {"cosine", "constant", "wsd"}) {
    const auto o = schedule_cfg(sched, 0, 10);
    for (int s = 1; s <= max_steps; ++s) {
      const double got = learning_rate(o, max_steps, s);
      EXPECT_TRUE(std::isfinite(got)) << sched << " step " << s;
      expect_lr_near(ref_lr(o, max_steps, s), got,
                     std::string(sched) + " step " + std::to_string(s));
    }
  }
  // Cosine without warmup starts just below the peak and ends at lr_min.
  const auto o = schedule_cfg("cosine", 0);
  expect_lr_near(o.lr * o.final_lr_ratio +
                     o.lr * (1 - o.final_lr_ratio) * 0.5 * (1 + std::cos(kPi / max_steps)),
                 learning_rate(o, max_steps, 1), "cosine step 1 without warmup");
  expect_lr_near(o.lr * o.final_lr_ratio, learning_rate(o, max_steps, max_steps),
                 "cosine end without warmup");
}

// ---------------------------------------------------------------------------------------------
// 2. AdamW against a naive double-precision host implementation of MODEL.md section 6.

struct RefAdamW {
  std::vector<double> p, m, v;
};

void ref_adamw_step(const OptimizerCfg& o, const TensorTable& table, RefAdamW& st,
                    const std::vector<float>& grads, int t, double lr, double clip_scale) {
  const double bc1 = 1.0 - std::pow(o.beta1, t), bc2 = 1.0 - std::pow(o.beta2, t);
  for (const auto& e : table.entries()) {
    const double lr_g = lr * e.spec.lr_mult;
    const double wd = e.spec.weight_decay ? o.weight_decay : 0.0;
    for (std::int64_t i = e.offset; i < e.offset + e.size; ++i) {
      const double g = clip_scale * grads[i];
      st.m[i] = o.beta1 * st.m[i] + (1.0 - o.beta1) * g;
      st.v[i] = o.beta2 * st.v[i] + (1.0 - o.beta2) * g * g;
      const double mh = st.m[i] / bc1, vh = st.v[i] / bc2;
      st.p[i] = st.p[i] - lr_g * (wd * st.p[i] + mh / (std::sqrt(vh) + o.eps));
    }
  }
}

void expect_close(const std::vector<double>& ref, const std::vector<float>& got, double rel,
                  double abs, const std::string& what) {
  ASSERT_EQ(ref.size(), got.size());
  double worst = 0.0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]) / (rel * std::fabs(ref[i]) + abs);
    if (err > worst) worst = err, worst_i = i;
  }
  EXPECT_LE(worst, 1.0) << what << ": element " << worst_i << " got " << got[worst_i]
                        << ", reference " << ref[worst_i];
}

TEST(AdamW, MatchesNaiveDoubleReference) {
  OptimizerCfg o;  // beta1 0.9, beta2 0.95, eps 1e-8, weight_decay 0.1
  TensorTable table;
  table.add(spec("decayed", {6, 5}, InitKind::Normal, 0.02, true, 1.0));
  table.add(spec("no_decay", {17}, InitKind::Ones, 0.0, false, 1.0));
  table.add(spec("fast_decayed", {4, 3}, InitKind::Normal, 0.02, true, 5.0));
  table.add(spec("fast_no_decay", {9}, InitKind::Zeros, 0.0, false, 2.5));
  table.allocate();
  const std::int64_t n = table.total_elements();

  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> p0(n);
  for (auto& x : p0) x = u(gen);
  from_host(p0, table.params);
  RefAdamW ref{std::vector<double>(p0.begin(), p0.end()), std::vector<double>(n, 0.0),
               std::vector<double>(n, 0.0)};

  const double lrs[3] = {1e-2, 7e-3, 4e-3};
  const double clip_scale = 0.37;
  for (int t = 1; t <= 3; ++t) {
    std::vector<float> g(n);
    for (auto& x : g) x = u(gen);
    from_host(g, table.grads);
    adamw_step(o, table, t, lrs[t - 1], clip_scale);
    ref_adamw_step(o, table, ref, g, t, lrs[t - 1], clip_scale);
    const std::string step = " after step " + std::to_string(t);
    // Absolute floor: 1e-6 of the largest single update (lr * lr_mult = 0.05, |m^/sqrt(v^)| ~ 1).
    expect_close(ref.p, to_host(table.params), 1e-6, 5e-8, "params" + step);
    // exp_avg can cancel to near zero; the absolute floor is 1e-6 of its scale (|g| <= 0.37).
    expect_close(ref.m, to_host(table.exp_avg), 1e-6, 1e-7, "exp_avg" + step);
    expect_close(ref.v, to_host(table.exp_avg_sq), 1e-6, 1e-12, "exp_avg_sq" + step);
    // The optimizer reads gradients; it must not change them.
    EXPECT_TRUE(bit_identical(g, to_host(table.grads))) << step;
  }
}

// With zero gradients (and zero moments) an AdamW step is pure decoupled weight decay:
// theta *= 1 - lr * lr_mult * wd where weight_decay is on, and exactly nothing elsewhere.
TEST(AdamW, WeightDecayOnlyWhereFlagged) {
  OptimizerCfg o;
  o.weight_decay = 0.1;
  TensorTable table;
  table.add(spec("wd", {8}, InitKind::Normal, 1.0, true, 1.0));
  table.add(spec("wd_x3", {8}, InitKind::Normal, 1.0, true, 3.0));
  table.add(spec("no_wd", {8}, InitKind::Normal, 1.0, false, 1.0));
  table.add(spec("no_wd_x3", {8}, InitKind::Normal, 1.0, false, 3.0));
  table.allocate();
  table.initialize(5);
  const auto before = to_host(table.params);
  const double lr = 0.05;
  adamw_step(o, table, 1, lr, 0.5);
  const auto after = to_host(table.params);
  for (const auto& e : table.entries()) {
    const double factor = e.spec.weight_decay ? 1.0 - lr * e.spec.lr_mult * o.weight_decay : 1.0;
    for (std::int64_t i = e.offset; i < e.offset + e.size; ++i) {
      if (!e.spec.weight_decay) {
        EXPECT_EQ(after[i], before[i]) << e.spec.name << " element " << i - e.offset;
      } else {
        EXPECT_NEAR(after[i], before[i] * factor, 1e-6 * std::fabs(before[i]))
            << e.spec.name << " element " << i - e.offset;
      }
    }
  }
}

// lr_mult scales the group learning rate: with identical parameters and gradients, a tensor with
// lr_mult 4 moves exactly 4x as far in one step (with and without weight decay).
TEST(AdamW, LrMultScalesTheStep) {
  OptimizerCfg o;
  for (bool wd : {false, true}) {
    TensorTable table;
    table.add(spec("base", {32}, InitKind::Normal, 0.5, wd, 1.0));
    table.add(spec("scaled", {32}, InitKind::Normal, 0.5, wd, 4.0));
    table.allocate();
    std::mt19937 gen(wd ? 2 : 1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> p(64), g(64);
    for (int i = 0; i < 32; ++i) p[i] = p[i + 32] = u(gen), g[i] = g[i + 32] = u(gen);
    from_host(p, table.params);
    from_host(g, table.grads);
    adamw_step(o, table, 1, 1e-3, 1.0);
    const auto q = to_host(table.params);
    for (int i = 0; i < 32; ++i) {
      const double d_base = double(q[i]) - p[i], d_scaled = double(q[i + 32]) - p[i + 32];
      EXPECT_GT(std::fabs(d_base), 1e-4) << i;
      EXPECT_NEAR(d_scaled, 4.0 * d_base, 2e-3 * std::fabs(4.0 * d_base))
          << "wd " << wd << " element " << i;
    }
  }
}

// The clip scale multiplies the gradient before both moments (MODEL.md section 6).
TEST(AdamW, ClipScaleMultipliesTheGradient) {
  OptimizerCfg o;
  TensorTable table;
  table.add(spec("w", {10}, InitKind::Normal, 0.02, true, 1.0));
  table.allocate();
  std::vector<float> g(10);
  for (int i = 0; i < 10; ++i) g[i] = 0.1f * (i - 4.5f);
  from_host(g, table.grads);
  adamw_step(o, table, 1, 1e-3, 0.25);
  const auto m = to_host(table.exp_avg), v = to_host(table.exp_avg_sq);
  for (int i = 0; i < 10; ++i) {
    const double gs = 0.25 * g[i];
    EXPECT_NEAR(m[i], (1 - o.beta1) * gs, 1e-6 * std::fabs((1 - o.beta1) * gs)) << i;
    EXPECT_NEAR(v[i], (1 - o.beta2) * gs * gs, 1e-6 * (1 - o.beta2) * gs * gs) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Gradient norm.

TEST(GradSqSum, EqualsNaiveSumOfSquares) {
  TensorTable table;
  table.add(spec("a", {13, 7}));
  table.add(spec("b", {101}));
  table.add(spec("c", {3, 4, 5}));
  table.allocate();
  std::mt19937 gen(4);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> g(table.total_elements());
  for (auto& x : g) x = nd(gen);
  from_host(g, table.grads);
  double expected = 0.0;
  for (float x : g) expected += double(x) * double(x);
  EXPECT_NEAR(grad_sq_sum(table), expected, 1e-12 * expected);
  // Parameters and moments play no part.
  from_host(std::vector<float>(g.size(), 9.0f), table.params);
  from_host(std::vector<float>(g.size(), 9.0f), table.exp_avg);
  EXPECT_NEAR(grad_sq_sum(table), expected, 1e-12 * expected);
  from_host(std::vector<float>(g.size(), 0.0f), table.grads);
  EXPECT_EQ(grad_sq_sum(table), 0.0);
}

// ---------------------------------------------------------------------------------------------
// 4. TensorTable.

TEST(TensorTable, OffsetsAreContiguousInDeclarationOrder) {
  TensorTable t;
  EXPECT_EQ(t.add(spec("a", {2, 3})), 0);
  EXPECT_EQ(t.add(spec("b", {5})), 1);
  EXPECT_EQ(t.add(spec("c", {4, 1, 2})), 2);
  EXPECT_EQ(t.add(spec("d", {3, 3})), 3);
  ASSERT_EQ(t.size(), 4);
  const std::int64_t sizes[4] = {6, 5, 8, 9};
  std::int64_t offset = 0;
  for (int i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t.entry(i).offset, offset) << i;
    EXPECT_EQ(t.entry(i).size, sizes[i]) << i;
    offset += sizes[i];
  }
  EXPECT_EQ(t.total_elements(), 28);
  EXPECT_EQ(t.find("a"), 0);
  EXPECT_EQ(t.find("c"), 2);
  EXPECT_EQ(t.find("d"), 3);
  EXPECT_EQ(t.find("e"), -1);
  EXPECT_EQ(t.find(""), -1);
  EXPECT_EQ(t.entry(2).spec.name, "c");
  EXPECT_EQ(t.entry(2).spec.shape, (std::vector<std::int64_t>{4, 1, 2}));

  t.allocate();
  for (const View1F* v : {&t.params, &t.grads, &t.exp_avg, &t.exp_avg_sq}) {
    ASSERT_EQ(v->extent(0), 28u);
    for (float x : to_host(*v)) EXPECT_EQ(x, 0.0f);
  }
  EXPECT_EQ(t.param(0), t.params.data());
  EXPECT_EQ(t.param(2), t.params.data() + 11);
  EXPECT_EQ(t.grad(3), t.grads.data() + 19);
}

// optimizer.shard in bf16 runs: a gemm_only tensor with a split moment slice is kept as a bf16
// compute copy of every local row and fp32 values for its slice's rows only; other tensors keep
// their fp32 values whole. Initialization gives the master rows the values an ordinary table
// gets and the copy their bf16 rounding; AdamW updates the master rows exactly as the ordinary
// table's and writes them, rounded, into the copy, leaving the other replicas' rows alone.
TEST(TensorTable, Bf16ComputeCopiesKeepShardedMasterRows) {
  auto declare = [](TensorTable& t) {
    t.add(TensorSpec::matrix("a", {6, 4}, 0.5).gemm_weight());  // copied: split, gemm_only
    t.add(TensorSpec::gain("g", 4));                             // split, not gemm_only
    t.add(TensorSpec::matrix("b", {3, 4}, 0.5).gemm_weight());  // gemm_only, not split
  };
  const std::vector<MomentSlice> slices = {{2, 3, 0, true}, {1, 2, 12, true}, {0, 3, 14, false}};
  TensorTable plain, copied;
  declare(plain);
  declare(copied);
  plain.allocate(&slices);
  copied.allocate(&slices, /*bf16_copies=*/true);
  EXPECT_TRUE(copied.has_copy(0));
  EXPECT_FALSE(copied.has_copy(1));
  EXPECT_FALSE(copied.has_copy(2));
  EXPECT_FALSE(plain.has_copy(0));
  EXPECT_EQ(copied.params.extent(0), std::size_t(3 * 4 + 4 + 12));  // a's slice rows, g, b
  EXPECT_EQ(copied.weights_b16.extent(0), std::size_t(24));
  EXPECT_EQ(copied.master_first(0), 2);
  EXPECT_EQ(copied.master_rows(0), 3);
  EXPECT_EQ(copied.param_offset(1), 12);
  EXPECT_THROW(copied.param(0), Error);
  EXPECT_EQ(copied.weight(0, 6, 4).f32, nullptr);
  EXPECT_EQ(copied.weight(0, 6, 4, 8).b16, copied.weights_b16.data() + 8);
  EXPECT_EQ(copied.weight(2, 3, 4).f32, copied.param(2));

  auto words = [](const TensorTable& t) {
    auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), t.weights_b16);
    return std::vector<std::uint16_t>(h.data(), h.data() + h.extent(0));
  };
  auto check = [&](const char* when) {
    const auto p = to_host(plain.params), c = to_host(copied.params);
    const auto w = words(copied);
    for (int j = 0; j < 24; ++j) EXPECT_EQ(w[j], bf16_bits(p[j])) << when << " copy of a " << j;
    for (int j = 0; j < 12; ++j) EXPECT_EQ(c[j], p[8 + j]) << when << " master row of a " << j;
    for (int j = 12; j < 28; ++j) EXPECT_EQ(c[j], p[j + 12]) << when << " g and b " << j;
  };
  plain.initialize(7);
  copied.initialize(7);
  check("initialized");
  std::vector<float> g(plain.total_elements());
  for (std::size_t j = 0; j < g.size(); ++j) g[j] = 0.01f * float(j % 7) - 0.02f;
  from_host(g, plain.grads);
  from_host(g, copied.grads);
  OptimizerCfg o;
  o.lr = 0.1;
  for (int t = 1; t <= 2; ++t) {
    adamw_step(o, plain, t, 0.1, 1.0);
    adamw_step(o, copied, t, 0.1, 1.0);
  }
  check("after AdamW");
  const auto w = words(copied);
  const auto init = [&] {
    TensorTable fresh;
    declare(fresh);
    fresh.allocate();
    fresh.initialize(7);
    return to_host(fresh.params);
  }();
  EXPECT_EQ(w[0], bf16_bits(init[0])) << "rows outside the slice are other replicas' to update";
  EXPECT_NE(w[8], bf16_bits(init[8]));
}

TEST(TensorTable, DuplicateNameThrows) {
  TensorTable t;
  t.add(spec("w", {4}));
  t.add(spec("x", {4}));
  EXPECT_THROW(t.add(spec("w", {8})), Error);
  EXPECT_EQ(t.size(), 2);
  EXPECT_EQ(t.total_elements(), 8);
}

TEST(TensorTable, AddAfterAllocateThrows) {
  TensorTable t;
  t.add(spec("w", {4}));
  t.allocate();
  EXPECT_THROW(t.add(spec("x", {4})), Error);
  EXPECT_EQ(t.size(), 1);
}

TEST(TensorTable, InitializeBeforeAllocateThrows) {
  TensorTable t;
  t.add(spec("w", {4}));
  EXPECT_THROW(t.initialize(1), Error);
}

TEST(TensorTable, InitializeIsDeterministic) {
  auto build = [](std::uint64_t seed) {
    TensorTable t;
    t.add(spec("blocks.0.attn.wq", {16, 8}));
    t.add(spec("blocks.0.attn_norm.weight", {8}, InitKind::Ones));
    t.add(spec("lm_head.weight", {33, 8}, InitKind::Normal, 0.1));
    t.allocate();
    t.initialize(seed);
    return to_host(t.params);
  };
  const auto a = build(1234), b = build(1234), c = build(1235);
  EXPECT_TRUE(bit_identical(a, b));
  // Another seed changes every Normal element (the 8 ones stay).
  int same = 0;
  for (std::size_t i = 0; i < a.size(); ++i) same += a[i] == c[i];
  EXPECT_EQ(same, 8);

  // Re-initializing a table restores it exactly and zeroes gradients and moments.
  TensorTable t;
  t.add(spec("w", {50}));
  t.allocate();
  t.initialize(9);
  const auto first = to_host(t.params);
  from_host(std::vector<float>(50, 3.0f), t.params);
  from_host(std::vector<float>(50, 3.0f), t.grads);
  from_host(std::vector<float>(50, 3.0f), t.exp_avg);
  from_host(std::vector<float>(50, 3.0f), t.exp_avg_sq);
  t.initialize(9);
  EXPECT_TRUE(bit_identical(first, to_host(t.params)));
  for (const View1F* v : {&t.grads, &t.exp_avg, &t.exp_avg_sq})
    for (float x : to_host(*v)) EXPECT_EQ(x, 0.0f);
}

// MODEL.md section 7: element j of tensor `name` depends only on (seed, name, j), not on the
// declaration order, the other tensors, the offset or the shape.
TEST(TensorTable, InitializationIsLayoutIndependent) {
  const std::uint64_t seed = 77;
  TensorTable a;
  a.add(spec("blocks.1.mlp.w1", {12, 10}));
  a.add(spec("blocks.1.mlp.w2", {10, 12}));
  a.allocate();
  a.initialize(seed);

  TensorTable b;  // reversed order, extra tensors before, between and after
  b.add(spec("embed.weight", {37, 10}));
  b.add(spec("blocks.1.mlp.w2", {10, 12}));
  b.add(spec("final_norm.weight", {10}, InitKind::Ones));
  b.add(spec("blocks.1.mlp.w1", {12, 10}));
  b.add(spec("lm_head.weight", {37, 10}));
  b.allocate();
  b.initialize(seed);

  for (const char* name : {"blocks.1.mlp.w1", "blocks.1.mlp.w2"})
    EXPECT_TRUE(bit_identical(tensor_values(a, name), tensor_values(b, name))) << name;

  // Same name, other shape: element j is still the same value.
  TensorTable c;
  c.add(spec("blocks.1.mlp.w1", {60}));
  c.add(spec("blocks.1.mlp.w2", {3, 4, 10}));
  c.allocate();
  c.initialize(seed);
  const auto a1 = tensor_values(a, "blocks.1.mlp.w1"), c1 = tensor_values(c, "blocks.1.mlp.w1");
  EXPECT_TRUE(bit_identical(std::vector<float>(a1.begin(), a1.begin() + 60), c1));
  EXPECT_TRUE(
      bit_identical(tensor_values(a, "blocks.1.mlp.w2"), tensor_values(c, "blocks.1.mlp.w2")));

  // Different names draw different values.
  const auto a2 = tensor_values(a, "blocks.1.mlp.w2");
  int same = 0;
  for (std::size_t j = 0; j < a2.size(); ++j) same += a1[j] == a2[j];
  EXPECT_EQ(same, 0);
}

TEST(TensorTable, NormalInitIsTruncatedAtThreeStd) {
  const double init_std = 0.02;
  const std::int64_t n = 400000;
  TensorTable t;
  t.add(spec("big", {n}, InitKind::Normal, init_std));
  t.allocate();
  t.initialize(2024);
  const auto x = to_host(t.params);
  double sum = 0.0, sq = 0.0, max_abs = 0.0;
  std::int64_t within_one = 0;
  for (float v : x) {
    sum += v;
    sq += double(v) * v;
    max_abs = std::max(max_abs, std::fabs(double(v)));
    within_one += std::fabs(v) <= init_std;
  }
  const double mean = sum / n, sd = std::sqrt(sq / n - mean * mean);
  // Resampled beyond 3 std, but the tails up to 3 std are populated.
  EXPECT_LE(max_abs, 3.0 * init_std * (1.0 + 1e-6));
  EXPECT_GT(max_abs, 2.9 * init_std);
  EXPECT_LT(std::fabs(mean), 5.0 * init_std / std::sqrt(double(n)));
  // A N(0, s) truncated at +-3s has std 0.98658 s and P(|x| <= s) = 0.68453.
  EXPECT_NEAR(sd / init_std, 0.98658, 0.01);
  EXPECT_NEAR(double(within_one) / n, 0.68453, 0.005);
}

// The schemes of model.init (MODEL.md section 7), written out here independently: for every
// matrix of a model with dense and MoE blocks, shared experts, Engram and an untied head, the
// std each scheme gives, and the statistics of the initialized values against it (mean within
// sampling error of 0, std within 4 standard errors of the truncated normal's 0.98658 std, no
// value beyond 3 std).
TEST(InitSchemes, EveryMatrixFollowsItsFormula) {
  ModelCfg m;
  m.vocab_size = 96;
  m.d_model = 48;
  m.n_layers = 3;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.ffn_hidden = 80;
  MoeCfg e;
  e.experts = 4;
  e.top_k = 2;
  e.expert_hidden = 40;
  e.dense_layers = {0};
  e.shared_experts = 1;
  e.shared_hidden = 24;
  EngramCfg g;
  g.layers = {1};
  g.heads = 2;
  g.embed_per_ngram = 16;
  g.table_size = {211, 223};
  g.init_std = 0.07;
  const int d_mem = 2 * 16;
  struct Scheme {
    InitScheme init;
    bool depth;
    double embed, gain;
  };
  for (const Scheme s : {Scheme{InitScheme::Normal, false, -1.0, 1.0},
                         Scheme{InitScheme::Normal, true, 0.5, 0.3},
                         Scheme{InitScheme::FanIn, false, 1.0, 1.0},
                         Scheme{InitScheme::FanIn, true, -1.0, 1.0},
                         Scheme{InitScheme::FanIn, true, 0.8, 0.577}}) {
    m.init = s.init;
    m.init_depth_scale = s.depth;
    m.embed_init_std = s.embed;
    m.init_gain = s.gain;
    SCOPED_TRACE(std::string(choice_name(s.init)) + (s.depth ? " depth" : ""));
    TensorTable t;
    Stage stage(RunContext(), m, e, 1, 8, t, g);
    t.allocate();
    t.initialize(11);
    const auto all = to_host(t.params);
    int checked = 0;
    for (const TensorEntry& en : t.entries()) {
      if (en.spec.init != InitKind::Normal) continue;
      const std::string& n = en.spec.name;
      auto ends = [&](const std::string& tail) {
        return n.size() >= tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
      };
      // The formula, from the tensor's role and its input width (the last dimension).
      const double fan_in = double(en.spec.shape.back());
      double want = s.init == InitScheme::FanIn ? s.gain / std::sqrt(fan_in) : m.init_std;
      if (s.depth && (ends(".attn.wo") || ends(".w2"))) want /= std::sqrt(2.0 * m.n_layers);
      if (n == "embed.weight") want = s.embed > 0 ? s.embed : m.init_std;
      if (ends("engram.table") || (n.find(".engram.w") != std::string::npos &&
                                   s.init == InitScheme::Normal))
        want = g.init_std;
      if (n.find(".engram.w") != std::string::npos && s.init == InitScheme::FanIn) {
        ASSERT_EQ(fan_in, d_mem);
      }
      EXPECT_DOUBLE_EQ(en.spec.init_std, want) << n;
      double sum = 0.0, sq = 0.0, max_abs = 0.0;
      for (std::int64_t j = en.offset; j < en.offset + en.size; ++j) {
        sum += all[j];
        sq += double(all[j]) * all[j];
        max_abs = std::max(max_abs, std::fabs(double(all[j])));
      }
      const double k = double(en.size), mean = sum / k, sd = std::sqrt(sq / k - mean * mean);
      EXPECT_LT(std::fabs(mean), 5.0 * want / std::sqrt(k)) << n;
      EXPECT_NEAR(sd / (0.98658 * want), 1.0, 4.0 * 0.6 / std::sqrt(k) + 0.01) << n;
      EXPECT_LE(max_abs, 3.0 * want * (1.0 + 1e-6)) << n;
      ++checked;
    }
    EXPECT_GE(checked, 20);
  }
}

TEST(TensorTable, OnesAndZerosAreExact) {
  TensorTable t;
  t.add(spec("n", {40}));
  t.add(spec("ones", {33}, InitKind::Ones, 0.7));
  t.add(spec("zeros", {21}, InitKind::Zeros, 0.7));
  t.allocate();
  from_host(std::vector<float>(t.total_elements(), -5.0f), t.params);
  t.initialize(3);
  for (float v : tensor_values(t, "ones")) EXPECT_EQ(v, 1.0f);
  for (float v : tensor_values(t, "zeros")) EXPECT_EQ(v, 0.0f);
  for (float v : tensor_values(t, "n")) EXPECT_LE(std::fabs(v), 0.06f + 1e-7f);
}

// ---------------------------------------------------------------------------------------------
// 5. model_size() against the TensorTable of a built Stage.

ModelCfg small_model() {
  ModelCfg m;
  m.vocab_size = 64;
  m.d_model = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 4;
  m.ffn_hidden = 48;
  return m;
}

struct Variant {
  const char* label;
  bool tie;
  bool qk_norm;
  int kv_heads;
  const char* block_norm;
};

TEST(ModelSize, MatchesBuiltStage) {
  const int T = 16, max_seqs = 2;
  const Variant variants[] = {
      {"untied qk_norm MHA reordered", false, true, 4, "reordered"},
      {"tied qk_norm MHA reordered", true, true, 4, "reordered"},
      {"untied no qk_norm MHA reordered", false, false, 4, "reordered"},
      {"untied qk_norm GQA2 reordered", false, true, 2, "reordered"},
      {"tied qk_norm MQA pre", true, true, 1, "pre"},
      {"untied no qk_norm GQA2 pre", false, false, 2, "pre"},
      {"tied no qk_norm GQA2 pre", true, false, 2, "pre"},
  };
  for (const auto& var : variants) {
    SCOPED_TRACE(var.label);
    ModelCfg m = small_model();
    m.tie_embeddings = var.tie;
    m.qk_norm = var.qk_norm;
    m.n_kv_heads = var.kv_heads;
    m.block_norm = choice_from<BlockNorm>(var.block_norm);
    TensorTable table;
    Stage stage(RunContext(), m, MoeCfg(), max_seqs, T, table);
    const ModelSize s = model_size(m, MoeCfg(), max_seqs, T);
    const std::int64_t V = m.vocab_size, D = m.d_model, L = m.n_layers;
    EXPECT_EQ(s.total_params, table.total_elements());
    EXPECT_EQ(s.active_params, s.total_params);  // dense
    EXPECT_EQ(s.embedding_params, V * D);
    const double expected_flops =
        6.0 * double(s.total_params - (var.tie ? 0 : V * D)) + 6.0 * double(L * D * T);
    EXPECT_DOUBLE_EQ(s.flops_per_token, expected_flops);
    EXPECT_EQ(s.state_bytes, 16 * s.total_params);
    EXPECT_GT(s.activation_bytes, 0);
  }
}

// With MoE layers (block 0 dense, block 1 MoE with a shared expert): total = the table; active
// counts k of the E experts.
TEST(ModelSize, MoeCountsMatchBuiltStage) {
  ModelCfg m = small_model();
  MoeCfg e;
  e.experts = 4;
  e.top_k = 2;
  e.expert_hidden = 8;
  e.dense_layers = {0};
  e.shared_experts = 1;
  e.shared_hidden = 6;
  TensorTable table;
  Stage stage(RunContext(), m, e, 2, 16, table);
  const ModelSize s = model_size(m, e, 2, 16);
  const std::int64_t D = m.d_model;
  EXPECT_EQ(s.total_params, table.total_elements());
  EXPECT_EQ(s.total_params - s.active_params, 3 * (e.experts - e.top_k) * e.expert_hidden * D);
  EXPECT_GE(table.find("blocks.1.moe.experts.w1"), 0);
  EXPECT_GE(table.find("blocks.1.moe.shared.w2"), 0);
  EXPECT_GE(table.find("blocks.0.mlp.w1"), 0);
  EXPECT_LT(table.find("blocks.1.mlp.w1"), 0);

  // With Engram at both blocks: the tables and projections count in the total.
  EngramCfg g;
  g.layers = {0, 1};
  g.heads = 2;
  g.embed_per_ngram = 8;
  g.table_size = {50, 60};
  TensorTable t2;
  Stage s2(RunContext(), m, e, 2, 16, t2, g);
  EXPECT_EQ(model_size(m, e, 2, 16, g).total_params, t2.total_elements());
  EXPECT_GE(t2.find("blocks.0.engram.table"), 0);
}

// A rank's share (the memory check's estimate) holds exactly the tensors its Stage declares,
// for every pipeline stage plan, tied or not, with and without aux-free router biases.
TEST(ModelSize, RankShareMatchesTheStagesTable) {
  ModelCfg m = small_model();
  m.n_layers = 3;
  MoeCfg e;
  e.experts = 4;
  e.top_k = 2;
  e.expert_hidden = 8;
  e.dense_layers = {0};
  EngramCfg g;
  g.layers = {1};
  g.heads = 2;
  g.embed_per_ngram = 8;
  g.table_size = {50, 60};
  for (bool tie : {false, true})
    for (double bias : {0.0, 0.01})
      for (const auto& [first, last] : {std::pair{0, 3}, std::pair{0, 1}, std::pair{1, 3}}) {
        SCOPED_TRACE(std::to_string(first) + ".." + std::to_string(last) + (tie ? " tied" : "") +
                     (bias > 0 ? " bias" : ""));
        m.tie_embeddings = tie;
        e.bias_update_rate = bias;
        StagePlan plan;
        plan.first_block = first;
        plan.last_block = last;
        plan.embed = first == 0;
        plan.head = last == 3;
        TensorTable table;
        Stage stage(RunContext(), m, e, 2, 16, table, g, plan);
        RankShare r;
        r.first_block = first;
        r.last_block = last;
        r.embed = plan.embed;
        r.head = plan.head;
        const RankMemory mem = rank_memory(m, e, g, 2, 16, r);
        EXPECT_EQ(mem.elements, table.total_elements());
        EXPECT_EQ(mem.state_bytes, 16 * mem.elements);
        EXPECT_GT(mem.activation_bytes, 0);
        // The tensors only products read: the dense ones counted apart from the experts.
        std::int64_t gemm_only = 0;
        for (const TensorEntry& en : table.entries()) gemm_only += en.spec.gemm_only ? en.size : 0;
        EXPECT_EQ(mem.gemm_elements + mem.expert_elements, gemm_only);
        EXPECT_EQ(mem.copy_elements, 0);
        // bf16 with sharded state on 4 dense / 2 expert replicas: the copies at 2 bytes, their
        // fp32 master rows a quarter (dense) and a half (experts).
        RankShare sh = r;
        sh.precision = Precision::Bf16;
        sh.dense_replicas = 4;
        sh.expert_replicas = 2;
        const RankMemory c = rank_memory(m, e, g, 2, 16, sh);
        EXPECT_EQ(c.copy_elements, mem.gemm_elements + mem.expert_elements);
        const std::int64_t masters = (mem.gemm_elements + 3) / 4 + (mem.expert_elements + 1) / 2;
        EXPECT_EQ(c.param_bytes, 4 * (c.elements - c.copy_elements) + 2 * c.copy_elements +
                                     4 * masters);
        sh.precision = Precision::Fp32;  // fp32 runs compute from the fp32 values: no copies
        EXPECT_EQ(rank_memory(m, e, g, 2, 16, sh).param_bytes, 4 * mem.elements);
        r.in_flight = 3;  // more micro-batches in flight keep more activations
        EXPECT_GT(rank_memory(m, e, g, 2, 16, r).activation_bytes, mem.activation_bytes);
        r.precision = Precision::Bf16;  // bf16 keeps some of them at half the bytes
        const RankMemory half = rank_memory(m, e, g, 2, 16, r);
        r.precision = Precision::Fp32;
        const RankMemory full = rank_memory(m, e, g, 2, 16, r);
        EXPECT_EQ(half.state_bytes, full.state_bytes);
        EXPECT_LT(half.activation_bytes, full.activation_bytes);
        EXPECT_GT(2 * half.activation_bytes, full.activation_bytes);
      }
}

// The dry run's bytes sent per step (train/memory_check.hpp step_traffic), from its formulas.
TEST(StepTraffic, FollowsTheGridAndThePrecision) {
  const char* deck = R"([model]
vocab_size = 320
d_model = 64
n_layers = 4
n_heads = 4
ffn_hidden = 128
[moe]
experts = 4
top_k = 2
expert_hidden = 32
[train]
seq_len = 32
micro_batch = 2
global_batch = 16
max_steps = 1
[optimizer]
lr = 1e-3
[data]
paths = a.bin
)";
  auto cfg = [&](const std::vector<std::string>& o) { return parse_deck(deck, "t.deck", o); };
  EXPECT_EQ(step_traffic(cfg({}), 0).total(), 0.0);  // one rank sends nothing
  // dp 2: every gradient once around the ring (2 (2 - 1) / 2 = one buffer), 4 bytes each.
  const Config dp2 = cfg({"--parallel.dp=2"});
  const RankMemory m =
      rank_memory(dp2.model, dp2.moe, dp2.engram, 2, 32, rank_share(dp2, 0, 1));
  const StepTraffic a = step_traffic(dp2, 0);
  EXPECT_DOUBLE_EQ(a.stage_grads + a.dp_grads, 4.0 * m.elements);
  EXPECT_GT(a.dp_grads, 0.0);  // the experts
  EXPECT_EQ(a.all_to_all, 0.0);
  EXPECT_EQ(a.pipeline, 0.0);
  // bf16 with sharded state: the reduce-scatter at 4 bytes, the all-gather of the tensors only
  // products read at 2 (their bf16 copies): a quarter less for those tensors.
  const Config sb = cfg({"--parallel.dp=2", "--optimizer.shard=replicas", "--train.precision=bf16"});
  const RankMemory ms = rank_memory(sb.model, sb.moe, sb.engram, 2, 32, rank_share(sb, 0, 1));
  const StepTraffic c = step_traffic(sb, 0);
  EXPECT_DOUBLE_EQ(c.stage_grads + c.dp_grads, 4.0 * m.elements - 1.0 * ms.copy_elements);
  EXPECT_EQ(ms.copy_elements, ms.gemm_elements + ms.expert_elements);
  EXPECT_EQ(step_traffic(cfg({"--parallel.dp=2", "--optimizer.shard=replicas"}), 0).total(),
            a.total());  // fp32: the gather moves what the all-reduce's second half did
  // ep 2: 4 micro-batches per replica x 4 MoE layers x 64 of the 128 rows leaving x D 64, out
  // and back, forward and backward, 4 bytes each; bf16 halves the rows and output gradients.
  const StepTraffic f = step_traffic(cfg({"--parallel.ep=2"}), 0);
  const StepTraffic b = step_traffic(cfg({"--parallel.ep=2", "--train.precision=bf16"}), 0);
  EXPECT_DOUBLE_EQ(f.all_to_all, 4.0 * 4 * 64 * 64 * 16);
  EXPECT_DOUBLE_EQ(b.all_to_all, 0.75 * f.all_to_all);
  EXPECT_EQ(f.dp_grads, 0.0);  // dp 1: experts are not reduced
  // pp 2: 8 micro-batches, each stage sending one boundary (64 tokens x 64 x 4 bytes) each way
  // it has a neighbour.
  const Config pp2 = cfg({"--parallel.pp=2"});
  EXPECT_DOUBLE_EQ(step_traffic(pp2, 0).pipeline, 8.0 * 64 * 64 * 4);
  EXPECT_DOUBLE_EQ(step_traffic(pp2, 1).pipeline, 8.0 * 64 * 64 * 4);
  EXPECT_EQ(step_traffic(pp2, 0).stage_grads, 0.0);
}

// Sizes beyond 64 bits are an error naming the keys, not a negative estimate.
TEST(ModelSize, OverflowIsAnErrorNamingTheKeys) {
  ModelCfg m = small_model();
  m.d_model = 1000000000;
  m.n_heads = 1;
  m.n_kv_heads = 1;
  try {
    model_size(m, MoeCfg(), 2, 16);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("overflow 64-bit"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.d_model"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rank_memory(m, MoeCfg(), EngramCfg(), 2, 16, RankShare{0, 2}), Error);
}

// ---------------------------------------------------------------------------------------------
// 6. MODEL.md section 5 names and shapes, section 6 decay groups, section 7 init kinds.

struct Expected {
  std::vector<std::int64_t> shape;
  bool decay;
  InitKind init;
};

std::map<std::string, Expected> expected_tensors(const ModelCfg& m) {
  const std::int64_t V = m.vocab_size, D = m.d_model, F = m.ffn_hidden, dh = m.head_dim();
  const std::int64_t qd = m.n_heads * dh, kd = m.n_kv_heads * dh;
  std::map<std::string, Expected> e;
  e["embed.weight"] = {{V, D}, false, InitKind::Normal};
  for (int l = 0; l < m.n_layers; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    e[b + "attn.wq"] = {{qd, D}, true, InitKind::Normal};
    e[b + "attn.wk"] = {{kd, D}, true, InitKind::Normal};
    e[b + "attn.wv"] = {{kd, D}, true, InitKind::Normal};
    e[b + "attn.wo"] = {{D, qd}, true, InitKind::Normal};
    if (m.qk_norm) {
      e[b + "attn.q_norm.weight"] = {{qd}, false, InitKind::Ones};
      e[b + "attn.k_norm.weight"] = {{kd}, false, InitKind::Ones};
    }
    e[b + "attn_norm.weight"] = {{D}, false, InitKind::Ones};
    e[b + "ffn_norm.weight"] = {{D}, false, InitKind::Ones};
    e[b + "mlp.w1"] = {{F, D}, true, InitKind::Normal};
    e[b + "mlp.w3"] = {{F, D}, true, InitKind::Normal};
    e[b + "mlp.w2"] = {{D, F}, true, InitKind::Normal};
  }
  e["final_norm.weight"] = {{D}, false, InitKind::Ones};
  if (!m.tie_embeddings) e["lm_head.weight"] = {{V, D}, true, InitKind::Normal};
  return e;
}

void check_names_and_shapes(const ModelCfg& m) {
  TensorTable table;
  Stage stage(RunContext(), m, MoeCfg(), 2, 16, table);
  const auto expected = expected_tensors(m);
  std::map<std::string, int> seen;
  for (int i = 0; i < table.size(); ++i) {
    const auto& s = table.entry(i).spec;
    seen[s.name] = i;
    const auto it = expected.find(s.name);
    if (it == expected.end()) {
      ADD_FAILURE() << "unexpected tensor " << s.name;
      continue;
    }
    EXPECT_EQ(s.shape, it->second.shape) << s.name;
    EXPECT_EQ(s.weight_decay, it->second.decay) << s.name;
    EXPECT_EQ(s.init == InitKind::Ones, it->second.init == InitKind::Ones) << s.name;
    EXPECT_EQ(s.init == InitKind::Normal, it->second.init == InitKind::Normal) << s.name;
    if (s.init == InitKind::Normal) {
      EXPECT_DOUBLE_EQ(s.init_std, m.init_std) << s.name;
    }
    EXPECT_DOUBLE_EQ(s.lr_mult, 1.0) << s.name;
  }
  EXPECT_EQ(table.size(), static_cast<int>(expected.size()));  // no duplicates either
  for (const auto& kv : expected) EXPECT_EQ(seen.count(kv.first), 1u) << "missing " << kv.first;
  EXPECT_EQ(table.find("lm_head.weight") >= 0, !m.tie_embeddings);

  // Fused GEMMs rely on wq|wk|wv and w1|w3 being adjacent in the flat buffers.
  for (int l = 0; l < m.n_layers; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    auto start_of = [&](const std::string& n) -> std::int64_t {
      const int i = table.find(n);
      return i < 0 ? -1 : table.entry(i).offset;
    };
    auto end_of = [&](const std::string& n) -> std::int64_t {
      const int i = table.find(n);
      return i < 0 ? -2 : table.entry(i).offset + table.entry(i).size;
    };
    EXPECT_EQ(end_of(b + "attn.wq"), start_of(b + "attn.wk")) << b;
    EXPECT_EQ(end_of(b + "attn.wk"), start_of(b + "attn.wv")) << b;
    EXPECT_EQ(end_of(b + "mlp.w1"), start_of(b + "mlp.w3")) << b;
  }
}

TEST(StageTensors, NamesShapesAndDecayUntiedQkNorm) {
  ModelCfg m = small_model();
  m.n_kv_heads = 2;  // GQA, so wk/wv and k_norm differ from wq/q_norm
  m.qk_norm = true;
  m.tie_embeddings = false;
  check_names_and_shapes(m);
}

TEST(StageTensors, TiedHasNoLmHead) {
  ModelCfg m = small_model();
  m.n_kv_heads = 2;
  m.tie_embeddings = true;
  check_names_and_shapes(m);
}

TEST(StageTensors, NoQkNormPreNorm) {
  ModelCfg m = small_model();
  m.qk_norm = false;
  m.block_norm = BlockNorm::Pre;
  m.init_std = 0.05;
  check_names_and_shapes(m);
}

}  // namespace
}  // namespace kmoe

namespace kmoe {
namespace {

// Pipeline schedules: every micro-batch forward once and backward once, backward after its
// forward, the in-flight count bounded as RUNTIME.md section 2 and parallel/pipeline_schedule.hpp
// say.
TEST(Schedule, OneFOneBAndGPipe) {
  for (const char* kind : {"1f1b", "gpipe"})
    for (int P : {1, 2, 4})
      for (int s = 0; s < P; ++s)
        for (int M : {1, 2, 3, 8}) {
          const auto ops = pipeline_schedule(choice_from<PipeSchedule>(kind), P, s, M);
          std::vector<int> f(M, -1), b(M, -1);
          for (std::size_t k = 0; k < ops.size(); ++k)
            (ops[k].forward ? f : b)[ops[k].micro] = static_cast<int>(k);
          for (int i = 0; i < M; ++i) {
            EXPECT_GE(f[i], 0);
            EXPECT_GT(b[i], f[i]) << kind << " P " << P << " s " << s << " M " << M;
          }
          EXPECT_EQ(ops.size(), std::size_t(2 * M));
          const int in_flight = max_in_flight(ops);
          const bool gpipe = std::string(kind) == "gpipe" && P > 1;
          EXPECT_EQ(in_flight, P == 1 ? 1 : (gpipe ? M : std::min(P - s, M)));
          // Micro-batch i runs on Stage instance i mod in_flight: free again once micro-batch
          // i - in_flight is backwarded.
          for (int i = in_flight; i < M; ++i) EXPECT_GT(f[i], b[i - in_flight]);
        }
  EXPECT_THROW(choice_from<PipeSchedule>("interleaved"), Error);  // no such schedule
}

// The named kinds of tensor declaration carry exactly the fields the modules used to spell
// positionally (initialization, decay, learning-rate group, optimizer state, placement).
TEST(TensorSpecs, NamedKindsSayWhatATensorIs) {
  const TensorSpec w = TensorSpec::matrix("w", {6, 5}, 0.03);
  EXPECT_EQ(w.init, InitKind::Normal);
  EXPECT_EQ(w.init_std, 0.03);
  EXPECT_TRUE(w.weight_decay);
  EXPECT_EQ(w.lr_mult, 1.0);
  EXPECT_TRUE(w.trainable);
  EXPECT_EQ(w.shard, Shard::None);
  EXPECT_EQ(w.local_rows(), 6);
  EXPECT_FALSE(w.tied_copy);
  const TensorSpec g = TensorSpec::gain("g", 7);
  EXPECT_EQ(g.shape, (std::vector<std::int64_t>{7}));
  EXPECT_EQ(g.init, InitKind::Ones);
  EXPECT_FALSE(g.weight_decay);
  EXPECT_TRUE(g.trainable);
  const TensorSpec z = TensorSpec::zeros("z", {3, 2});
  EXPECT_EQ(z.init, InitKind::Zeros);
  EXPECT_FALSE(z.weight_decay);
  EXPECT_TRUE(z.trainable);
  const TensorSpec b = TensorSpec::buffer("b", {4});
  EXPECT_EQ(b.init, InitKind::Zeros);
  EXPECT_FALSE(b.trainable);
  const TensorSpec t = w.no_decay().with_lr_mult(5.0).row_block(Shard::Ep, 2, 3);
  EXPECT_FALSE(t.weight_decay);
  EXPECT_EQ(t.lr_mult, 5.0);
  EXPECT_EQ(t.shard, Shard::Ep);
  EXPECT_EQ(t.row_begin, 2);
  EXPECT_EQ(t.local_shape(), (std::vector<std::int64_t>{3, 5}));
  EXPECT_TRUE(w.as_tied_copy().tied_copy);
  EXPECT_TRUE(w.weight_decay);  // refinements return copies
  // embed.weight, here and as the last stage's tied copy: one declaration.
  const TensorSpec e = Embedding::weight_spec(40, 8, 0.02);
  EXPECT_EQ(e.name, "embed.weight");
  EXPECT_EQ(e.shape, (std::vector<std::int64_t>{40, 8}));
  EXPECT_EQ(e.init, InitKind::Normal);
  EXPECT_FALSE(e.weight_decay);
}

// After allocate(), declaring a tensor again is a further module instance sharing it.
TEST(TensorTable, DeclaringAgainAfterAllocationSharesTheTensor) {
  TensorTable t;
  const int a = t.add(TensorSpec::matrix("a", {4, 3}, 0.02));
  const int b = t.add(TensorSpec::gain("b", 5));
  EXPECT_THROW(t.add(TensorSpec::gain("b", 5)), Error);  // a duplicate before allocation
  t.allocate();
  EXPECT_EQ(t.add(TensorSpec::matrix("a", {4, 3}, 0.02)), a);
  EXPECT_EQ(t.add(TensorSpec::gain("b", 5)), b);
  EXPECT_THROW(t.add(TensorSpec::gain("b", 6)), Error);
  EXPECT_THROW(t.add(TensorSpec::matrix("a", {4, 3}, 0.02).row_block(Shard::Ep, 1, 3)), Error);
  EXPECT_THROW(t.add(TensorSpec::gain("c", 5)), Error);  // new after allocation
  EXPECT_EQ(t.size(), 2);
  EXPECT_EQ(t.total_elements(), 17);
}

// Stop signals only record a request (checked at step boundaries): SIGUSR1 asks for a requeue,
// SIGTERM/SIGUSR2/SIGINT for a stop, which wins.
TEST(StopSignals, RecordTheStrongestRequest) {
  install_stop_handlers();
  ASSERT_EQ(requested_stop(), StopKind::None);
  std::raise(SIGUSR1);
  EXPECT_EQ(requested_stop(), StopKind::Requeue);
  EXPECT_STREQ(stop_signal_name(), "SIGUSR1");
  std::raise(SIGUSR2);
  EXPECT_EQ(requested_stop(), StopKind::Cancel);
  EXPECT_STREQ(stop_signal_name(), "SIGUSR2");
  std::raise(SIGUSR1);  // a requeue does not undo a stop
  EXPECT_EQ(requested_stop(), StopKind::Cancel);
}

}  // namespace
}  // namespace kmoe
