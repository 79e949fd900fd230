#include "modules/attention/attention.hpp"

#include <algorithm>
#include <cmath>

#include "core/column_sums.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/gemm.hpp"
#include "modules/norm/rmsnorm.hpp"

namespace kmoe {

AttentionDims Attention::core_dims(const ModelCfg& m, int max_seqs, int T, int window) {
  AttentionDims d;
  d.H = m.n_heads;
  d.Hkv = m.n_kv_heads;
  d.dh = m.head_dim();
  d.T = T;
  d.max_seqs = max_seqs;
  d.window = window;
  return d;
}

std::int64_t Attention::workspace_bytes(const ModelCfg& m, int max_seqs, int T, bool bf16,
                                        int window, AttentionKernel kernel) {
  const std::int64_t N = std::int64_t(max_seqs) * T, dh = m.head_dim();
  const std::int64_t qd = m.n_heads * dh, kd = m.n_kv_heads * dh;
  const AttentionCoreSizes core = attention_core_sizes(choose_attention_path(kernel, m).path,
                                                       core_dims(m, max_seqs, T, window), bf16);
  const std::int64_t heads = Workspace::rounded(4 * N * qd);
  const std::int64_t forward = heads + core.forward_workspace.get();
  // dO/dQ, dK, dV (and, bf16, dO's bf16 copy) held across the backward; below them the merged
  // dO, the core's backward, and d(q|k|v) one after another.
  const std::int64_t backward =
      heads + 2 * Workspace::rounded(4 * N * kd) + (bf16 ? Workspace::rounded(2 * N * qd) : 0) +
      std::max({heads, core.backward_workspace.get(),
                Workspace::rounded(4 * N * (qd + 2 * kd)) +
                    (bf16 ? Workspace::rounded(2 * N * (qd + 2 * kd)) : 0)});
  return std::max(forward, backward);
}

Attention::Attention(const RunContext& ctx, const ModelCfg& m, const std::string& prefix,
                     int max_seqs, int seq_len, TensorTable& table, int window)
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
  const AttentionChoice choice = choose_attention_path(ctx.attention, m);
  core_ = make_attention_core(choice.path, ctx, core_dims(m, max_seqs, T_, window_));
  merged_ = KeptOperand(ctx, "attn::merged", N * qd);
}

namespace {

// Element i of query head h at position t of sequence s in the query layout
// (nseq, Hkv, T, G, dh): the G heads of a kv head side by side at each position.
KOKKOS_INLINE_FUNCTION std::int64_t query_index(int s, int h, int t, int i, int T, int Hkv, int G,
                                                int dh) {
  return (((std::int64_t(s) * Hkv + h / G) * T + t) * G + h % G) * dh + i;
}

// Element (r, c) of concatenated heads (N, H*dh) in the query layout.
KOKKOS_INLINE_FUNCTION std::int64_t head_index(int r, int c, int T, int Hkv, int G, int dh) {
  return query_index(r / T, c / dh, r % T, c % dh, T, Hkv, G, dh);
}

// Concatenated heads (N, H*dh) into the query layout.
// heads16 (bf16 runs): the same values rounded, in the same layout, or nullptr.
void split_heads(ConstMat merged, float* heads, std::uint16_t* heads16, int T, int Hkv, int G,
                 int dh) {
  Kokkos::parallel_for(
      "attn::split_heads", Range2({0, 0}, {int(merged.extent(0)), Hkv * G * dh}),
      KOKKOS_LAMBDA(int r, int c) {
        const std::int64_t i = head_index(r, c, T, Hkv, G, dh);
        heads[i] = merged(r, c);
        if (heads16) heads16[i] = bf16_bits(merged(r, c));
      });
}

// The query layout into N rows of concatenated heads, kept for the output projection.
void merge_heads(const float* heads, KeptOut merged, int N, int T, int Hkv, int G, int dh) {
  const int qd = Hkv * G * dh;
  Kokkos::parallel_for(
      "attn::merge_heads", Range2({0, 0}, {N, qd}), KOKKOS_LAMBDA(int r, int c) {
        merged.set(std::int64_t(r) * qd + c, heads[head_index(r, c, T, Hkv, G, dh)]);
      });
}

// QK-norm's RMSNorm backward of row r's q and k columns of d_qkv in place (and rounded into
// d_qkv16, when given): the gradient w.r.t. the norms' outputs in, w.r.t. their inputs out.
KOKKOS_INLINE_FUNCTION void qk_norm_row_backward(const TeamMember& team, int r, const ConstMat& qkv,
                                                 const Mat& d_qkv, int qd, int kd, float rq,
                                                 float rk, const float* gq, const float* gk,
                                                 std::uint16_t* d_qkv16) {
  const int W = qkv.extent(1);
  for (int part = 0; part < 2; ++part) {
    const int c0 = part == 0 ? 0 : qd, width = part == 0 ? qd : kd;
    const float* g = part == 0 ? gq : gk;
    const float s = part == 0 ? rq : rk;
    float dot = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, width),
        [&](int c, float& acc) { acc += g[c] * d_qkv(r, c0 + c) * qkv(r, c0 + c) * s; }, dot);
    const float mean_dot = dot / width;
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width), [&](int c) {
      const float v = s * (g[c] * d_qkv(r, c0 + c) - qkv(r, c0 + c) * s * mean_dot);
      d_qkv(r, c0 + c) = v;
      if (d_qkv16) d_qkv16[std::int64_t(r) * W + c0 + c] = bf16_bits(v);
    });
    team.team_barrier();
  }
}

}  // namespace

