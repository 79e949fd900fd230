#include "modules/attention/attention.hpp"

#include <algorithm>
#include <cmath>

#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/gemm.hpp"
#include "modules/norm/rmsnorm.hpp"

namespace kmoe {

std::vector<Attention::Tile> Attention::tiles(int T, int window) {
  std::vector<Tile> v;
  std::int64_t before = 0;
  for (int r0 = 0; r0 < T; r0 += kTile) {
    Tile t;
    t.r0 = r0;
    t.rows = std::min(kTile, T - r0);
    t.k0 = window > 0 ? std::max(0, r0 - window + 1) / kTile * kTile : 0;
    t.nk = r0 + t.rows - t.k0;
    t.before = before;
    t.keys_before = v.empty() ? 0 : v.back().keys_before + v.back().nk;
    before += std::int64_t(t.rows) * t.nk;
    v.push_back(t);
  }
  return v;
}

std::int64_t Attention::band_elements(int T, int window) {
  const Tile last = tiles(T, window).back();
  return last.before + std::int64_t(last.rows) * last.nk;
}

std::int64_t Attention::key_band_elements(int T, int window) {
  const Tile last = tiles(T, window).back();
  return last.keys_before + last.nk;
}

std::int64_t Attention::workspace_bytes(const ModelCfg& m, int max_seqs, int T, bool bf16,
                                        int window) {
  const std::int64_t N = std::int64_t(max_seqs) * T, dh = m.head_dim();
  const std::int64_t qd = m.n_heads * dh, kd = m.n_kv_heads * dh;
  const std::int64_t probs =
      Workspace::rounded(4 * std::int64_t(max_seqs) * m.n_heads * band_elements(T, window));
  const std::int64_t heads = Workspace::rounded(4 * N * qd);
  const std::int64_t forward = heads + (bf16 ? probs : 0);
  const std::int64_t partials =
      Workspace::rounded(4 * std::int64_t(max_seqs) * kd * key_band_elements(T, window));
  const std::int64_t backward = heads + probs + 2 * Workspace::rounded(4 * N * kd) +
                                std::max(partials, Workspace::rounded(4 * N * (qd + 2 * kd)));
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
  tiles_ = tiles(T_, window_);
  band_ = band_elements(T_, window_);
  key_band_ = key_band_elements(T_, window_);
  const std::size_t nt = tiles_.size();
  tile_before_ = Kokkos::View<std::int64_t*, Layout, MemSpace>("attn::tile_before", 3 * nt);
  auto hb = Kokkos::create_mirror_view(tile_before_);
  for (std::size_t i = 0; i < nt; ++i) {
    hb(i) = tiles_[i].before;
    hb(nt + i) = tiles_[i].keys_before;
    hb(2 * nt + i) = tiles_[i].k0;
  }
  mark_host_sync("attention setup");
  Kokkos::deep_copy(tile_before_, hb);
  probs_ = KeptOperand(ctx, "attn::probs", static_cast<std::int64_t>(max_seqs) * H_ * band_);
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
void split_heads(ConstMat merged, float* heads, int T, int Hkv, int G, int dh) {
  Kokkos::parallel_for(
      "attn::split_heads", Range2({0, 0}, {int(merged.extent(0)), Hkv * G * dh}),
      KOKKOS_LAMBDA(int r, int c) { heads[head_index(r, c, T, Hkv, G, dh)] = merged(r, c); });
}

// The query layout into N rows of concatenated heads, kept for the output projection.
void merge_heads(const float* heads, KeptOut merged, int N, int T, int Hkv, int G, int dh) {
  const int qd = Hkv * G * dh;
  Kokkos::parallel_for(
      "attn::merge_heads", Range2({0, 0}, {N, qd}), KOKKOS_LAMBDA(int r, int c) {
        merged.set(std::int64_t(r) * qd + c, heads[head_index(r, c, T, Hkv, G, dh)]);
      });
}

// The first element of a strided operand moved by `offset` elements.
Strided shifted(Strided x, std::int64_t offset) {
  if (x.data) x.data += offset;
  if (x.b16) x.b16 += offset;
  return x;
}

// A row of the band: which tile, sequence, head and position the league index `r` of a kernel
// over all nseq * H * T rows of the probabilities is, and where its nk values start. Rows come
// tile after tile; within a tile, (sequence, kv head) blocks of G * rows rows, each position's
// G heads adjacent.
struct BandRow {
  int s, t, k0, nk;
  std::int64_t start;
};
KOKKOS_INLINE_FUNCTION BandRow band_row(int r, int nseq, int H, int Hkv, int G, int T, int window,
                                        const std::int64_t* before) {
  const int tile_rows = nseq * H * Attention::kTile;  // league rows of one full tile
  const int nt = (T + Attention::kTile - 1) / Attention::kTile;
  int i = r / tile_rows;
  if (i > nt - 1) i = nt - 1;
  const int r0 = i * Attention::kTile;
  const int rows = T - r0 < Attention::kTile ? T - r0 : Attention::kTile;
  const int local = r - nseq * H * r0;  // rows before this tile: nseq * H * r0
  const int block = local / (G * rows), rr = local % (G * rows);
  BandRow b;
  b.s = block / Hkv;
  b.t = r0 + rr / G;
  const int first = window > 0 && r0 - window + 1 > 0 ? r0 - window + 1 : 0;
  b.k0 = first / Attention::kTile * Attention::kTile;
  b.nk = r0 + rows - b.k0;
  b.start = std::int64_t(nseq) * H * before[i] + std::int64_t(local) * b.nk;
  return b;
}

// The first key position t reads: its document's start, and within the window.
KOKKOS_INLINE_FUNCTION int first_key(int t, int doc_start, int window) {
  const int w = window > 0 ? t - window + 1 : 0;
  return doc_start > w ? doc_start : w;
}

// Tile i's sequences in runs that skip the same keys (train.document_mask, planned on the host
// from the ids): fn(s0, count, off) for sequences [s0, s0 + count), whose query tile reads no
// key before k0 + off, off = its first row's document start past k0 (0 without a plan). A run's
// products are one strided batch over its (sequence, kv head) pairs with rows `nk` apart.
template <class Fn>
void for_each_run(const DocStarts& docs, const Attention::Tile& tl, int i, int nseq,
                  const Fn& fn) {
  const bool plan = docs.tile_start != nullptr && gemm_rows_apart();
  auto off = [&](int s) {
    return plan ? std::max(0, docs.tile_start[std::size_t(s) * docs.tiles + i] - tl.k0) : 0;
  };
  for (int s0 = 0; s0 < nseq;) {
    const int o = off(s0);
    int s1 = s0 + 1;
    while (s1 < nseq && off(s1) == o) ++s1;
    fn(s0, s1 - s0, o);
    s0 = s1;
  }
}

// One band row of the masked softmax backward in place: g = P * (g - sum_j P g) * scale over
// its entries [lo, hi] (keys lo + k0 .. hi + k0), 0 elsewhere of its nk, with P as kept (fp32
// or bf16 pointer, row start applied).
template <class P>
KOKKOS_INLINE_FUNCTION void softmax_row_backward(const TeamMember& tm, int lo, int hi, int nk, P pr,
                                                 float* g, float scale) {
  float dot = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::TeamThreadRange(tm, lo, hi + 1),
      [&](int j, float& s) { s += kept_load(pr, j) * g[j]; }, dot);
  tm.team_barrier();  // every read of g before the first write
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nk), [&](int j) {
    g[j] = j >= lo && j <= hi ? kept_load(pr, j) * (g[j] - dot) * scale : 0.0f;
  });
}

}  // namespace

