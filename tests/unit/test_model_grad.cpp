// Whole-model gradients against central finite differences of the loss, for both norm orders,
// GQA, tied and untied heads, with the output z-loss on.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "modules/model/stage.hpp"
#include "op_test_util.hpp"

namespace kmoe {
namespace {

ModelCfg tiny_model(const std::string& norm, bool tie, int kv_heads) {
  ModelCfg m;
  m.vocab_size = 37;
  m.d_model = 16;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = kv_heads;
  m.ffn_hidden = 24;
  m.block_norm = choice_from<BlockNorm>(norm);
  m.tie_embeddings = tie;
  m.output_z_coef = 0.1;
  m.init_std = 0.3;
  return m;
}

// Loss of MODEL.md section 2 for one micro-batch, in double from the stage's sums.
double loss_of(const LossSums& s, double zc) { return (s.ce + zc * s.z) / s.targets + s.moe_aux; }

void check_gradients(const ModelCfg& m, const MoeCfg& e = MoeCfg(), float eps = 1e-2f,
                     const EngramCfg& g = EngramCfg()) {
  const int T = 8, nseq = 2;
  TensorTable table;
  Stage stage(RunContext(), m, e, nseq, T, table, g);
  table.allocate();
  table.initialize(7);
  // Perturb every parameter (norm weights too) so no gradient is trivially symmetric.
  auto hp = Kokkos::create_mirror_view_and_copy(HostSpace(), table.params);
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(-0.2f, 0.2f);
  for (std::size_t i = 0; i < hp.extent(0); ++i) hp(i) += u(gen);
  Kokkos::deep_copy(table.params, hp);

  std::vector<std::int32_t> tokens(nseq * T);
  std::uniform_int_distribution<int> tok(0, m.vocab_size - 1);
  for (auto& t : tokens) t = tok(gen);
  if (m.document_eod >= 0) {  // documents end inside both sequences, at different places
    tokens[2] = tokens[5] = m.document_eod;
    tokens[T + 4] = m.document_eod;
  }

  const int targets = nseq * (T - 1);
  stage.forward(table, tokens.data(), nseq, 1.0f / targets);
  stage.backward(table);
  auto hg = Kokkos::create_mirror_view_and_copy(HostSpace(), table.grads);

  const auto upload = [&] { Kokkos::deep_copy(table.params, hp); };
  const auto loss = [&] {
    return loss_of(stage.forward(table, tokens.data(), nseq, 0.0f), m.output_z_coef);
  };
  for (const auto& t : table.entries()) {
    std::vector<op_test::FdPoint> points;
    const int samples = std::min<std::int64_t>(t.size, 12);
    for (int k = 0; k < samples; ++k) {
      const std::int64_t j = t.offset + (k * 7919) % t.size;
      points.push_back({&hp(j), hg(j)});
    }
    op_test::expect_fd_gradient(t.spec.name, points, upload, loss, eps);
  }
}

TEST(ModelGradient, ReorderedNormGqa) { check_gradients(tiny_model("reordered", false, 2)); }
TEST(ModelGradient, PreNormGqa) { check_gradients(tiny_model("pre", false, 2)); }
TEST(ModelGradient, ReorderedTiedMha) { check_gradients(tiny_model("reordered", true, 4)); }
TEST(ModelGradient, PreNormNoQkNorm) {
  auto m = tiny_model("pre", true, 1);
  m.qk_norm = false;
  check_gradients(m);
}

// MoE blocks: router, experts, LB (through P) and z-loss with large coefficients so their
// gradients matter; block 0 stays dense.
MoeCfg tiny_moe(const char* score, bool normalize, double capacity, int shared) {
  MoeCfg e;
  e.experts = 4;
  e.top_k = 2;
  e.expert_hidden = 12;
  e.dense_layers = {0};
  e.score = choice_from<RouterScore>(score);
  e.normalize_topk = normalize;
  e.lb_coef = 0.3;
  e.z_coef = 0.05;
  e.capacity_factor = capacity;
  e.shared_experts = shared;
  e.shared_hidden = 10;
  return e;
}

TEST(ModelGradient, MoeSoftmaxRaw) {
  check_gradients(tiny_model("reordered", false, 2), tiny_moe("softmax", false, 0.0, 0), 3e-3f);
}
TEST(ModelGradient, MoeSigmoidNormalizedShared) {
  check_gradients(tiny_model("pre", false, 2), tiny_moe("sigmoid", true, 0.0, 1), 3e-3f);
}
TEST(ModelGradient, MoeCapacityDrops) {
  check_gradients(tiny_model("reordered", true, 4), tiny_moe("softmax", true, 0.5, 1), 3e-3f);
}

// Engram at `layers` with small tables (rows collide) and a convolution of `kernel` taps.
EngramCfg tiny_engram(std::vector<int> layers, int kernel) {
  EngramCfg g;
  g.layers = std::move(layers);
  g.max_ngram = 3;
  g.heads = 2;
  g.embed_per_ngram = 8;
  g.table_size = {7, 11};
  g.kernel = kernel;
  g.init_std = 0.3;
  return g;
}

// Engram at block 1 together with MoE at block 1: the residual injection before attention,
// the gate on the block input, and every Engram tensor.
TEST(ModelGradient, EngramAndMoe) {
  EngramCfg g = tiny_engram({1}, 2);
  auto m = tiny_model("reordered", false, 2);
  check_gradients(m, tiny_moe("softmax", false, 0.0, 0), 3e-3f, g);
  g.gate = EngramGate::SignedSqrt;
  check_gradients(tiny_model("pre", true, 4), MoeCfg(), 3e-3f, g);
}

// Document masking (train.document_mask) and sliding windows (block 0 windowed, block 1 full),
// with GQA in both norm orders; then with Engram, whose n-grams and convolution stop at
// document boundaries too.
ModelCfg masked(ModelCfg m, int window) {
  m.document_eod = 5;
  m.sliding_window = window;
  m.window_layers = {0};
  return m;
}
TEST(ModelGradient, DocumentMaskAndWindowGqa) {
  check_gradients(masked(tiny_model("reordered", false, 2), 3));
  check_gradients(masked(tiny_model("pre", true, 2), 0));
  check_gradients(masked(tiny_model("pre", false, 1), 2));
}
TEST(ModelGradient, DocumentMaskEngram) {
  check_gradients(masked(tiny_model("reordered", false, 2), 4), tiny_moe("softmax", false, 0.0, 0),
                  3e-3f, tiny_engram({0, 1}, 3));
}

}  // namespace
}  // namespace kmoe
