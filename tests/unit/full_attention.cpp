#include "full_attention.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/gemm.hpp"
#include "modules/attention/attention.hpp"
#include "modules/norm/rmsnorm.hpp"

namespace kmoe::oracle {

std::int64_t FullMatrixAttention::workspace_bytes(const ModelCfg& m, int max_seqs, int T, bool bf16) {
  const std::int64_t N = std::int64_t(max_seqs) * T, dh = m.head_dim();
  const std::int64_t qd = m.n_heads * dh, kd = m.n_kv_heads * dh;
  const std::int64_t probs = Workspace::rounded(4 * std::int64_t(max_seqs) * m.n_heads * T * T);
  const std::int64_t heads = Workspace::rounded(4 * N * qd);
  const std::int64_t forward = heads + (bf16 ? probs : 0);
  const std::int64_t backward = heads + probs + 2 * Workspace::rounded(4 * N * kd) +
                                Workspace::rounded(4 * N * (qd + 2 * kd));
  return std::max(forward, backward);
}

FullMatrixAttention::FullMatrixAttention(const RunContext& ctx, const ModelCfg& m,
                                         const std::string& prefix, int max_seqs, int seq_len,
                                         TensorTable& table, int window)
    : ctx_(ctx.unpooled()),
      D_(m.d_model),
      H_(m.n_heads),
      Hkv_(m.n_kv_heads),
      dh_(m.head_dim()),
      T_(seq_len),
      window_(window),
      qk_norm_(m.qk_norm),
      eps_(static_cast<float>(m.norm_eps)) {
  const std::int64_t qd = H_ * dh_, kd = Hkv_ * dh_;
  auto matrix = [&](const char* n, std::int64_t rows, std::int64_t cols, bool output) {
    return table.add(
        TensorSpec::matrix(prefix + n, {rows, cols}, m.matrix_std(cols, output)).gemm_weight());
  };
  wq_ = matrix("wq", qd, D_, false);
  matrix("wk", kd, D_, false);
  matrix("wv", kd, D_, false);
  wo_ = matrix("wo", D_, qd, true);
  if (qk_norm_) {
    q_norm_ = table.add(TensorSpec::gain(prefix + "q_norm.weight", qd));
    k_norm_ = table.add(TensorSpec::gain(prefix + "k_norm.weight", kd));
  }
  const std::int64_t N = static_cast<std::int64_t>(max_seqs) * T_;
  qkv_ = saved_floats(ctx, "attn::qkv", N * (qd + 2 * kd));
  rstd_q_ = saved_floats(ctx, "attn::rstd_q", N);
  rstd_k_ = saved_floats(ctx, "attn::rstd_k", N);
  q_ = KeptOperand(ctx, "attn::q", N * qd);
  k_ = KeptOperand(ctx, "attn::k", N * kd);
  v_ = KeptOperand(ctx, "attn::v", N * kd);
  probs_ = KeptOperand(ctx, "attn::probs", static_cast<std::int64_t>(max_seqs) * H_ * T_ * T_);
  merged_ = KeptOperand(ctx, "attn::merged", N * qd);
}

namespace {

// Element (r, c) of concatenated heads (N, H*dh) in the head layout (nseq, H, T, dh).
KOKKOS_INLINE_FUNCTION std::int64_t head_index(int r, int c, int T, int H, int dh) {
  return ((std::int64_t(r / T) * H + c / dh) * T + r % T) * dh + c % dh;
}

// Concatenated heads (N, H*dh) into the head layout.
void split_heads(ConstMat merged, float* heads, int T, int H, int dh) {
  Kokkos::parallel_for(
      "attn::split_heads", Range2({0, 0}, {int(merged.extent(0)), H * dh}),
      KOKKOS_LAMBDA(int r, int c) { heads[head_index(r, c, T, H, dh)] = merged(r, c); });
}

// The head layout into N rows of concatenated heads, kept for the output projection.
void merge_heads(const float* heads, KeptOut merged, int N, int T, int H, int dh) {
  const int qd = H * dh;
  Kokkos::parallel_for(
      "attn::merge_heads", Range2({0, 0}, {N, qd}), KOKKOS_LAMBDA(int r, int c) {
        merged.set(std::int64_t(r) * qd + c, heads[head_index(r, c, T, H, dh)]);
      });
}

// The first key position t reads: its document's start, and within the window.
KOKKOS_INLINE_FUNCTION int first_key(int t, int doc_start, int window) {
  const int w = window > 0 ? t - window + 1 : 0;
  return doc_start > w ? doc_start : w;
}

// One row of the masked softmax backward in place: g = P * (g - sum_j P g) * scale over keys
// [lo, t], 0 elsewhere, with P as kept (fp32 or bf16 pointer, row start applied).
template <class P>
KOKKOS_INLINE_FUNCTION void softmax_row_backward(const TeamMember& tm, int lo, int t, int T, P pr,
                                                 float* g, float scale) {
  float dot = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::TeamThreadRange(tm, lo, t + 1),
      [&](int j, float& s) { s += kept_load(pr, j) * g[j]; }, dot);
  tm.team_barrier();  // every read of g before the first write
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, T), [&](int j) {
    g[j] = j >= lo && j <= t ? kept_load(pr, j) * (g[j] - dot) * scale : 0.0f;
  });
}

}  // namespace