void Attention::forward(const TensorTable& table, const RopeTables& rope, ConstMat a, Mat out,
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
  const NormRope norm_rope{H,  Hkv, dh, eps, qk_norm, qk_norm ? table.param(q_norm_) : nullptr,
                           qk_norm ? table.param(k_norm_) : nullptr, rope.cos, rope.sin};
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

  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const std::int64_t Tdh = std::int64_t(T) * dh, TGdh = Tdh * G;
  KMOE_REQUIRE(!docs.tile_start ||
                   (docs.tile_rows == kTile && docs.tiles == static_cast<int>(tiles_.size())),
               "attention: a document plan of " << docs.tiles << " tiles of " << docs.tile_rows
                                                << " rows for " << tiles_.size() << " of "
                                                << kTile);
  // Per query tile: scores (G*rows, nk) = q_tile k_range^T / sqrt(dh) for every (sequence, kv
  // head), a strided batch per run of sequences (for_each_run), into the kept probabilities
  // (fp32 runs: the softmax works in place) or a workspace buffer (bf16 runs: the softmax
  // rounds the probabilities into the kept bf16 buffer). Keys a run skips stay unwritten: no
  // row of it reads them.
  const std::int64_t band = std::int64_t(nseq) * H * band_;
  float* scores = probs_.product_target(probs_.is_bf16() ? frame.floats(band) : nullptr);
  const Strided qs = q_.strided(G * T, dh, TGdh), ks = k_.strided(T, dh, Tdh);
  scores_computed_ = 0;
  std::vector<GemmGroup> groups;
  for (std::size_t i = 0; i < tiles_.size(); ++i) {
    const Tile& tl = tiles_[i];
    const int m = G * tl.rows;
    const std::int64_t mk = std::int64_t(m) * tl.nk;
    for_each_run(docs, tl, int(i), nseq, [&](int s0, int count, int off) {
      const int n = tl.nk - off;
      groups.push_back(
          {shifted({qs.data, m, dh, TGdh, qs.b16}, (std::int64_t(s0) * Hkv * T + tl.r0) * G * dh),
           shifted({ks.data, n, dh, Tdh, ks.b16}, (std::int64_t(s0) * Hkv * T + tl.k0 + off) * dh),
           scores + std::int64_t(nseq) * H * tl.before + s0 * Hkv * mk + off, m, n, mk,
           count * Hkv, tl.nk});
      scores_computed_ += std::int64_t(count) * Hkv * m * n;
    });
  }
  gemm_grouped_batched(ctx_, Trans::N, Trans::T, scale, 0.0f, groups, tables_[0]);

  // Masked softmax over each band row's keys [lo, t] (causal, document, window), one team per
  // row, its threads over the keys (on CPUs a one-thread team: the exp loop is branch-free,
  // exp_poly, and vectorizes; the max and the sum run in key order).
  const KeptOut p = probs_.out();
  const int window = window_;
  const std::int64_t* before = tile_before_.data();
  Kokkos::parallel_for(
      "attn::causal_softmax", row_policy(nseq * H * T), KOKKOS_LAMBDA(const TeamMember& tm) {
        const BandRow b = band_row(tm.league_rank(), nseq, H, Hkv, G, T, window, before);
        const int lo = first_key(b.t, docs(b.s * T + b.t), window) - b.k0, hi = b.t - b.k0;
        float* row = scores + b.start;
        float mx = 0.0f, sum = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, lo, hi + 1),
            [&](int j, float& m) { m = row[j] > m ? row[j] : m; }, Kokkos::Max<float>(mx));
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, lo, hi + 1),
                             [&](int j) { row[j] = math::exp_poly(row[j] - mx); });
        tm.team_barrier();
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, lo, hi + 1), [&](int j, float& s) { s += row[j]; }, sum);
        const float inv = 1.0f / sum;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, b.nk), [&](int j) {
          p.set(b.start + j, j >= lo && j <= hi ? row[j] * inv : 0.0f);
        });
      });

  // Per query tile: heads (G*rows, dh) = P_tile v_range, into the query layout; a run reads
  // the probabilities and values of its keys only.
  float* heads = frame.floats(std::int64_t(N) * qd);
  const Strided ps = probs_.strided(0, 0, 0), vs = v_.strided(T, dh, Tdh);
  groups.clear();
  for (std::size_t i = 0; i < tiles_.size(); ++i) {
    const Tile& tl = tiles_[i];
    const int m = G * tl.rows;
    const std::int64_t mk = std::int64_t(m) * tl.nk;
    for_each_run(docs, tl, int(i), nseq, [&](int s0, int count, int off) {
      const int n = tl.nk - off;
      groups.push_back(
          {shifted({ps.data, m, n, mk, ps.b16, tl.nk},
                   std::int64_t(nseq) * H * tl.before + s0 * Hkv * mk + off),
           shifted({vs.data, n, dh, Tdh, vs.b16}, (std::int64_t(s0) * Hkv * T + tl.k0 + off) * dh),
           heads + (std::int64_t(s0) * Hkv * T + tl.r0) * G * dh, m, dh, TGdh, count * Hkv});
    });
  }
  gemm_grouped_batched(ctx_, Trans::N, Trans::N, 1.0f, 0.0f, groups, tables_[1]);
  merge_heads(heads, merged_.out(), N, T, Hkv, G, dh);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, merged_.matrix(N, qd), table.weight(wo_, D_, qd), 0.0f, out);
}

