// The optimizer against MODEL.md sections 5-7, every reference written independently here: the
// learning-rate schedules, AdamW against a naive double-precision host implementation, the
// gradient norm.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/device_memory.hpp"
#include "core/error.hpp"
#include "core/tensor_table.hpp"
#include "train/optimizer.hpp"

#include "train_units_util.hpp"

namespace kmoe {
namespace {

using namespace unit;

constexpr double kPi = 3.14159265358979323846;

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
// 4. A tensor kept in host memory (engram.offload = host): the same norm and the same updates,
// bit for bit, as the same tensor in device memory; the others are untouched by the move.

TEST(HostResidentTensor, SameNormAndUpdatesAsOnTheDevice) {
  // Bit for bit where the device is the host's own threads, one per team (a CPU build without
  // device paths); elsewhere the device's team reductions, fused multiply-adds and math
  // library differ in the last bits (MODEL.md section 4): within 1e-6 then.
  const bool exact = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible && !device_paths();
  auto same = [exact](const float* a, const float* b, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i)
      if (exact ? a[i] != b[i] : std::fabs(a[i] - b[i]) > 1e-6f * (1.0f + std::fabs(b[i])))
        return false;
    return true;
  };
  // b: more than one chunk of a parallel backend (FlatOptimizer::kChunk), with its own lr.
  auto make = [](bool host) {
    auto t = std::make_unique<TensorTable>();
    t->add(spec("a", {13, 7}, InitKind::Normal, 0.02, true));
    TensorSpec b = spec("b", {300, 257}, InitKind::Normal, 0.05, false, 5.0);
    t->add(host ? b.in_host_memory() : b);
    t->add(spec("c", {101}, InitKind::Ones, 0.0, false));
    t->allocate();
    t->initialize(11);
    return t;
  };
  auto dev = make(false), host = make(true);
  ASSERT_EQ(host->host_elements(), 300 * 257);
  ASSERT_EQ(host->total_elements() + host->host_elements(), dev->total_elements());
  EXPECT_THROW(host->param(1), Error);  // not readable as device values
  const std::vector<float> b0 = to_host(dev->params);
  ASSERT_TRUE(same(host->host_param(1), b0.data() + dev->entry(1).offset, 300 * 257))
      << "the same initial values";
  OptimizerCfg o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  const FlatOptimizer od(*dev), oh(*host);
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g(dev->total_elements());
    for (auto& x : g) x = nd(gen);
    from_host(g, dev->grads);
    // The host table's gradients: b's part; a and c stay in the device buffer.
    const std::int64_t b_at = dev->entry(1).offset, nb = dev->entry(1).size;
    std::vector<float> rest(g.begin(), g.begin() + b_at);
    rest.insert(rest.end(), g.begin() + b_at + nb, g.end());
    from_host(rest, host->grads);
    std::copy_n(g.begin() + b_at, nb, host->host_grad(1));
    const double nd_sq = od.grad_sq_sum(*dev), nh_sq = oh.grad_sq_sum(*host);
    if (exact)
      EXPECT_EQ(nd_sq, nh_sq) << "step " << step;
    else
      EXPECT_NEAR(nd_sq, nh_sq, 1e-9 * nd_sq) << "step " << step;
    od.adamw_step(o, *dev, step, o.lr, 0.5);
    oh.adamw_step(o, *host, step, o.lr, 0.5);
    Kokkos::fence();
    const std::vector<float> pd = to_host(dev->params), ph = to_host(host->params);
    const std::vector<float> md = to_host(dev->exp_avg_sq);
    EXPECT_TRUE(same(ph.data(), pd.data(), b_at)) << "a, step " << step;
    EXPECT_TRUE(same(ph.data() + b_at, pd.data() + b_at + nb, pd.size() - b_at - nb)) << "c";
    EXPECT_TRUE(same(host->host_param(1), pd.data() + b_at, nb)) << "b, step " << step;
    EXPECT_TRUE(same(host->host_v(1), md.data() + b_at, nb)) << "b's 2nd moment, step " << step;
  }
}

}  // namespace
}  // namespace kmoe
