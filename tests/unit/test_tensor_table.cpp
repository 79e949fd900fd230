// The TensorTable: layout, errors, bf16 compute copies, deterministic layout-independent
// initialization (MODEL.md section 7), the named tensor kinds, a tensor declared again.
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
#include "core/tensor_table.hpp"
#include "io/deck.hpp"
#include "modules/model/stage.hpp"
#include "train/optimizer.hpp"

#include "train_units_util.hpp"

namespace kmoe {
namespace {

using namespace unit;

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

// The same gradients (element j: 0.01 (j % period) - 0.02) in two tables of the same tensors,
// then `steps` AdamW steps of each at learning rate 0.1.
void same_adamw_steps(TensorTable& a, TensorTable& b, int period, int steps) {
  std::vector<float> g(a.total_elements());
  for (std::size_t j = 0; j < g.size(); ++j) g[j] = 0.01f * float(j % period) - 0.02f;
  from_host(g, a.grads);
  from_host(g, b.grads);
  OptimizerCfg o;
  o.lr = 0.1;
  for (int t = 1; t <= steps; ++t) {
    adamw_step(o, a, t, 0.1, 1.0);
    adamw_step(o, b, t, 0.1, 1.0);
  }
}

// bf16 runs: every gemm_only tensor is kept as a bf16 compute copy of every local row, with fp32
// values for its moment slice's rows: a split slice's rows only (optimizer.shard), every row of
// a whole one; other tensors keep their fp32 values whole. Initialization gives the master rows
// the values an ordinary table gets and the copy their bf16 rounding; AdamW updates the master
// rows exactly as the ordinary table's and writes them, rounded, into the copy, leaving the
// other replicas' rows alone.
TEST(TensorTable, Bf16ComputeCopiesKeepShardedMasterRows) {
  auto declare = [](TensorTable& t) {
    t.add(TensorSpec::matrix("a", {6, 4}, 0.5).gemm_weight());  // copied: split, gemm_only
    t.add(TensorSpec::gain("g", 4));                             // split, not gemm_only
    t.add(TensorSpec::matrix("b", {3, 4}, 0.5).gemm_weight());  // copied whole: not split
  };
  const std::vector<MomentSlice> slices = {{2, 3, 0, true}, {1, 2, 12, true}, {0, 3, 14, false}};
  TensorTable plain, copied;
  declare(plain);
  declare(copied);
  plain.allocate(&slices);
  copied.allocate(&slices, /*bf16_copies=*/true);
  EXPECT_TRUE(copied.has_copy(0));
  EXPECT_FALSE(copied.has_copy(1));
  EXPECT_TRUE(copied.has_copy(2));
  EXPECT_FALSE(plain.has_copy(0));
  EXPECT_EQ(copied.params.extent(0), std::size_t(3 * 4 + 4 + 12));  // a's slice rows, g, b
  EXPECT_EQ(copied.weights_b16.extent(0), std::size_t(24 + 12));
  EXPECT_EQ(copied.master_first(0), 2);
  EXPECT_EQ(copied.master_rows(0), 3);
  EXPECT_EQ(copied.master_first(2), 0);
  EXPECT_EQ(copied.master_rows(2), 3);
  EXPECT_EQ(copied.param_offset(1), 12);
  EXPECT_EQ(copied.param_offset(2), 16);
  EXPECT_THROW(copied.param(0), Error);
  EXPECT_THROW(copied.param(2), Error);
  EXPECT_EQ(copied.weight(0, 6, 4).f32, nullptr);
  EXPECT_EQ(copied.weight(0, 6, 4, 8).b16, copied.weights_b16.data() + 8);
  EXPECT_EQ(copied.weight(2, 3, 4).f32, nullptr);
  EXPECT_EQ(copied.weight(2, 3, 4).b16, copied.weights_b16.data() + 24);

  auto words = [](const TensorTable& t) {
    auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), t.weights_b16);
    return std::vector<std::uint16_t>(h.data(), h.data() + h.extent(0));
  };
  auto check = [&](const char* when) {
    const auto p = to_host(plain.params), c = to_host(copied.params);
    const auto w = words(copied);
    for (int j = 0; j < 24; ++j) EXPECT_EQ(w[j], bf16_bits(p[j])) << when << " copy of a " << j;
    for (int j = 0; j < 12; ++j)
      EXPECT_EQ(w[24 + j], bf16_bits(p[28 + j])) << when << " copy of b " << j;
    for (int j = 0; j < 12; ++j) EXPECT_EQ(c[j], p[8 + j]) << when << " master row of a " << j;
    for (int j = 12; j < 28; ++j) EXPECT_EQ(c[j], p[j + 12]) << when << " g and b " << j;
  };
  plain.initialize(7);
  copied.initialize(7);
  check("initialized");
  same_adamw_steps(plain, copied, 7, 2);
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

// bf16 without sharded state: every trainable gemm_only tensor copied, its fp32 values whole;
// buffers and other tensors keep fp32 values only; AdamW rounds the updated values into the
// copies.
TEST(TensorTable, Bf16ComputeCopiesWithoutShardingKeepEveryRow) {
  TensorTable plain, copied;
  for (TensorTable* t : {&plain, &copied}) {
    t->add(TensorSpec::matrix("w", {5, 4}, 0.5).gemm_weight());
    t->add(TensorSpec::gain("g", 4));
    t->add(TensorSpec::buffer("bias", {3}));
  }
  plain.allocate();
  copied.allocate(nullptr, /*bf16_copies=*/true);
  EXPECT_TRUE(copied.has_copy(0));
  EXPECT_FALSE(copied.has_copy(1));
  EXPECT_FALSE(copied.has_copy(2));
  EXPECT_EQ(copied.params.extent(0), plain.params.extent(0));
  EXPECT_EQ(copied.weights_b16.extent(0), std::size_t(20));
  EXPECT_EQ(copied.master_rows(0), 5);
  EXPECT_EQ(copied.weight(0, 5, 4).b16, copied.weights_b16.data());
  EXPECT_EQ(copied.weight(1, 1, 4).f32, copied.param(1));
  plain.initialize(3);
  copied.initialize(3);
  same_adamw_steps(plain, copied, 5, 1);
  const auto p = to_host(plain.params), c = to_host(copied.params);
  EXPECT_EQ(c, p) << "the fp32 values as an ordinary table's";
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), copied.weights_b16);
  for (int j = 0; j < 20; ++j) EXPECT_EQ(h(j), bf16_bits(p[j])) << "copy of w " << j;
  EXPECT_NE(h(0), bf16_bits(0.0f));
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

}  // namespace
}  // namespace kmoe