void Attention::backward(TensorTable& table, const RopeTables& rope, ConstMat a, ConstMat dout,
                         Mat da, Workspace& ws) {
  const int N = a.extent(0), H = H_, Hkv = Hkv_, dh = dh_;
  const int qd = H * dh, kd = Hkv * dh, W = qd + 2 * kd;
  N_ = N;
  Workspace::Frame frame(ws);
  float* d_heads = frame.floats(std::int64_t(N) * qd);  // query layout: dO, then dQ
  float* d_probs = frame.floats(std::int64_t(N / T_) * H * band_);
  float* d_k = frame.floats(std::int64_t(N) * kd);  // (nseq, Hkv, T, dh), summed over tiles
  float* d_v = frame.floats(std::int64_t(N) * kd);
  output_projection_backward(table, dout, d_heads, ws);
  {
    Workspace::Frame keys(ws);  // the per-tile key gradients, d_qkv's memory below
    float* partial = keys.floats(std::int64_t(N / T_) * kd * key_band_);
    probs_values_backward(d_heads, d_probs, partial, d_v);
    softmax_backward(d_probs);
    queries_keys_backward(d_probs, d_heads, partial, d_k);
  }
  Mat d_qkv = frame.mat(N, W);
  unrope_merge(rope, d_heads, d_k, d_v, d_qkv);
  if (qk_norm_) qk_norm_backward(table, d_qkv);
  // Fused projection: dW(q|k|v) += d_qkv^T a; da = d_qkv W(q|k|v).
  gemm(ctx_, Trans::T, Trans::N, 1.0f, as_cmat(d_qkv), a, 1.0f, as_mat(table.grad(wq_), W, D_));
  gemm(ctx_, Trans::N, Trans::N, 1.0f, as_cmat(d_qkv), table.weight(wq_, W, D_), 0.0f, da);
}