NormRope Attention::norm_rope_of(const TensorTable& table, const RopeTables& rope) const {
  NormRope r{H_, Hkv_, dh_, eps_, qk_norm_, nullptr, nullptr, rope.cos, rope.sin};
  if (qk_norm_) {
    r.gq = table.param(q_norm_);
    r.gk = table.param(k_norm_);
  }
  return r;
}

void Attention::forward(const TensorTable& table, const RopeTables& rope, const Operand& a, Mat out,
                        Workspace& ws, DocStarts docs) {
  Workspace::Frame frame(ws);
  const int N = a.rows, T = T_, nseq = N / T, H = H_, Hkv = Hkv_, dh = dh_, half = dh / 2;
  const int qd = H * dh, kd = Hkv * dh, W = qd + 2 * kd, G = H / Hkv;
  const bool qk_norm = qk_norm_;

  Mat qkv = as_mat(qkv_.data(), N, W);  // (N, H*dh | Hkv*dh | Hkv*dh)
  gemm(ctx_, Trans::N, Trans::T, 1.0f, a, table.weight(wq_, W, D_), 0.0f, qkv);

  // QK-norm over the whole projected q and k, RoPE, and the split into head layout.
  const KeptOut q = q_.out(), k = k_.out(), v = v_.out();
  auto rq = rstd_q_, rk = rstd_k_;
  const NormRope norm_rope = norm_rope_of(table, rope);
  Kokkos::parallel_for(
      "attn::norm_rope_split", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank(), s = r / T, t = r % T;
        float sq, sk;
        norm_rope(team, qkv, r, t, sq, sk, [&](bool is_q, int h, int i, float a0, float a1) {
          const std::int64_t base = is_q ? query_index(s, h, t, 0, T, Hkv, G, dh)
                                         : ((std::int64_t(s) * Hkv + h) * T + t) * dh;
          const KeptOut& dst = is_q ? q : k;
          dst.set(base + i, a0);
          dst.set(base + i + half, a1);
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

  // The core: heads (nseq, Hkv, T, G, dh) from q, k, v and the mask.
  float* heads = frame.floats(std::int64_t(N) * qd);
  core_->forward({q_, k_, v_}, nseq, docs, heads, ws);
  merge_heads(heads, merged_.out(), N, T, Hkv, G, dh);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, merged_.matrix(N, qd), table.weight(wo_, D_, qd), 0.0f, out);
}

void Attention::backward(TensorTable& table, const RopeTables& rope, const Operand& a,
                         const Operand& dout, Mat da, Workspace& ws) {
  const int N = a.rows, H = H_, Hkv = Hkv_, dh = dh_;
  const int qd = H * dh, kd = Hkv * dh, W = qd + 2 * kd;
  N_ = N;
  Workspace::Frame frame(ws);
  float* d_heads = frame.floats(std::int64_t(N) * qd);  // query layout: dO, then dQ
  float* d_k = frame.floats(std::int64_t(N) * kd);      // (nseq, Hkv, T, dh)
  float* d_v = frame.floats(std::int64_t(N) * kd);
  // bf16 runs: dO also as bf16, written by the split, for a core whose products read it.
  std::uint16_t* d_heads16 = ctx_.bf16() ? frame.words(std::int64_t(N) * qd) : nullptr;
  output_projection_backward(table, dout, d_heads, d_heads16, ws);
  core_->backward({q_, k_, v_}, N / T_, d_heads, d_heads16, d_k, d_v, ws);
  Mat d_qkv = frame.mat(N, W);
  // In bf16 runs the kernels that finish d(q|k|v) also write it rounded, the copy both
  // products read: unrope_merge the v columns (and q, k without QK-norm), the QK-norm
  // backward the q and k columns.
  std::uint16_t* d_qkv16 =
      ctx_.bf16() ? reinterpret_cast<std::uint16_t*>(frame.floats((std::int64_t(N) * W + 1) / 2))
                  : nullptr;
  if (qk_norm_) qk_norm_weight_grads(table, rope, d_heads, d_k);
  unrope_merge(table, rope, d_heads, d_k, d_v, d_qkv, d_qkv16);
  const Operand d_qkv_in{d_qkv16 ? nullptr : d_qkv.data(), d_qkv16, N, W};
  // Fused projection: dW(q|k|v) += d_qkv^T a; da = d_qkv W(q|k|v).
  gemm(ctx_, Trans::T, Trans::N, 1.0f, d_qkv_in, a, 1.0f, as_mat(table.grad(wq_), W, D_));
  gemm(ctx_, Trans::N, Trans::N, 1.0f, d_qkv_in, table.weight(wq_, W, D_), 0.0f, da);
}

void Attention::output_projection_backward(TensorTable& table, const Operand& dout, float* d_heads,
                                           std::uint16_t* d_heads16, Workspace& ws) const {
  const int N = N_, T = T_, H = H_, Hkv = Hkv_, dh = dh_, qd = H * dh, G = H / Hkv;
  // Output projection: dWo += dout^T merged; d_merged = dout Wo, split into heads.
  gemm(ctx_, Trans::T, Trans::N, 1.0f, dout, merged_.matrix(N, qd), 1.0f,
       as_mat(table.grad(wo_), D_, qd));
  {
    Workspace::Frame merged(ws);  // d_merged's memory becomes d_qkv's below
    Mat d_merged = merged.mat(N, qd);
    gemm(ctx_, Trans::N, Trans::N, 1.0f, dout, table.weight(wo_, D_, qd), 0.0f, d_merged);
    split_heads(as_cmat(d_merged), d_heads, d_heads16, T, Hkv, G, dh);
  }
}

void Attention::qk_norm_weight_grads(TensorTable& table, const RopeTables& rope,
                                     const float* d_heads, const float* d_k) const {
  const int N = N_, T = T_, H = H_, Hkv = Hkv_, dh = dh_, half = dh / 2;
  const int qd = H * dh, kd = Hkv * dh, G = H / Hkv, W = qd + 2 * kd;
  const ConstMat qkv = as_cmat(qkv_.data(), N, W);
  const ConstVec rq(rstd_q_.data(), N), rk(rstd_k_.data(), N);
  auto cs = rope.cos, sn = rope.sin;
  // dg[c] += sum_r dy[r,c] * x[r,c] * rstd[r] (rmsnorm_weight_grad's sum), dy the gradient
  // w.r.t. the norm's output: column c's value of the inverse RoPE of its pair.
  column_sums(
      "attn::qk_norm_weight_grad_q", N, qd,
      KOKKOS_LAMBDA(int r, int c) {
        const int s = r / T, t = r % T, i = c % dh, i0 = i % half;
        const std::int64_t base = query_index(s, c / dh, t, 0, T, Hkv, G, dh);
        float g0 = d_heads[base + i0], g1 = d_heads[base + i0 + half];
        rope_rotate_transpose(g0, g1, cs(t, i0), sn(t, i0));
        return (i < half ? g0 : g1) * qkv(r, c) * rq(r);
      },
      Vec(table.grad(q_norm_), qd));
  column_sums(
      "attn::qk_norm_weight_grad_k", N, kd,
      KOKKOS_LAMBDA(int r, int c) {
        const int s = r / T, t = r % T, i = c % dh, i0 = i % half;
        const std::int64_t base = ((std::int64_t(s) * Hkv + c / dh) * T + t) * dh;
        float g0 = d_k[base + i0], g1 = d_k[base + i0 + half];
        rope_rotate_transpose(g0, g1, cs(t, i0), sn(t, i0));
        return (i < half ? g0 : g1) * qkv(r, qd + c) * rk(r);
      },
      Vec(table.grad(k_norm_), kd));
}

void Attention::unrope_merge(const TensorTable& table, const RopeTables& rope, const float* d_heads,
                             const float* d_k, const float* d_v, Mat d_qkv,
                             std::uint16_t* d_qkv16) const {
  const int N = N_, T = T_, H = H_, Hkv = Hkv_, dh = dh_, half = dh / 2;
  const int qd = H * dh, kd = Hkv * dh, G = H / Hkv, W = qd + 2 * kd;
  // Back to (N, W) rows: inverse RoPE on dq, dk (gradients w.r.t. the normalized q, k), dv.
  const ConstVec dq(d_heads, std::int64_t(N) * qd), dk(d_k, std::int64_t(N) * kd),
      dv(d_v, std::int64_t(N) * kd);
  auto cs = rope.cos, sn = rope.sin;
  const bool qk_norm = qk_norm_;
  std::uint16_t* const qk16 = qk_norm ? nullptr : d_qkv16;  // final here without QK-norm
  // QK-norm's RMSNorm backward of the q and k columns (as kmoe::qk_norm_backward's rows).
  const ConstMat qkv = as_cmat(qkv_.data(), N, W);
  const ConstVec rq(rstd_q_.data(), N), rk(rstd_k_.data(), N);
  const float* gq = qk_norm ? table.param(q_norm_) : nullptr;
  const float* gk = qk_norm ? table.param(k_norm_) : nullptr;
  Kokkos::parallel_for(
      "attn::unrope_merge", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank(), s = r / T, t = r % T;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (H + Hkv) * half), [&](int j) {
          const bool is_q = j < H * half;
          const int jj = is_q ? j : j - H * half, h = jj / half, i = jj % half;
          const std::int64_t base = is_q ? query_index(s, h, t, 0, T, Hkv, G, dh)
                                         : ((std::int64_t(s) * Hkv + h) * T + t) * dh;
          float g0 = (is_q ? dq : dk)(base + i), g1 = (is_q ? dq : dk)(base + i + half);
          rope_rotate_transpose(g0, g1, cs(t, i), sn(t, i));
          const int c0 = (is_q ? 0 : qd) + h * dh + i;
          d_qkv(r, c0) = g0;
          d_qkv(r, c0 + half) = g1;
          if (qk16) {
            const std::int64_t at = std::int64_t(r) * (qd + 2 * kd) + c0;
            qk16[at] = bf16_bits(g0);
            qk16[at + half] = bf16_bits(g1);
          }
        });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, kd), [&](int c) {
          const float g = dv(((std::int64_t(s) * Hkv + c / dh) * T + t) * dh + c % dh);
          d_qkv(r, qd + kd + c) = g;
          if (d_qkv16) d_qkv16[std::int64_t(r) * (qd + 2 * kd) + qd + kd + c] = bf16_bits(g);
        });
        if (!qk_norm) return;
        team.team_barrier();  // the row's q and k columns written before the norm reads them
        qk_norm_row_backward(team, r, qkv, d_qkv, qd, kd, rq(r), rk(r), gq, gk, d_qkv16);
      });
}