void FullMatrixAttention::forward(const TensorTable& table, const RopeTables& rope, ConstMat a, Mat out,
                        Workspace& ws, DocStarts docs) {
  Workspace::Frame frame(ws);
  docs_ = docs;
  const int N = a.extent(0), T = T_, nseq = N / T, H = H_, Hkv = Hkv_, dh = dh_, half = dh / 2;
  const int qd = H * dh, kd = Hkv * dh, W = qd + 2 * kd, G = H / Hkv;
  const float eps = eps_;
  const bool qk_norm = qk_norm_;

  Mat qkv = as_mat(qkv_.data(), N, W);  // (N, H*dh | Hkv*dh | Hkv*dh)
  gemm(ctx_, Trans::N, Trans::T, 1.0f, a, table.weight(wq_, W, D_), 0.0f, qkv);

  // QK-norm over the whole projected q and k, RoPE, and the split into head layout.
  const KeptOut q = q_.out(), k = k_.out(), v = v_.out();
  auto rq = rstd_q_, rk = rstd_k_;
  // The oracle's own QK-norm and RoPE (MODEL.md section 1), not the library's NormRope: RMSNorm
  // over the whole projected q and over k, then each head's pair (i, i + dh/2) rotated by the
  // angle of position t.
  const float* gq = qk_norm ? table.param(q_norm_) : nullptr;
  const float* gk = qk_norm ? table.param(k_norm_) : nullptr;
  auto cs = rope.cos, sn = rope.sin;
  Kokkos::parallel_for(
      "oracle::norm_rope_split", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank(), s = r / T, t = r % T;
        float sq = 1.0f, sk = 1.0f;
        if (qk_norm) {
          float ssq = 0.0f, ssk = 0.0f;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, qd),
              [&](int c, float& acc) { acc += qkv(r, c) * qkv(r, c); }, ssq);
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, kd),
              [&](int c, float& acc) { acc += qkv(r, qd + c) * qkv(r, qd + c); }, ssk);
          sq = 1.0f / math::sqrt(ssq / qd + eps);
          sk = 1.0f / math::sqrt(ssk / kd + eps);
        }
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (H + Hkv) * half), [&](int j) {
          const bool is_q = j < H * half;
          const int h = (is_q ? j : j - H * half) / half, i = (is_q ? j : j - H * half) % half;
          const int w = h * dh + i, c = (is_q ? 0 : qd) + w;
          const float* g = is_q ? gq : gk;
          const float inv = is_q ? sq : sk;
          const float x0 = qkv(r, c) * inv * (g ? g[w] : 1.0f);
          const float x1 = qkv(r, c + half) * inv * (g ? g[w + half] : 1.0f);
          const float co = cs(t, i), si = sn(t, i);
          const std::int64_t base = ((std::int64_t(s) * (is_q ? H : Hkv) + h) * T + t) * dh;
          const KeptOut& dst = is_q ? q : k;
          dst.set(base + i, x0 * co - x1 * si);
          dst.set(base + i + half, x1 * co + x0 * si);
        });
        if (qk_norm) {
          Kokkos::single(Kokkos::PerTeam(team), [&]() {
            rq(r) = sq;
            rk(r) = sk;
          });
        }
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, kd), [&](int c) {
          v.set(((std::int64_t(s) * Hkv + c / dh) * T + t) * dh + c % dh, qkv(r, qd + kd + c));
        });
      });

  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const std::int64_t TT = std::int64_t(T) * T, Tdh = std::int64_t(T) * dh;
  // The G query heads of a kv head are adjacent in the head layout (nseq, H, T, dh), so each
  // (sequence, kv head) is one (G*T, dh) matrix against the kv head's (T, dh): a strided batch.
  const int groups = nseq * Hkv;
  // Per (sequence, kv head), strided: scores (G*T, T) = q k^T / sqrt(dh), into the kept
  // probabilities (fp32 runs: the softmax works in place) or a workspace buffer (bf16 runs: the
  // softmax rounds the probabilities into the kept bf16 buffer).
  float* scores =
      probs_.product_target(probs_.is_bf16() ? frame.floats(std::int64_t(nseq) * H * TT) : nullptr);
  gemm_strided_batched(ctx_, Trans::N, Trans::T, scale, q_.strided(G * T, dh, G * Tdh),
                       k_.strided(T, dh, Tdh), 0.0f, scores, G * T, T, G * TT, groups);

  // Masked softmax over keys [lo, t] (causal, document, window), one team per row, its
  // threads over the keys (on CPUs a one-thread team: the exp loop is branch-free, exp_poly, and
  // vectorizes; the max and the sum run in column order).
  auto sc = as_mat(scores, nseq * H * T, T);
  const KeptOut p = probs_.out();
  const int window = window_;
  Kokkos::parallel_for(
      "attn::causal_softmax", row_policy(nseq * H * T), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank(), t = r % T;
        const int lo = first_key(t, docs(r / (H * T) * T + t), window);
        float* row = &sc(r, 0);
        float mx = 0.0f, sum = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, lo, t + 1),
            [&](int j, float& m) { m = row[j] > m ? row[j] : m; }, Kokkos::Max<float>(mx));
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, lo, t + 1),
                             [&](int j) { row[j] = math::exp_poly(row[j] - mx); });
        tm.team_barrier();
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, lo, t + 1), [&](int j, float& s) { s += row[j]; }, sum);
        const float inv = 1.0f / sum;
        const std::int64_t base = std::int64_t(r) * T;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, T), [&](int j) {
          p.set(base + j, j >= lo && j <= t ? row[j] * inv : 0.0f);
        });
      });

  float* heads = frame.floats(std::int64_t(N) * qd);  // (nseq, H, T, dh) head outputs
  gemm_strided_batched(ctx_, Trans::N, Trans::N, 1.0f, probs_.strided(G * T, T, G * TT),
                       v_.strided(T, dh, Tdh), 0.0f, heads, G * T, dh, G * Tdh, groups);
  merge_heads(heads, merged_.out(), N, T, H, dh);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, merged_.matrix(N, qd), table.weight(wo_, D_, qd), 0.0f, out);
}