void Attention::output_projection_backward(TensorTable& table, ConstMat dout, float* d_heads,
                                           Workspace& ws) const {
  const int N = N_, T = T_, H = H_, Hkv = Hkv_, dh = dh_, qd = H * dh, G = H / Hkv;
  // Output projection: dWo += dout^T merged; d_merged = dout Wo, split into heads.
  gemm(ctx_, Trans::T, Trans::N, 1.0f, dout, merged_.matrix(N, qd), 1.0f,
       as_mat(table.grad(wo_), D_, qd));
  {
    Workspace::Frame merged(ws);  // d_merged's memory becomes d_qkv's below
    Mat d_merged = merged.mat(N, qd);
    gemm(ctx_, Trans::N, Trans::N, 1.0f, dout, table.weight(wo_, D_, qd), 0.0f, d_merged);
    split_heads(as_cmat(d_merged), d_heads, T, Hkv, G, dh);
  }
}

void Attention::probs_values_backward(const float* d_heads, float* d_probs, float* partial,
                                      float* d_v) const {
  const int N = N_, T = T_, nseq = N / T, H = H_, Hkv = Hkv_, dh = dh_;
  const int G = H / Hkv;
  const std::int64_t Tdh = std::int64_t(T) * dh, TGdh = Tdh * G;
  // Per query tile and run of sequences (as forward()): dP = dO_tile v_range^T, one grouped
  // batch; the tile's dv_range = P_tile^T dO_tile (summed over the group's heads by the GEMM
  // itself) into its own key partials, one grouped batch, then summed over the tiles in order.
  const DocStarts docs = docs_;
  const Strided ps = probs_.strided(0, 0, 0), vs = v_.strided(0, 0, 0);
  std::vector<GemmGroup> scores, values;
  bool skipped = false;  // keys a run skips: their partial rows are never written
  for (std::size_t i = 0; i < tiles_.size(); ++i) {
    const Tile& tl = tiles_[i];
    const int m = G * tl.rows;
    const std::int64_t mk = std::int64_t(m) * tl.nk;
    for_each_run(docs, tl, int(i), nseq, [&](int s0, int count, int off) {
      const int n = tl.nk - off;
      const std::int64_t at = std::int64_t(nseq) * H * tl.before + s0 * Hkv * mk + off;
      const std::int64_t key = (std::int64_t(s0) * Hkv * T + tl.k0 + off) * dh;
      const Strided d_out{d_heads + (std::int64_t(s0) * Hkv * T + tl.r0) * G * dh, m, dh, TGdh};
      scores.push_back({d_out, shifted({vs.data, n, dh, Tdh, vs.b16}, key), d_probs + at, m, n,
                        mk, count * Hkv, tl.nk});
      values.push_back({shifted({ps.data, m, n, mk, ps.b16, tl.nk}, at), d_out,
                        partial + key_partial(tl, s0, off), n, dh, std::int64_t(tl.nk) * dh,
                        count * Hkv});
      skipped = skipped || off > 0;
    });
  }
  gemm_grouped_batched(ctx_, Trans::N, Trans::T, 1.0f, 0.0f, scores, tables_[2]);
  if (skipped)
    Kokkos::deep_copy(ExecSpace(), Vec(partial, std::int64_t(nseq) * Hkv * dh * key_band_), 0.0f);
  gemm_grouped_batched(ctx_, Trans::T, Trans::N, 1.0f, 0.0f, values, tables_[3]);
  sum_key_partials(partial, d_v);
}