void qk_norm_backward(ConstMat qkv, Mat d_qkv, int qd, int kd, ConstVec rq, ConstVec rk,
                      const float* gq, const float* gk, Vec grad_gq, Vec grad_gk,
                      std::uint16_t* d_qkv16) {
  const int N = qkv.extent(0), W = qkv.extent(1);
  // Norm weights first (they need the gradient w.r.t. the norm output), then the in-place
  // RMSNorm backward of the q and k column blocks.
  rmsnorm_weight_grad(qkv.data(), W, d_qkv.data(), W, rq, N, qd, grad_gq);
  rmsnorm_weight_grad(qkv.data() + qd, W, d_qkv.data() + qd, W, rk, N, kd, grad_gk);
  Kokkos::parallel_for(
      "attn::qk_norm_backward", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        qk_norm_row_backward(team, r, qkv, d_qkv, qd, kd, rq(r), rk(r), gq, gk, d_qkv16);
      });
}

}  // namespace kmoe

namespace kmoe {

KvCache::KvCache(const ModelCfg& m, int cap)
    : k("attn::kv_cache_k", std::int64_t(m.n_kv_heads) * cap * m.head_dim()),
      v("attn::kv_cache_v", std::int64_t(m.n_kv_heads) * cap * m.head_dim()),
      capacity(cap) {}

void Attention::decode(const TensorTable& table, const RopeTables& rope, ConstMat a, int pos,
                       KvCache& cache, Mat out, Workspace& ws, DocStarts docs) const {
  const int n = a.extent(0), H = H_, Hkv = Hkv_, dh = dh_, half = dh / 2, G = H / Hkv;
  const int qd = H * dh, kd = Hkv * dh, W = qd + 2 * kd, L = pos + n, C = cache.capacity;
  KMOE_REQUIRE(L <= C && L <= int(rope.cos.extent(0)), "attention decode: positions up to "
                                                           << L << " beyond the cache (" << C
                                                           << ") or the RoPE tables");
  Workspace::Frame frame(ws);
  Mat qkv = frame.mat(n, W);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, a, table.weight(wq_, W, D_), 0.0f, qkv);

