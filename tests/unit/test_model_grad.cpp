// Whole-model gradients against central finite differences of the loss, for both norm orders,
// GQA, tied and untied heads, with the output z-loss on.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "modules/model/stage.hpp"

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
  m.block_norm = norm;
  m.tie_embeddings = tie;
  m.output_z_coef = 0.1;
  m.init_std = 0.3;
  return m;
}

// Loss of MODEL.md section 2 for one micro-batch, in double from the stage's sums.
double loss_of(const LossSums& s, double zc) { return (s.ce + zc * s.z) / s.targets; }

void check_gradients(const ModelCfg& m) {
  const int T = 8, nseq = 2;
  TensorTable table;
  Stage stage(m, nseq, T, table);
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

  const int targets = nseq * (T - 1);
  stage.forward(table, tokens.data(), nseq, 1.0f / targets);
  stage.backward(table);
  auto hg = Kokkos::create_mirror_view_and_copy(HostSpace(), table.grads);

  const float eps = 1e-2f;
  for (const auto& e : table.entries()) {
    std::vector<double> fd, an;
    const int samples = std::min<std::int64_t>(e.size, 12);
    for (int k = 0; k < samples; ++k) {
      const std::int64_t j = e.offset + (k * 7919) % e.size;
      const float saved = hp(j);
      double lp, lm;
      hp(j) = saved + eps;
      Kokkos::deep_copy(table.params, hp);
      lp = loss_of(stage.forward(table, tokens.data(), nseq, 0.0f), m.output_z_coef);
      hp(j) = saved - eps;
      Kokkos::deep_copy(table.params, hp);
      lm = loss_of(stage.forward(table, tokens.data(), nseq, 0.0f), m.output_z_coef);
      hp(j) = saved;
      fd.push_back((lp - lm) / (2.0 * eps));
      an.push_back(hg(j));
    }
    Kokkos::deep_copy(table.params, hp);
    double num = 0, den = 0;
    for (std::size_t k = 0; k < fd.size(); ++k) {
      num += (fd[k] - an[k]) * (fd[k] - an[k]);
      den += fd[k] * fd[k];
    }
    EXPECT_LT(std::sqrt(num), 1e-2 * std::sqrt(den) + 1e-6)
        << e.spec.name << ": |fd - analytic| = " << std::sqrt(num) << ", |fd| = " << std::sqrt(den);
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

}  // namespace
}  // namespace kmoe