std::int64_t Attention::key_partial(const Tile& tl, int s0, int off) const {
  return (std::int64_t(N_ / T_) * Hkv_ * tl.keys_before + std::int64_t(s0) * Hkv_ * tl.nk + off) *
         dh_;
}

void Attention::sum_key_partials(const float* partial, float* out) const {
  const int T = T_, nseq = N_ / T, Hkv = Hkv_, dh = dh_, nt = static_cast<int>(tiles_.size());
  const std::int64_t* keys_before = tile_before_.data() + nt;
  const std::int64_t* k0 = tile_before_.data() + 2 * nt;
  // Key t of a (sequence, kv head) block: the tiles from t's own to the last that reads it,
  // summed in tile order.
  Kokkos::parallel_for(
      "attn::sum_key_partials", Range2({0, 0}, {nseq * Hkv * T, dh}),
      KOKKOS_LAMBDA(int r, int c) {
        const int block = r / T, t = r % T;
        float sum = 0.0f;
        for (int i = t / kTile; i < nt && k0[i] <= t; ++i) {
          const int nk = (T - i * kTile < kTile ? T : (i + 1) * kTile) - int(k0[i]);
          sum += partial[(std::int64_t(nseq) * Hkv * keys_before[i] + std::int64_t(block) * nk +
                          (t - k0[i])) * dh + c];
        }
        out[std::int64_t(r) * dh + c] = sum;
      });
}