  // Per new row, as forward(): QK-norm over the whole q and k, RoPE at its position; q into
  // (n, H*dh) rows, k and v into the cache.
  Mat q = frame.mat(n, qd);
  auto kc = cache.k, vc = cache.v;
  const NormRope norm_rope = norm_rope_of(table, rope);
  Kokkos::parallel_for(
      "attn::decode_norm_rope", row_policy(n), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank(), t = pos + r;
        float sq, sk;
        norm_rope(team, qkv, r, t, sq, sk, [&](bool is_q, int h, int i, float a0, float a1) {
          const int w0 = h * dh + i;
          if (is_q) {
            q(r, w0) = a0;
            q(r, w0 + half) = a1;
          } else {
            const std::int64_t base = (std::int64_t(h) * C + t) * dh;
            kc(base + i) = a0;
            kc(base + i + half) = a1;
          }
        });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, kd), [&](int c) {
          vc((std::int64_t(c / dh) * C + t) * dh + c % dh) = qkv(r, qd + kd + c);
        });
      });

  // Per (new row, head): scores against keys lo..t, the masked softmax as forward() computes
  // it (exp_poly of the shifted scores, then 1/sum), the weighted values into merged heads.
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const int window = window_;
  Mat p = frame.mat(n * H, L);
  Mat merged = frame.mat(n, qd);
  Kokkos::parallel_for(
      "attn::decode_softmax_values", team_policy(n * H), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int row = tm.league_rank(), r = row / H, h = row % H, t = pos + r;
        const int lo = first_key(t, docs(t), window);
        const std::int64_t kv0 = std::int64_t(h / G) * C * dh;
        float* s = &p(row, 0);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, lo, t + 1), [&](int j) {
          float acc = 0.0f;
          for (int i = 0; i < dh; ++i) acc += q(r, h * dh + i) * kc(kv0 + std::int64_t(j) * dh + i);
          s[j] = acc * scale;
        });
        tm.team_barrier();
        float mx = 0.0f, sum = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, lo, t + 1),
            [&](int j, float& m) { m = s[j] > m ? s[j] : m; }, Kokkos::Max<float>(mx));
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, lo, t + 1),
                             [&](int j) { s[j] = math::exp_poly(s[j] - mx); });
        tm.team_barrier();
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, lo, t + 1), [&](int j, float& acc) { acc += s[j]; }, sum);
        const float inv = 1.0f / sum;
        tm.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, dh), [&](int i) {
          float acc = 0.0f;
          for (int j = lo; j <= t; ++j) acc += s[j] * inv * vc(kv0 + std::int64_t(j) * dh + i);
          merged(r, h * dh + i) = acc;
        });
      });
  gemm(ctx_, Trans::N, Trans::T, 1.0f, as_cmat(merged), table.weight(wo_, D_, qd), 0.0f, out);
}

}  // namespace kmoe
