#include "modules/loss/lm_head.hpp"

#include "core/device_sync.hpp"
#include "core/gemm.hpp"
#include "modules/norm/rmsnorm.hpp"

namespace kmoe {

LmHead::LmHead(const RunContext& ctx, const ModelCfg& m, int max_tokens, int embed_weight,
               TensorTable& table)
    : ctx_(ctx.unpooled()),
      V_(m.vocab_size),
      D_(m.d_model),
      eps_(static_cast<float>(m.norm_eps)),
      z_coef_(static_cast<float>(m.output_z_coef)) {
  norm_ = table.add(TensorSpec::gain("final_norm.weight", D_));
  weight_ = m.tie_embeddings
                ? embed_weight
                : table.add(TensorSpec::matrix("lm_head.weight", {V_, D_}, m.matrix_std(D_))
                                .gemm_weight());
  normed_ = View1F("head::normed", std::int64_t(max_tokens) * D_);
  rstd_ = View1F("head::rstd", max_tokens);
  logits_ = View1F("head::logits", std::int64_t(max_tokens) * V_);
  row_ce_ = View1F("head::row_ce", max_tokens);
  row_z_ = View1F("head::row_z", max_tokens);
  seq_sums_ = View1D("head::seq_sums", 2 * max_tokens);
}

ConstMat LmHead::logits(const TensorTable& table, ConstMat x) {
  const int N = x.extent(0);
  Mat normed = as_mat(normed_.data(), N, D_);
  rmsnorm_forward(x, ConstVec(table.param(norm_), D_), eps_, ConstMat(), normed,
                  Vec(rstd_.data(), N));
  Mat logits = as_mat(logits_.data(), N, V_);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, as_cmat(normed), table.weight(weight_, V_, D_), 0.0f, logits);
  return as_cmat(logits);
}

LossSums LmHead::forward(const TensorTable& table, ConstMat x, ConstIVec tokens, int T,
                         float grad_scale, View1D accumulate) {
  const int N = x.extent(0), V = V_, nseq = N / T;
  Mat normed = as_mat(normed_.data(), N, D_);
  rmsnorm_forward(x, ConstVec(table.param(norm_), D_), eps_, ConstMat(), normed,
                  Vec(rstd_.data(), N));
  Mat logits = as_mat(logits_.data(), N, V);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, as_cmat(normed), table.weight(weight_, V, D_), 0.0f,
       logits);

  // Per row with a target: lse, CE = lse - logit[target], z = lse^2; gradient in place:
  // scale * (softmax * (1 + 2 zc lse) - onehot(target)); rows without a target get 0.
  const float zc = z_coef_;
  const bool want_grad = grad_scale > 0.0f;
  auto row_ce = row_ce_, row_z = row_z_;
  Kokkos::parallel_for(
      "head::softmax_xent", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        const bool has_target = (r % T) != T - 1;
        float mx = -3.0e38f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, V),
            [&](int j, float& m) { m = math::fmax(m, logits(r, j)); }, Kokkos::Max<float>(mx));
        float sum = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, V),
            [&](int j, float& acc) { acc += math::exp(logits(r, j) - mx); }, sum);
        const float lse = mx + math::log(sum);
        const int target = has_target ? tokens(r + 1) : -1;
        Kokkos::single(Kokkos::PerTeam(team), [&]() {
          row_ce(r) = has_target ? lse - logits(r, target) : 0.0f;
          row_z(r) = has_target ? lse * lse : 0.0f;
        });
        team.team_barrier();
        if (want_grad) {
          const float zf = 1.0f + 2.0f * zc * lse;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, V), [&](int j) {
            const float p = math::exp(logits(r, j) - lse);
            logits(r, j) = has_target ? grad_scale * (p * zf - (j == target ? 1.0f : 0.0f)) : 0.0f;
          });
        }
      });

  // Per-sequence sums in double, in one fixed order whatever the backend: chunks of kSumChunk
  // positions in order (one thread each), then each sequence's chunks in order. The chunk sums
  // follow the sequences' in seq_sums_.
  const int chunks = (T - 1 + kSumChunk - 1) / kSumChunk;
  const std::int64_t part = 2 * std::int64_t(nseq);
  KMOE_REQUIRE(part + 2 * std::int64_t(nseq) * chunks <= std::int64_t(seq_sums_.extent(0)),
               "head: " << nseq << " sequences of " << T << " positions beyond its sums buffer");
  auto seq_sums = seq_sums_;
  Kokkos::parallel_for(
      "head::chunk_sums", Range2({0, 0}, {nseq, chunks}), KOKKOS_LAMBDA(int s, int c) {
        const int t1 = (c + 1) * kSumChunk < T - 1 ? (c + 1) * kSumChunk : T - 1;
        double ce = 0.0, z = 0.0;
        for (int t = c * kSumChunk; t < t1; ++t) {
          ce += row_ce(s * T + t);
          z += row_z(s * T + t);
        }
        seq_sums(part + 2 * (std::int64_t(s) * chunks + c)) = ce;
        seq_sums(part + 2 * (std::int64_t(s) * chunks + c) + 1) = z;
      });
  Kokkos::parallel_for(
      "head::sequence_sums", Range(0, nseq), KOKKOS_LAMBDA(int s) {
        double ce = 0.0, z = 0.0;
        for (int c = 0; c < chunks; ++c) {
          ce += seq_sums(part + 2 * (std::int64_t(s) * chunks + c));
          z += seq_sums(part + 2 * (std::int64_t(s) * chunks + c) + 1);
        }
        seq_sums(2 * s) = ce;
        seq_sums(2 * s + 1) = z;
      });
  LossSums out;
  out.targets = std::int64_t(nseq) * (T - 1);
  if (accumulate.extent(0) > 0) {
    // The sums the host would form, in the same order, added where the step keeps them.
    Kokkos::parallel_for(
        "head::accumulate_sums", Range(0, 1), KOKKOS_LAMBDA(int) {
          double ce = 0.0, z = 0.0;
          for (int s = 0; s < nseq; ++s) {
            ce += seq_sums(2 * s);
            z += seq_sums(2 * s + 1);
          }
          accumulate(0) += ce;
          accumulate(1) += z;
        });
    return out;
  }
  auto h = read_to_host("loss sums", Kokkos::subview(seq_sums, Kokkos::make_pair(0, 2 * nseq)));
  out.seq_ce.resize(nseq);
  for (int s = 0; s < nseq; ++s) {
    out.seq_ce[s] = h(2 * s);
    out.ce += h(2 * s);
    out.z += h(2 * s + 1);
  }
  return out;
}

void LmHead::backward(TensorTable& table, ConstMat x, Mat dx, Workspace& ws) {
  const int N = x.extent(0);
  auto d_logits = as_cmat(logits_.data(), N, V_);
  auto normed = as_cmat(normed_.data(), N, D_);
  gemm(ctx_, Trans::T, Trans::N, 1.0f, d_logits, normed, 1.0f, as_mat(table.grad(weight_), V_, D_));
  Workspace::Frame frame(ws);
  Mat d_normed = frame.mat(N, D_);
  gemm(ctx_, Trans::N, Trans::N, 1.0f, d_logits, table.weight(weight_, V_, D_), 0.0f, d_normed);
  rmsnorm_backward(x, ConstVec(table.param(norm_), D_), ConstVec(rstd_.data(), N),
                   as_cmat(d_normed), ConstMat(), dx, Vec(table.grad(norm_), D_));
}

}  // namespace kmoe
