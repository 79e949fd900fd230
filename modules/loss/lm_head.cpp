#include "modules/loss/lm_head.hpp"

#include <algorithm>

#include "core/buffers.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/gemm.hpp"
#include "modules/norm/rmsnorm.hpp"

namespace kmoe {

int LmHead::chunk_rows(std::int64_t max_tokens, int vocab) {
  const std::int64_t rows = std::max<std::int64_t>(64, kChunkElements / vocab / 64 * 64);
  return static_cast<int>(std::min(max_tokens, rows));
}

std::int64_t LmHead::workspace_bytes(const RunContext& ctx, const ModelCfg& m,
                                     std::int64_t max_tokens) {
  const std::int64_t C = chunk_rows(max_tokens, m.vocab_size), V = m.vocab_size, D = m.d_model;
  // The chunk's fp32 logits; its normed rows (fp32, or bf16 in bf16 runs) and bf16 d logits.
  return Workspace::rounded(4 * C * V) +
         (ctx.bf16() ? Workspace::rounded(2 * C * D) + Workspace::rounded(2 * C * V)
                     : Workspace::rounded(4 * C * D));
}

LmHead::LmHead(const RunContext& ctx, const ModelCfg& m, int max_tokens, int embed_weight,
               TensorTable& table, int chunk_rows_wanted)
    : ctx_(ctx.unpooled()),
      V_(m.vocab_size),
      D_(m.d_model),
      eps_(static_cast<float>(m.norm_eps)),
      z_coef_(static_cast<float>(m.output_z_coef)),
      chunk_(chunk_rows_wanted > 0 ? chunk_rows_wanted : chunk_rows(max_tokens, m.vocab_size)) {
  norm_ = table.add(TensorSpec::gain("final_norm.weight", D_));
  weight_ = m.tie_embeddings
                ? embed_weight
                : table.add(TensorSpec::matrix("lm_head.weight", {V_, D_}, m.matrix_std(D_))
                                .gemm_weight());
  d_normed_ = View1F("head::d_normed", std::int64_t(max_tokens) * D_);
  rstd_ = View1F("head::rstd", max_tokens);
  row_ce_ = View1F("head::row_ce", max_tokens);
  row_z_ = View1F("head::row_z", max_tokens);
  seq_sums_ = View1D("head::seq_sums", 2 * max_tokens);
}

ConstMat LmHead::logits(const TensorTable& table, ConstMat x) {
  const int N = x.extent(0);
  ensure_size(normed_, std::int64_t(N) * D_, "head::normed");
  ensure_size(logits_, std::int64_t(N) * V_, "head::logits");
  Mat normed = as_mat(normed_.data(), N, D_);
  rmsnorm_forward(x, ConstVec(table.param(norm_), D_), eps_, ConstMat(), normed,
                  Vec(rstd_.data(), N));
  Mat logits = as_mat(logits_.data(), N, V_);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, as_cmat(normed), table.weight(weight_, V_, D_), 0.0f, logits);
  return as_cmat(logits);
}

ConstMat LmHead::last_logits(int N) const {
  KMOE_REQUIRE(keep_logits_ && std::int64_t(logits_.extent(0)) >= std::int64_t(N) * V_,
               "LmHead::last_logits: no forward kept its logits (keep_logits())");
  return ConstMat(logits_.data(), N, V_);
}