void Attention::softmax_backward(float* d_probs) const {
  const int N = N_, T = T_, nseq = N / T, H = H_, Hkv = Hkv_, dh = dh_, G = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const DocStarts docs = docs_;
  // Softmax backward in place: dS = P * (dP - sum_j P dP) * scale (P as kept: R(P) in bf16).
  const KeptIn p = probs_.in();
  const int window = window_;
  const std::int64_t* before = tile_before_.data();
  Kokkos::parallel_for(
      "attn::softmax_backward", row_policy(nseq * H * T), KOKKOS_LAMBDA(const TeamMember& tm) {
        const BandRow b = band_row(tm.league_rank(), nseq, H, Hkv, G, T, window, before);
        const int lo = first_key(b.t, docs(b.s * T + b.t), window) - b.k0, hi = b.t - b.k0;
        if (p.b16)
          softmax_row_backward(tm, lo, hi, b.nk, p.b16 + b.start, d_probs + b.start, scale);
        else
          softmax_row_backward(tm, lo, hi, b.nk, p.f32 + b.start, d_probs + b.start, scale);
      });
}

void Attention::queries_keys_backward(const float* d_probs, float* d_heads, float* partial,
                                      float* d_k) const {
  const int N = N_, T = T_, nseq = N / T, H = H_, Hkv = Hkv_, dh = dh_;
  const int G = H / Hkv;
  const std::int64_t Tdh = std::int64_t(T) * dh, TGdh = Tdh * G;
  const DocStarts docs = docs_;
  const Strided qs = q_.strided(0, 0, 0), ks = k_.strided(0, 0, 0);
  // Per query tile and run, one grouped batch each: dq_tile = dS k_range (overwrites dO, no
  // longer needed); the tile's dk_range = dS^T q_tile into its key partials (whose skipped rows
  // probs_values_backward left zero), then summed over the tiles in order.
  std::vector<GemmGroup> queries, keys;
  for (std::size_t i = 0; i < tiles_.size(); ++i) {
    const Tile& tl = tiles_[i];
    const int m = G * tl.rows;
    const std::int64_t mk = std::int64_t(m) * tl.nk;
    for_each_run(docs, tl, int(i), nseq, [&](int s0, int count, int off) {
      const int n = tl.nk - off;
      const std::int64_t key = (std::int64_t(s0) * Hkv * T + tl.k0 + off) * dh;
      const std::int64_t query = (std::int64_t(s0) * Hkv * T + tl.r0) * G * dh;
      const Strided d_s{d_probs + std::int64_t(nseq) * H * tl.before + s0 * Hkv * mk + off,
                        m, n, mk, nullptr, tl.nk};
      queries.push_back({d_s, shifted({ks.data, n, dh, Tdh, ks.b16}, key), d_heads + query, m,
                         dh, TGdh, count * Hkv});
      keys.push_back({d_s, shifted({qs.data, m, dh, TGdh, qs.b16}, query),
                      partial + key_partial(tl, s0, off), n, dh, std::int64_t(tl.nk) * dh,
                      count * Hkv});
    });
  }
  gemm_grouped_batched(ctx_, Trans::N, Trans::N, 1.0f, 0.0f, queries, tables_[4]);
  gemm_grouped_batched(ctx_, Trans::T, Trans::N, 1.0f, 0.0f, keys, tables_[5]);
  sum_key_partials(partial, d_k);
}

