// Attention and RoPE against naive double-precision references written from MODEL.md section 1,
// and the attention backward against central finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "modules/attention/attention.hpp"
#include "modules/attention/rope.hpp"
#include "op_test_util.hpp"

namespace kmoe {
namespace {

using namespace op_test;

const char* const kPrefix = "blocks.0.attn.";

// MODEL.md section 1 attention for nseq = a.rows / T sequences of T tokens, in double:
// projections, QK-norm over the whole q and k widths, NeoX RoPE with positions restarting at 0
// in every sequence, causal softmax scaled by 1/sqrt(dh), query head h reading kv head
// h / (H/Hkv), output projection.
HostMat attention_ref(const ModelCfg& m, int T, const HostMat& a, const TensorTable& table,
                      const std::vector<float>& params) {
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
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / Hkv);
      std::vector<double> score(t + 1);
      double mx = -1e300, sum = 0.0;
      for (int j = 0; j <= t; ++j) {
        double s = 0.0;
        for (int d = 0; d < dh; ++d) s += q(r, h * dh + d) * k(first + j, g * dh + d);
        score[j] = s / std::sqrt(static_cast<double>(dh));
        mx = std::max(mx, score[j]);
      }
      for (int j = 0; j <= t; ++j) sum += std::exp(score[j] - mx);
      for (int j = 0; j <= t; ++j)
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
  Attention attn(m, kPrefix, max_seqs, T, table);
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

// The tables hold cos/sin of p * theta^(-2i/dh) computed in double, rounded to float once.
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