void FullMatrixAttention::backward(TensorTable& table, const RopeTables& rope, ConstMat a, ConstMat dout,
                         Mat da, Workspace& ws) {
  const int N = a.extent(0), T = T_, nseq = N / T, H = H_, Hkv = Hkv_, dh = dh_, half = dh / 2;
  const int qd = H * dh, kd = Hkv * dh, W = qd + 2 * kd, G = H / Hkv;
  const bool qk_norm = qk_norm_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const std::int64_t TT = std::int64_t(T) * T, Tdh = std::int64_t(T) * dh;
  // The G query heads of a kv head are adjacent in the head layout (nseq, H, T, dh), so each
  // (sequence, kv head) is one (G*T, dh) matrix against the kv head's (T, dh): a strided batch.
  const int groups = nseq * Hkv;
  Workspace::Frame frame(ws);
  float* d_heads = frame.floats(std::int64_t(N) * qd);  // (nseq, H, T, dh): dO, then dQ
  float* d_probs = frame.floats(std::int64_t(nseq) * H * TT);
  float* d_k = frame.floats(std::int64_t(N) * kd);  // (nseq, Hkv, T, dh)
  float* d_v = frame.floats(std::int64_t(N) * kd);

  // Output projection: dWo += dout^T merged; d_merged = dout Wo, split into heads.
  gemm(ctx_, Trans::T, Trans::N, 1.0f, dout, merged_.matrix(N, qd), 1.0f,
       as_mat(table.grad(wo_), D_, qd));
  {
    Workspace::Frame merged(ws);  // d_merged's memory becomes d_qkv's below
    Mat d_merged = merged.mat(N, qd);
    gemm(ctx_, Trans::N, Trans::N, 1.0f, dout, table.weight(wo_, D_, qd), 0.0f, d_merged);
    split_heads(as_cmat(d_merged), d_heads, T, H, dh);
  }

  // dP = dO v^T; dv = P^T dO (summed over the group's heads by the GEMM itself).
  gemm_strided_batched(ctx_, Trans::N, Trans::T, 1.0f, {d_heads, G * T, dh, G * Tdh},
                       v_.strided(T, dh, Tdh), 0.0f, d_probs, G * T, T, G * TT, groups);
  gemm_strided_batched(ctx_, Trans::T, Trans::N, 1.0f, probs_.strided(G * T, T, G * TT),
                       {d_heads, G * T, dh, G * Tdh}, 0.0f, d_v, T, dh, Tdh, groups);

  // Softmax backward in place: dS = P * (dP - sum_j P dP) * scale (P as kept: R(P) in bf16).
  const KeptIn p = probs_.in();
  auto dp = as_mat(d_probs, nseq * H * T, T);
  const DocStarts docs = docs_;
  const int window = window_;
  Kokkos::parallel_for(
      "attn::softmax_backward", row_policy(nseq * H * T), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank(), t = r % T;
        const int lo = first_key(t, docs(r / (H * T) * T + t), window);
        const std::int64_t base = std::int64_t(r) * T;
        if (p.b16)
          softmax_row_backward(tm, lo, t, T, p.b16 + base, &dp(r, 0), scale);
        else
          softmax_row_backward(tm, lo, t, T, p.f32 + base, &dp(r, 0), scale);
      });

  // dq = dS k (overwrites dO in d_heads, no longer needed); dk = dS^T q.
  gemm_strided_batched(ctx_, Trans::N, Trans::N, 1.0f, {d_probs, G * T, T, G * TT},
                       k_.strided(T, dh, Tdh), 0.0f, d_heads, G * T, dh, G * Tdh, groups);
  gemm_strided_batched(ctx_, Trans::T, Trans::N, 1.0f, {d_probs, G * T, T, G * TT},
                       q_.strided(G * T, dh, G * Tdh), 0.0f, d_k, T, dh, Tdh, groups);

  // Back to (N, W) rows: inverse RoPE on dq, dk (gradients w.r.t. the normalized q, k), dv.
  Mat d_qkv = frame.mat(N, W);
  const ConstVec dq(d_heads, std::int64_t(N) * qd), dk(d_k, std::int64_t(N) * kd),
      dv(d_v, std::int64_t(N) * kd);
  auto cs = rope.cos, sn = rope.sin;
  Kokkos::parallel_for(
      "attn::unrope_merge", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank(), s = r / T, t = r % T;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (H + Hkv) * half), [&](int j) {
          const bool is_q = j < H * half;
          const int jj = is_q ? j : j - H * half, h = jj / half, i = jj % half;
          const std::int64_t base = ((std::int64_t(s) * (is_q ? H : Hkv) + h) * T + t) * dh;
          // The transpose of the rotation (y0 = x0 cos - x1 sin, y1 = x1 cos + x0 sin).
          const float g0 = (is_q ? dq : dk)(base + i), g1 = (is_q ? dq : dk)(base + i + half);
          const float co = cs(t, i), si = sn(t, i);
          const int c0 = (is_q ? 0 : qd) + h * dh + i;
          d_qkv(r, c0) = g0 * co + g1 * si;
          d_qkv(r, c0 + half) = g1 * co - g0 * si;
        });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, kd), [&](int c) {
          d_qkv(r, qd + kd + c) = dv(((std::int64_t(s) * Hkv + c / dh) * T + t) * dh + c % dh);
        });
      });

  // The library's QK-norm backward, shared on purpose (see full_attention.hpp).
  if (qk_norm)
    kmoe::qk_norm_backward(as_cmat(qkv_.data(), N, W), d_qkv, qd, kd,
                           ConstVec(rstd_q_.data(), N), ConstVec(rstd_k_.data(), N),
                           table.param(q_norm_), table.param(k_norm_),
                           Vec(table.grad(q_norm_), qd), Vec(table.grad(k_norm_), kd));

  // Fused projection: dW(q|k|v) += d_qkv^T a; da = d_qkv W(q|k|v).
  gemm(ctx_, Trans::T, Trans::N, 1.0f, as_cmat(d_qkv), a, 1.0f, as_mat(table.grad(wq_), W, D_));
  gemm(ctx_, Trans::N, Trans::N, 1.0f, as_cmat(d_qkv), table.weight(wq_, W, D_), 0.0f, da);
}

}  // namespace kmoe::oracle