void Attention::unrope_merge(const RopeTables& rope, const float* d_heads, const float* d_k,
                             const float* d_v, Mat d_qkv) const {
  const int N = N_, T = T_, H = H_, Hkv = Hkv_, dh = dh_, half = dh / 2;
  const int qd = H * dh, kd = Hkv * dh, G = H / Hkv;
  // Back to (N, W) rows: inverse RoPE on dq, dk (gradients w.r.t. the normalized q, k), dv.
  const ConstVec dq(d_heads, std::int64_t(N) * qd), dk(d_k, std::int64_t(N) * kd),
      dv(d_v, std::int64_t(N) * kd);
  auto cs = rope.cos, sn = rope.sin;
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
        });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, kd), [&](int c) {
          d_qkv(r, qd + kd + c) = dv(((std::int64_t(s) * Hkv + c / dh) * T + t) * dh + c % dh);
        });
      });
}

void Attention::qk_norm_backward(TensorTable& table, Mat d_qkv) const {
  const int N = N_, qd = H_ * dh_, kd = Hkv_ * dh_, W = qd + 2 * kd;
  kmoe::qk_norm_backward(as_cmat(qkv_.data(), N, W), d_qkv, qd, kd,
                         ConstVec(rstd_q_.data(), N), ConstVec(rstd_k_.data(), N),
                         table.param(q_norm_), table.param(k_norm_), Vec(table.grad(q_norm_), qd),
                         Vec(table.grad(k_norm_), kd));
}

void qk_norm_backward(ConstMat qkv, Mat d_qkv, int qd, int kd, ConstVec rq, ConstVec rk,
                      const float* gq, const float* gk, Vec grad_gq, Vec grad_gk) {
  const int N = qkv.extent(0), W = qkv.extent(1);
  // Norm weights first (they need the gradient w.r.t. the norm output), then the in-place
  // RMSNorm backward of the q and k column blocks.
  rmsnorm_weight_grad(qkv.data(), W, d_qkv.data(), W, rq, N, qd, grad_gq);
  rmsnorm_weight_grad(qkv.data() + qd, W, d_qkv.data() + qd, W, rk, N, kd, grad_gk);
  Kokkos::parallel_for(
      "attn::qk_norm_backward", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        for (int part = 0; part < 2; ++part) {
          const int c0 = part == 0 ? 0 : qd, width = part == 0 ? qd : kd;
          const float* g = part == 0 ? gq : gk;
          const float s = part == 0 ? rq(r) : rk(r);
          float dot = 0.0f;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, width),
              [&](int c, float& acc) { acc += g[c] * d_qkv(r, c0 + c) * qkv(r, c0 + c) * s; },
              dot);
          const float mean_dot = dot / width;
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width), [&](int c) {
            d_qkv(r, c0 + c) = s * (g[c] * d_qkv(r, c0 + c) - qkv(r, c0 + c) * s * mean_dot);
          });
          team.team_barrier();
        }
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
  KMOE_REQUIRE(L <= C && L <= int(rope.cos.extent(0)),
               "attention decode: positions up to " << L << " beyond the cache (" << C
                                                    << ") or the RoPE tables");
  const float eps = eps_;
  const bool qk_norm = qk_norm_;
  Workspace::Frame frame(ws);
  Mat qkv = frame.mat(n, W);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, a, table.weight(wq_, W, D_), 0.0f, qkv);

  // Per new row, as forward(): QK-norm over the whole q and k, RoPE at its position; q into
  // (n, H*dh) rows, k and v into the cache.
  Mat q = frame.mat(n, qd);
  auto kc = cache.k, vc = cache.v;
  const NormRope norm_rope{H,  Hkv, dh, eps, qk_norm, qk_norm ? table.param(q_norm_) : nullptr,
                           qk_norm ? table.param(k_norm_) : nullptr, rope.cos, rope.sin};
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
      "attn::decode_softmax_values", team_policy(n * H),
      KOKKOS_LAMBDA(const TeamMember& tm) {
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
