// RMSNorm, SwiGLU MLP, embedding, LM head + loss and KeyBuckets: forwards against naive
// double-precision references written from MODEL.md sections 1-2, backwards against central
// finite differences. Attention and RoPE are in test_ops_attention.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/bucket_sort.hpp"
#include "modules/embedding/embedding.hpp"
#include "modules/loss/lm_head.hpp"
#include "modules/mlp/swiglu.hpp"
#include "modules/norm/rmsnorm.hpp"
#include "op_test_util.hpp"

namespace kmoe {
namespace {

using namespace op_test;

View1I device_ints(const std::vector<int>& h) {
  View1I v("op_test::ints", h.size());
  auto m = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < h.size(); ++i) m(i) = h[i];
  Kokkos::deep_copy(v, m);
  return v;
}

std::vector<int> host_ints(const View1I& v, int n) {
  auto m = Kokkos::create_mirror_view_and_copy(HostSpace(), v);
  return std::vector<int>(m.data(), m.data() + n);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

constexpr int kRows = 5, kWidth = 12;
constexpr float kNormEps = 1e-6f;

TEST(RmsNorm, ForwardWithAndWithoutResidual) {
  std::mt19937 gen(1);
  auto x = uniform(gen, kRows * kWidth, -1.0f, 1.0f);
  for (int c = 0; c < kWidth; ++c) x[kWidth + c] *= 1e-3f;  // mean(x^2) ~ eps: eps must count
  const auto g = uniform(gen, kWidth, 0.7f, 1.3f);
  const auto res = uniform(gen, kRows * kWidth, -1.0f, 1.0f);
  View1F x_dev = device_copy(x), g_dev = device_copy(g), res_dev = device_copy(res);
  View1F y_dev("y", kRows * kWidth), rstd_dev("rstd", kRows);

  const HostMat y_ref = rmsnorm_ref(HostMat(x.data(), kRows, kWidth),
                                    std::vector<double>(g.begin(), g.end()), kNormEps);
  std::vector<double> rstd_ref(kRows);
  for (int r = 0; r < kRows; ++r) {
    double ss = 0.0;
    for (int c = 0; c < kWidth; ++c) ss += double(x[r * kWidth + c]) * x[r * kWidth + c];
    rstd_ref[r] = 1.0 / std::sqrt(ss / kWidth + kNormEps);
  }
  for (bool with_residual : {false, true}) {
    ConstMat residual = with_residual ? as_cmat(res_dev.data(), kRows, kWidth) : ConstMat();
    rmsnorm_forward(as_cmat(x_dev.data(), kRows, kWidth), ConstVec(g_dev.data(), kWidth), kNormEps,
                    residual, as_mat(y_dev.data(), kRows, kWidth), Vec(rstd_dev.data(), kRows));
    std::vector<double> want = y_ref.v;
    if (with_residual)
      for (std::size_t i = 0; i < want.size(); ++i) want[i] += res[i];
    const char* what = with_residual ? "y with residual" : "y";
    expect_close(want, to_host(y_dev.data(), kRows * kWidth), 1e-5, what);
    expect_close(rstd_ref, to_host(rstd_dev.data(), kRows), 1e-5, "rstd");
  }
}

// Objective sum(y * R) + sum(x * B): its dx is backward's with dy = R, dx_base = B.
TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  std::mt19937 gen(2);
  const int n = kRows * kWidth;
  auto x = uniform(gen, n, -1.0f, 1.0f);
  auto g = uniform(gen, kWidth, 0.7f, 1.3f);
  const auto R = uniform(gen, n, -1.0f, 1.0f), B = uniform(gen, n, -1.0f, 1.0f);
  const auto dg_before = uniform(gen, kWidth, -1.0f, 1.0f);
  View1F x_dev = device_copy(x), g_dev = device_copy(g), R_dev = device_copy(R);
  View1F B_dev = device_copy(B), y_dev("y", n), rstd_dev("rstd", kRows);
  View1F dx_dev = device_copy(std::vector<float>(n, 1e3f)), dg_dev = device_copy(dg_before);
  auto cmat = [](const View1F& v) { return as_cmat(v.data(), kRows, kWidth); };
  auto forward = [&] {
    rmsnorm_forward(cmat(x_dev), ConstVec(g_dev.data(), kWidth), kNormEps, ConstMat(),
                    as_mat(y_dev.data(), kRows, kWidth), Vec(rstd_dev.data(), kRows));
    return to_host(y_dev.data(), n);
  };
  auto backward = [&](ConstMat dx_base, const View1F& dx) {
    rmsnorm_backward(cmat(x_dev), ConstVec(g_dev.data(), kWidth), ConstVec(rstd_dev.data(), kRows),
                     cmat(R_dev), dx_base, as_mat(dx.data(), kRows, kWidth),
                     Vec(dg_dev.data(), kWidth));
  };
  auto upload_x = [&] { to_device(x, x_dev.data()); };
  auto upload_g = [&] { to_device(g, g_dev.data()); };
  auto loss = [&] { return dot(forward(), R); };
  auto loss_with_base = [&] { return dot(forward(), R) + dot(x, B); };

  forward();
  backward(ConstMat(), dx_dev);
  const auto dx = to_host(dx_dev.data(), n);
  auto dg = to_host(dg_dev.data(), kWidth);
  for (int c = 0; c < kWidth; ++c) dg[c] -= dg_before[c];  // dg accumulates onto dg_before
  expect_fd_gradient("dx", x.data(), dx.data(), n, upload_x, loss);
  expect_fd_gradient("dg", g.data(), dg.data(), kWidth, upload_g, loss);

  forward();
  View1F dx_base_dev = device_copy(std::vector<float>(n, 1e3f));
  backward(cmat(B_dev), dx_base_dev);
  const auto dx_base = to_host(dx_base_dev.data(), n);
  expect_fd_gradient("dx with dx_base", x.data(), dx_base.data(), n, upload_x, loss_with_base);

  // dx may alias dx_base: the same result, in place.
  forward();
  View1F inplace_dev = device_copy(B);
  backward(cmat(inplace_dev), inplace_dev);
  const auto inplace = to_host(inplace_dev.data(), n);
  for (int i = 0; i < n; ++i) ASSERT_EQ(inplace[i], dx_base[i]) << i;

  // Three backward calls so far: dg = dg_before + 3 dL/dg.
  std::vector<double> dg_want(kWidth);
  for (int c = 0; c < kWidth; ++c) dg_want[c] = dg_before[c] + 3.0 * dg[c];
  expect_close(dg_want, to_host(dg_dev.data(), kWidth), 1e-5, "dg after three backwards");
}

// ---------------------------------------------------------------------------------------------
// SwiGLU MLP

TEST(SwigluMlp, ForwardAndBackward) {
  const int D = 12, F = 20, N = 7, max_rows = 10;
  const std::string prefix = "blocks.0.mlp.";
  std::mt19937 gen(3);
  TensorTable table;
  ModelCfg m;
  m.d_model = D;
  m.init_std = 0.3;
  SwigluMlp mlp(RunContext(), prefix, m, F, max_rows, table);
  table.allocate();
  table.initialize(5);
  randomize_params(table, gen, 0.4f);
  Workspace scratch;

  auto x = uniform(gen, N * D, -1.0f, 1.0f);
  const auto R = uniform(gen, N * D, -1.0f, 1.0f);
  View1F x_dev = device_copy(x), y_dev("y", N * D), R_dev = device_copy(R);
  View1F dx_dev = device_copy(std::vector<float>(N * D, 1e3f));
  auto forward = [&] {
    mlp.forward(table, as_cmat(x_dev.data(), N, D), as_mat(y_dev.data(), N, D), scratch);
    return to_host(y_dev.data(), N * D);
  };

  // y = (silu(x W1^T) * (x W3^T)) W2^T
  const auto params = to_host(table.params.data(), table.total_elements());
  const HostMat hx(x.data(), N, D);
  const HostMat up1 = linear(hx, param_mat(table, params, prefix + "w1"));
  const HostMat up3 = linear(hx, param_mat(table, params, prefix + "w3"));
  HostMat act(N, F);
  for (int r = 0; r < N; ++r)
    for (int f = 0; f < F; ++f) act(r, f) = up1(r, f) / (1.0 + std::exp(-up1(r, f))) * up3(r, f);
  expect_close(linear(act, param_mat(table, params, prefix + "w2")).v, forward(), 1e-5, "mlp y");

  const auto grads = accumulated_grads(table, gen, [&] {
    mlp.backward(table, as_cmat(x_dev.data(), N, D), as_cmat(R_dev.data(), N, D),
                 as_mat(dx_dev.data(), N, D), scratch);
  });
  const auto dx = to_host(dx_dev.data(), N * D);
  auto objective = [&] { return dot(forward(), R); };
  expect_fd_gradient(
      "dx", x.data(), dx.data(), N * D, [&] { to_device(x, x_dev.data()); }, objective);
  for (const char* w : {"w1", "w3", "w2"})
    expect_fd_param_gradient(table, prefix + w, grads, objective);
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(Embedding, GatherAndScatterAdd) {
  const int V = 11, D = 6;
  // Token 3 eight times, 5 twice, 0, 7 and 10 never.
  const std::vector<int> tokens = {3, 5, 3, 1, 3, 3, 9, 5, 3, 2, 3, 3, 8, 3, 4, 6};
  const int N = tokens.size();
  std::mt19937 gen(4);
  TensorTable table;
  Embedding embed(V, D, 0.3, N + 4, table);
  table.allocate();
  table.initialize(6);
  randomize_params(table, gen, 0.5f);
  View1I tok_dev = device_ints(tokens);
  ConstIVec tok(tok_dev.data(), N);
  View1F x_dev("x", N * D);
  auto forward = [&] {
    embed.forward(table, tok, as_mat(x_dev.data(), N, D));
    return to_host(x_dev.data(), N * D);
  };

  const auto w = to_host(table.params.data(), table.total_elements());
  const auto x = forward();
  for (int r = 0; r < N; ++r)
    for (int d = 0; d < D; ++d) ASSERT_EQ(x[r * D + d], w[tokens[r] * D + d]) << r << "," << d;

  const auto R = uniform(gen, N * D, -1.0f, 1.0f);
  View1F R_dev = device_copy(R);
  const auto before = uniform(gen, V * D, -1.0f, 1.0f);
  to_device(before, table.grads.data());
  for (int pass = 1; pass <= 2; ++pass) {  // the second pass accumulates onto the first
    embed.backward(table, tok, as_cmat(R_dev.data(), N, D));
    const auto dw = to_host(table.grads.data(), V * D);
    std::vector<double> want(before.begin(), before.end());
    for (int r = 0; r < N; ++r)
      for (int d = 0; d < D; ++d) want[tokens[r] * D + d] += pass * double(R[r * D + d]);
    expect_close(want, dw, 1e-6, "embed grad after pass " + std::to_string(pass));
    for (int v : {0, 7, 10})
      for (int d = 0; d < D; ++d) EXPECT_EQ(dw[v * D + d], before[v * D + d]) << "absent " << v;
  }

  const auto grads = accumulated_grads(
      table, gen, [&] { embed.backward(table, tok, as_cmat(R_dev.data(), N, D)); });
  expect_fd_param_gradient(table, "embed.weight", grads, [&] { return dot(forward(), R); });
}

// ---------------------------------------------------------------------------------------------
// LM head and loss

struct LossRef {
  std::vector<double> seq_ce;
  double ce = 0.0, z = 0.0;
};

// MODEL.md section 2 in double: logits = RMSNorm_final(x) W^T; position t of each sequence
// predicts token t+1, the last position has no target.
LossRef loss_ref(const HostMat& logits, const std::vector<int>& tokens, int T) {
  LossRef out;
  out.seq_ce.assign(logits.rows / T, 0.0);
  for (int r = 0; r < logits.rows; ++r) {
    if (r % T == T - 1) continue;
    double mx = -1e300, sum = 0.0;
    for (int j = 0; j < logits.cols; ++j) mx = std::max(mx, logits(r, j));
    for (int j = 0; j < logits.cols; ++j) sum += std::exp(logits(r, j) - mx);
    const double lse = mx + std::log(sum);
    out.seq_ce[r / T] += lse - logits(r, tokens[r + 1]);
    out.z += lse * lse;
  }
  for (double c : out.seq_ce) out.ce += c;
  return out;
}

// chunk: the head's rows per chunk (0: its default, one chunk at these sizes).
void check_lm_head(bool tie, int chunk = 0) {
  ModelCfg m;
  m.vocab_size = 13;
  m.d_model = 12;
  m.tie_embeddings = tie;
  m.output_z_coef = 0.1;
  m.init_std = 0.3;
  const int V = m.vocab_size, D = m.d_model, T = 5, nseq = 3, N = nseq * T;
  std::mt19937 gen(tie ? 7 : 8);
  TensorTable table;
  Embedding embed(V, D, m.init_std, N + 5, table);
  LmHead head(RunContext(), m, N + 5, embed.weight_index(), table, chunk);
  Workspace ws;
  table.allocate();
  table.initialize(9);
  randomize_params(table, gen, 0.5f);
  const std::string weight = tie ? "embed.weight" : "lm_head.weight";
  ASSERT_EQ(table.find("lm_head.weight") >= 0, !tie);

  std::vector<int> tokens(N);
  std::uniform_int_distribution<int> tok(0, V - 1);
  for (auto& t : tokens) t = tok(gen);
  View1I tok_dev = device_ints(tokens);
  auto x = uniform(gen, N * D, -1.0f, 1.0f);
  View1F x_dev = device_copy(x);
  View1F dx_dev = device_copy(std::vector<float>(N * D, 1e3f));
  const int targets = nseq * (T - 1);
  auto forward = [&](float grad_scale) {
    return head.forward(table, as_cmat(x_dev.data(), N, D), ConstIVec(tok_dev.data(), N), T,
                        grad_scale, ws);
  };

  const auto params = to_host(table.params.data(), table.total_elements());
  const HostMat normed = rmsnorm_ref(HostMat(x.data(), N, D),
                                     param_mat(table, params, "final_norm.weight").v, m.norm_eps);
  const LossRef want = loss_ref(linear(normed, param_mat(table, params, weight)), tokens, T);
  // Gradients of (CE + zc * Z) / targets: the head matrix's accumulate in the forward that
  // asks for them.
  LossSums got;
  const auto grads = accumulated_grads(table, gen, [&] {
    got = forward(1.0f / targets);
    head.backward(table, as_cmat(x_dev.data(), N, D), as_mat(dx_dev.data(), N, D));
  });
  EXPECT_EQ(got.targets, targets);
  EXPECT_NEAR(got.ce, want.ce, 1e-5 * want.ce);
  EXPECT_NEAR(got.z, want.z, 1e-5 * want.z);
  ASSERT_EQ(got.seq_ce.size(), want.seq_ce.size());
  for (int s = 0; s < nseq; ++s) EXPECT_NEAR(got.seq_ce[s], want.seq_ce[s], 1e-5 * want.ce) << s;

  const auto dx = to_host(dx_dev.data(), N * D);
  for (int s = 0; s < nseq; ++s)  // the last position has no target: no gradient
    for (int d = 0; d < D; ++d) EXPECT_EQ(dx[((s + 1) * T - 1) * D + d], 0.0f);
  if (!tie) {
    const auto& e = table.entry(table.find("embed.weight"));
    for (std::int64_t i = e.offset; i < e.offset + e.size; ++i) ASSERT_EQ(grads[i], 0.0f);
  }
  auto objective = [&] {
    const LossSums s = forward(0.0f);
    return (s.ce + m.output_z_coef * s.z) / s.targets;
  };
  expect_fd_gradient(
      "dx", x.data(), dx.data(), N * D, [&] { to_device(x, x_dev.data()); }, objective);
  expect_fd_param_gradient(table, "final_norm.weight", grads, objective);
  expect_fd_param_gradient(table, weight, grads, objective);
}

TEST(LmHead, UntiedLossAndGradients) { check_lm_head(false); }
TEST(LmHead, TiedLossAndGradients) { check_lm_head(true); }
// Chunks of 4 rows over 15 (the last one short; chunk edges inside sequences of 5).
TEST(LmHead, ChunkedLossAndGradients) {
  check_lm_head(false, 4);
  check_lm_head(true, 4);
}

// ---------------------------------------------------------------------------------------------
// KeyBuckets

// Items of key k are order[offsets[k] .. offsets[k+1]), increasing.
void expect_buckets(KeyBuckets& buckets, const std::vector<int>& keys, int num_keys) {
  const int n = keys.size();
  View1I keys_dev = device_ints(keys);
  buckets.build(ConstIVec(keys_dev.data(), n));
  std::vector<int> want_order(n), want_offsets(num_keys + 1, 0);
  for (int i = 0; i < n; ++i) want_order[i] = i;
  std::stable_sort(want_order.begin(), want_order.end(),
                   [&](int a, int b) { return keys[a] < keys[b]; });
  for (int key : keys) ++want_offsets[key + 1];
  for (int k = 0; k < num_keys; ++k) want_offsets[k + 1] += want_offsets[k];
  EXPECT_EQ(host_ints(buckets.offsets, num_keys + 1), want_offsets);
  EXPECT_EQ(host_ints(buckets.order, n), want_order);
}

TEST(KeyBuckets, GroupsInIncreasingItemOrder) {
  const int num_keys = 7;
  KeyBuckets buckets(16, num_keys);
  // Keys 2, 3 and 5 empty; key 4 crowded.
  expect_buckets(buckets, {4, 1, 4, 0, 6, 4, 1, 4, 0, 4, 6, 4, 4, 1, 4, 0}, num_keys);
  // Rebuilt on fewer items, all on one key.
  expect_buckets(buckets, std::vector<int>(11, 2), num_keys);
  expect_buckets(buckets, {}, num_keys);
}

// Several blocks and radix passes: 1 pass (<= 256 keys), 2, 3; skewed and uniform keys.
TEST(KeyBuckets, ManyBlocksAndPasses) {
  std::mt19937 rng(7);
  for (int num_keys : {1, 2, 200, 256, 257, 5000, 70000}) {
    for (int n : {1, 255, 256, 257, 3000}) {
      KeyBuckets buckets(n, num_keys);
      std::vector<int> uniform(n), skewed(n);
      std::uniform_int_distribution<int> any(0, num_keys - 1), few(0, std::min(num_keys, 3) - 1);
      for (int i = 0; i < n; ++i) {
        uniform[i] = any(rng);
        skewed[i] = i % 5 == 0 ? any(rng) : num_keys - 1 - few(rng);
      }
      SCOPED_TRACE("num_keys " + std::to_string(num_keys) + ", n " + std::to_string(n));
      expect_buckets(buckets, uniform, num_keys);
      expect_buckets(buckets, skewed, num_keys);
    }
  }
}

}  // namespace
}  // namespace kmoe