LossSums LmHead::forward(const TensorTable& table, ConstMat x, ConstIVec tokens, int T,
                         float grad_scale, Workspace& ws, View1D accumulate) {
  const int N = x.extent(0), V = V_, D = D_, nseq = N / T;
  const bool want_grad = grad_scale > 0.0f, bf16 = ctx_.bf16();
  const bool keep = keep_logits_ && !want_grad;
  const int C = std::min(N, chunk_);
  if (keep) ensure_size(logits_, std::int64_t(N) * V, "head::logits");
  Workspace::Frame frame(ws);
  float* chunk_logits = keep ? nullptr : frame.floats(std::int64_t(C) * V);
  float* normed32 = bf16 ? nullptr : frame.floats(std::int64_t(C) * D);
  std::uint16_t* normed16 = bf16 ? frame.words(std::int64_t(C) * D) : nullptr;
  std::uint16_t* d16 = bf16 && want_grad ? frame.words(std::int64_t(C) * V) : nullptr;
  const Operand W = table.weight(weight_, V, D);
  const ConstVec gain(table.param(norm_), D);
  Mat dW = as_mat(table.grad(weight_), V, D);
  for (int r0 = 0; r0 < N; r0 += C) {
    const int n = std::min(C, N - r0);
    const std::int64_t at = std::int64_t(r0) * D;
    rmsnorm_forward(ConstMat(x.data() + at, n, D), gain, eps_, ConstMat(),
                    normed32 ? Mat(normed32, n, D) : Mat(), Vec(rstd_.data() + r0, n), normed16);
    const Operand xn =
        normed16 ? Operand{nullptr, normed16, n, D} : operand(ConstMat(normed32, n, D));
    const Mat logits(keep ? logits_.data() + std::int64_t(r0) * V : chunk_logits, n, V);
    gemm(ctx_, Trans::N, Trans::T, 1.0f, xn, W, 0.0f, logits);
    softmax_xent(logits, tokens, r0, T, grad_scale, KeptOut{d16 ? nullptr : logits.data(), d16});
    if (!want_grad) continue;
    const Operand d = d16 ? Operand{nullptr, d16, n, V} : operand(as_cmat(logits));
    gemm(ctx_, Trans::T, Trans::N, 1.0f, d, xn, 1.0f, dW);
    gemm(ctx_, Trans::N, Trans::N, 1.0f, d, W, 0.0f, Mat(d_normed_.data() + at, n, D));
  }

  // Per-sequence sums in double, in one fixed order whatever the backend: chunks of kSumChunk
  // positions in order (one thread each), then each sequence's chunks in order. The chunk sums
  // follow the sequences' in seq_sums_.
  const int chunks = (T - 1 + kSumChunk - 1) / kSumChunk;
  const std::int64_t part = 2 * std::int64_t(nseq);
  KMOE_REQUIRE(part + 2 * std::int64_t(nseq) * chunks <= std::int64_t(seq_sums_.extent(0)),
               "head: " << nseq << " sequences of " << T << " positions beyond its sums buffer");
  auto seq_sums = seq_sums_;
  auto row_ce = row_ce_, row_z = row_z_;
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
  // One team: a thread per sequence sums its chunks; with `accumulate`, then the sums the host
  // would form, in the same order, added where the step keeps them.
  const bool to_device = accumulate.extent(0) > 0;
  Kokkos::parallel_for(
      "head::sequence_sums", team_policy(1), KOKKOS_LAMBDA(const TeamMember& tm) {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nseq), [&](int s) {
          double ce = 0.0, z = 0.0;
          for (int c = 0; c < chunks; ++c) {
            ce += seq_sums(part + 2 * (std::int64_t(s) * chunks + c));
            z += seq_sums(part + 2 * (std::int64_t(s) * chunks + c) + 1);
          }
          seq_sums(2 * s) = ce;
          seq_sums(2 * s + 1) = z;
        });
        if (!to_device) return;
        tm.team_barrier();
        Kokkos::single(Kokkos::PerTeam(tm), [&]() {
          double ce = 0.0, z = 0.0;
          for (int s = 0; s < nseq; ++s) {
            ce += seq_sums(2 * s);
            z += seq_sums(2 * s + 1);
          }
          accumulate(0) += ce;
          accumulate(1) += z;
        });
      });
  LossSums out;
  out.targets = std::int64_t(nseq) * (T - 1);
  if (to_device) return out;
  auto h = read_to_host("loss sums", Kokkos::subview(seq_sums, Kokkos::make_pair(0, 2 * nseq)));
  out.seq_ce.resize(nseq);
  for (int s = 0; s < nseq; ++s) {
    out.seq_ce[s] = h(2 * s);
    out.ce += h(2 * s);
    out.z += h(2 * s + 1);
  }
  return out;
}

void LmHead::softmax_xent(Mat logits, ConstIVec tokens, int r0, int T, float grad_scale,
                          KeptOut grad) const {
  // Per row with a target: lse, CE = lse - logit[target], z = lse^2; the gradient through
  // `grad` (in place over the logits, or as bf16):
  // scale * (softmax * (1 + 2 zc lse) - onehot(target)); rows without a target get 0.
  const int n = logits.extent(0), V = V_;
  const float zc = z_coef_;
  const bool want_grad = grad_scale > 0.0f;
  auto row_ce = row_ce_, row_z = row_z_;
  Kokkos::parallel_for(
      "head::softmax_xent", row_policy(n), KOKKOS_LAMBDA(const TeamMember& team) {
        const int i = team.league_rank(), r = r0 + i;
        const bool has_target = (r % T) != T - 1;
        float mx = -3.0e38f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, V),
            [&](int j, float& m) { m = math::fmax(m, logits(i, j)); }, Kokkos::Max<float>(mx));
        float sum = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, V),
            [&](int j, float& acc) { acc += math::exp(logits(i, j) - mx); }, sum);
        const float lse = mx + math::log(sum);
        const int target = has_target ? tokens(r + 1) : -1;
        Kokkos::single(Kokkos::PerTeam(team), [&]() {
          row_ce(r) = has_target ? lse - logits(i, target) : 0.0f;
          row_z(r) = has_target ? lse * lse : 0.0f;
        });
        team.team_barrier();
        if (want_grad) {
          const float zf = 1.0f + 2.0f * zc * lse;
          const KeptOut row = grad.offset(std::int64_t(i) * V);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, V), [&](int j) {
            const float p = math::exp(logits(i, j) - lse);
            row.set(j, has_target ? grad_scale * (p * zf - (j == target ? 1.0f : 0.0f)) : 0.0f);
          });
        }
      });
}

void LmHead::backward(TensorTable& table, ConstMat x, Mat dx, std::uint16_t* dx16) {
  const int N = x.extent(0);
  rmsnorm_backward(x, ConstVec(table.param(norm_), D_), ConstVec(rstd_.data(), N),
                   as_cmat(d_normed_.data(), N, D_), ConstMat(), dx, Vec(table.grad(norm_), D_),
                   dx16);
}

}  // namespace kmoe
