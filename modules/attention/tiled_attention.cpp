#include "modules/attention/tiled_attention.hpp"

#include <algorithm>
#include <cmath>

#include "core/device_sync.hpp"
#include "core/error.hpp"

namespace kmoe {

std::vector<TiledAttention::Tile> TiledAttention::tiles(int T, int window) {
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

std::int64_t TiledAttention::band_elements(int T, int window) {
  const Tile last = tiles(T, window).back();
  return last.before + std::int64_t(last.rows) * last.nk;
}

std::int64_t TiledAttention::key_band_elements(int T, int window) {
  const Tile last = tiles(T, window).back();
  return last.keys_before + last.nk;
}

AttentionCoreSizes TiledAttention::sizes(const AttentionDims& d, bool bf16) {
  // The probabilities (kept: bf16 in bf16 runs; the fp32 scores and dP in the workspace), the
  // per-tile key gradients.
  const Size band = Size(d.max_seqs) * d.H * band_elements(d.T, d.window);
  const Size probs = Workspace::rounded((Size(4) * band).get());
  const Size partials = Workspace::rounded(
      (Size(4) * d.max_seqs * d.Hkv * d.dh * key_band_elements(d.T, d.window)).get());
  AttentionCoreSizes s;
  s.saved = Size(bf16 ? 2 : 4) * band;
  s.forward_workspace = bf16 ? probs : Size(0);
  // bf16 runs: dS as bf16 beside the fp32 dP.
  s.backward_workspace = probs + partials + (bf16 ? Workspace::rounded((Size(2) * band).get()) : 0);
  return s;
}

TiledAttention::TiledAttention(const RunContext& ctx, const AttentionDims& dims)
    : ctx_(ctx.unpooled()), dims_(dims) {
  tiles_ = tiles(dims.T, dims.window);
  band_ = band_elements(dims.T, dims.window);
  key_band_ = key_band_elements(dims.T, dims.window);
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
  probs_ =
      KeptOperand(ctx, "attn::probs", static_cast<std::int64_t>(dims.max_seqs) * dims.H * band_);
}

template <class Fn>
void TiledAttention::for_each_run(const Fn& fn) const {
  // A tile's sequences in runs that skip the same keys (train.document_mask, planned on the host
  // from the ids), as one strided batch each with rows `nk` apart.
  const int nseq = nseq_, Hkv = dims_.Hkv, T = dims_.T, G = dims_.G(), dh = dims_.dh;
  const bool plan = docs_.tile_start != nullptr && gemm_rows_apart();
  for (std::size_t i = 0; i < tiles_.size(); ++i) {
    const Tile& tl = tiles_[i];
    auto off = [&](int s) {
      return plan ? std::max(0, docs_.tile_start[std::size_t(s) * docs_.tiles + i] - tl.k0) : 0;
    };
    Run r;
    r.tile = &tl;
    r.m = G * tl.rows;
    r.mk = std::int64_t(r.m) * tl.nk;
    for (int s0 = 0; s0 < nseq;) {
      const int o = off(s0);
      int s1 = s0 + 1;
      while (s1 < nseq && off(s1) == o) ++s1;
      r.s0 = s0;
      r.count = s1 - s0;
      r.off = o;
      r.n = tl.nk - o;
      r.band = std::int64_t(nseq) * dims_.H * tl.before + std::int64_t(s0) * Hkv * r.mk + o;
      r.query = (std::int64_t(s0) * Hkv * T + tl.r0) * G * dh;
      r.key = (std::int64_t(s0) * Hkv * T + tl.k0 + o) * dh;
      r.partial =
          (std::int64_t(nseq) * Hkv * tl.keys_before + std::int64_t(s0) * Hkv * tl.nk + o) * dh;
      fn(r);
      s0 = s1;
    }
  }
}

namespace {

// The first element of a strided operand moved by `offset` elements.
Strided shifted(Strided x, std::int64_t offset) {
  if (x.data) x.data += offset;
  if (x.b16) x.b16 += offset;
  return x;
}

// A row of the band: which tile, sequence, head and position the league index `r` of a kernel
// over all nseq * H * T rows of the probabilities is, and where its nk values start. Rows come
// tile after tile; within a tile, (sequence, kv head) blocks of G * rows rows, each position's
// G heads adjacent. lo, hi: the row's keys (causal, document, window) as offsets from k0.
struct BandRow {
  int s, t, k0, nk, lo, hi;
  std::int64_t start;
};
KOKKOS_INLINE_FUNCTION BandRow band_row(int r, int nseq, int H, int Hkv, int G, int T, int window,
                                        const std::int64_t* before, const DocStarts& docs) {
  constexpr int kTile = TiledAttention::kTile;
  const int tile_rows = nseq * H * kTile;  // league rows of one full tile
  const int nt = (T + kTile - 1) / kTile;
  int i = r / tile_rows;
  if (i > nt - 1) i = nt - 1;
  const int r0 = i * kTile;
  const int rows = T - r0 < kTile ? T - r0 : kTile;
  const int local = r - nseq * H * r0;  // rows before this tile: nseq * H * r0
  const int block = local / (G * rows), rr = local % (G * rows);
  BandRow b;
  b.s = block / Hkv;
  b.t = r0 + rr / G;
  const int first = window > 0 && r0 - window + 1 > 0 ? r0 - window + 1 : 0;
  b.k0 = first / kTile * kTile;
  b.nk = r0 + rows - b.k0;
  b.start = std::int64_t(nseq) * H * before[i] + std::int64_t(local) * b.nk;
  b.lo = first_key(b.t, docs(b.s * T + b.t), window) - b.k0;
  b.hi = b.t - b.k0;
  return b;
}

// One band row of the masked softmax backward in place: g = P * (g - sum_j P g) * scale over
// its entries [lo, hi] (keys lo + k0 .. hi + k0), 0 elsewhere of its nk, with P as kept (fp32
// or bf16 pointer, row start applied).
// The result goes to `out`: g itself (in place), or a bf16 row.
template <class P, class Out>
KOKKOS_INLINE_FUNCTION void softmax_row_backward(const TeamMember& tm, int lo, int hi, int nk, P pr,
                                                 float* g, Out out, float scale) {
  float dot = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::TeamThreadRange(tm, lo, hi + 1),
      [&](int j, float& s) { s += kept_load(pr, j) * g[j]; }, dot);
  tm.team_barrier();  // every read of g before the first write
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nk), [&](int j) {
    kept_store(out, j, j >= lo && j <= hi ? kept_load(pr, j) * (g[j] - dot) * scale : 0.0f);
  });
}

}  // namespace

void TiledAttention::forward(const AttentionInputs& in, int nseq, const DocStarts& docs,
                             float* heads, Workspace& ws) {
  Workspace::Frame frame(ws);
  nseq_ = nseq;
  docs_ = docs;
  const int T = dims_.T, Hkv = dims_.Hkv, dh = dims_.dh, G = dims_.G();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const std::int64_t Tdh = std::int64_t(T) * dh, TGdh = Tdh * G;
  KMOE_REQUIRE(!docs.tile_start ||
                   (docs.tile_rows == kTile && docs.tiles == static_cast<int>(tiles_.size())),
               "attention: a document plan of " << docs.tiles << " tiles of " << docs.tile_rows
                                                << " rows for " << tiles_.size() << " of "
                                                << kTile);
  // Per run: scores (G*rows, nk) = q_tile k_range^T / sqrt(dh) for every (sequence, kv head),
  // into the kept probabilities (fp32 runs: the softmax works in place) or a workspace buffer
  // (bf16 runs: the softmax rounds the probabilities into the kept bf16 buffer). Keys a run
  // skips stay unwritten: no row of it reads them.
  const std::int64_t band = std::int64_t(nseq) * dims_.H * band_;
  float* scores = probs_.product_target(probs_.is_bf16() ? frame.floats(band) : nullptr);
  const Strided qs = in.q.strided(0, 0, 0), ks = in.k.strided(0, 0, 0);
  scores_computed_ = 0;
  std::vector<GemmGroup> groups;
  for_each_run([&](const Run& r) {
    groups.push_back({shifted({qs.data, r.m, dh, TGdh, qs.b16}, r.query),
                      shifted({ks.data, r.n, dh, Tdh, ks.b16}, r.key), scores + r.band, r.m, r.n,
                      r.mk, r.count * Hkv, r.tile->nk});
    scores_computed_ += std::int64_t(r.count) * Hkv * r.m * r.n;
  });
  gemm_grouped_batched(ctx_, Trans::N, Trans::T, scale, 0.0f, groups, tables_[0]);
  causal_softmax(scores);

  // Per run: heads (G*rows, dh) = P_tile v_range, into the query layout; a run reads the
  // probabilities and values of its keys only.
  const Strided ps = probs_.strided(0, 0, 0), vs = in.v.strided(0, 0, 0);
  groups.clear();
  for_each_run([&](const Run& r) {
    groups.push_back({shifted({ps.data, r.m, r.n, r.mk, ps.b16, r.tile->nk}, r.band),
                      shifted({vs.data, r.n, dh, Tdh, vs.b16}, r.key), heads + r.query, r.m, dh,
                      TGdh, r.count * Hkv});
  });
  gemm_grouped_batched(ctx_, Trans::N, Trans::N, 1.0f, 0.0f, groups, tables_[1]);
}

void TiledAttention::causal_softmax(float* scores) const {
  // Masked softmax over each band row's keys [lo, t] (causal, document, window), one team per
  // row, its threads over the keys (on CPUs a one-thread team: the exp loop is branch-free,
  // exp_poly, and vectorizes; the max and the sum run in key order).
  const int nseq = nseq_, H = dims_.H, Hkv = dims_.Hkv, G = dims_.G(), T = dims_.T;
  const KeptOut p = probs_.out();
  const int window = dims_.window;
  const DocStarts docs = docs_;
  const std::int64_t* before = tile_before_.data();
  Kokkos::parallel_for(
      "attn::causal_softmax", row_policy(nseq * H * T), KOKKOS_LAMBDA(const TeamMember& tm) {
        const BandRow b = band_row(tm.league_rank(), nseq, H, Hkv, G, T, window, before, docs);
        const int lo = b.lo, hi = b.hi;
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
}

void TiledAttention::backward(const AttentionInputs& in, int nseq, float* d_heads,
                              const std::uint16_t* d_heads16, float* d_k, float* d_v,
                              Workspace& ws) {
  nseq_ = nseq;
  Workspace::Frame frame(ws);
  const std::int64_t band = std::int64_t(nseq) * dims_.H * band_;
  float* d_probs = frame.floats(band);
  float* partial = frame.floats(std::int64_t(nseq) * dims_.Hkv * dims_.dh * key_band_);
  // bf16 runs: the softmax backward writes dS as bf16, the operand of its two products.
  std::uint16_t* d_s16 = probs_.is_bf16() ? frame.words(band) : nullptr;
  probs_values_backward(in, d_heads, d_heads16, d_probs, partial, d_v);
  softmax_backward(d_probs, d_s16);
  queries_keys_backward(in, d_probs, d_s16, d_heads, partial, d_k);
}

void TiledAttention::probs_values_backward(const AttentionInputs& in, const float* d_heads,
                                           const std::uint16_t* d_heads16, float* d_probs,
                                           float* partial, float* d_v) const {
  const int Hkv = dims_.Hkv, dh = dims_.dh;
  const std::int64_t Tdh = std::int64_t(dims_.T) * dh, TGdh = Tdh * dims_.G();
  // Per run (as forward()): dP = dO_tile v_range^T, one grouped batch; the tile's dv_range =
  // P_tile^T dO_tile (summed over the group's heads by the GEMM itself) into its own key
  // partials, one grouped batch, then summed over the tiles in order.
  const Strided ps = probs_.strided(0, 0, 0), vs = in.v.strided(0, 0, 0);
  std::vector<GemmGroup> scores, values;
  bool skipped = false;  // keys a run skips: their partial rows are never written
  for_each_run([&](const Run& r) {
    const Strided d_out =
        shifted({d_heads16 ? nullptr : d_heads, r.m, dh, TGdh, d_heads16}, r.query);
    scores.push_back({d_out, shifted({vs.data, r.n, dh, Tdh, vs.b16}, r.key), d_probs + r.band, r.m,
                      r.n, r.mk, r.count * Hkv, r.tile->nk});
    values.push_back({shifted({ps.data, r.m, r.n, r.mk, ps.b16, r.tile->nk}, r.band), d_out,
                      partial + r.partial, r.n, dh, std::int64_t(r.tile->nk) * dh, r.count * Hkv});
    skipped = skipped || r.off > 0;
  });
  gemm_grouped_batched(ctx_, Trans::N, Trans::T, 1.0f, 0.0f, scores, tables_[2]);
  if (skipped)
    Kokkos::deep_copy(ExecSpace(), Vec(partial, std::int64_t(nseq_) * Hkv * dh * key_band_), 0.0f);
  gemm_grouped_batched(ctx_, Trans::T, Trans::N, 1.0f, 0.0f, values, tables_[3]);
  sum_key_partials(partial, d_v);
}

void TiledAttention::sum_key_partials(const float* partial, float* out) const {
  const int T = dims_.T, nseq = nseq_, Hkv = dims_.Hkv, dh = dims_.dh;
  const int nt = static_cast<int>(tiles_.size());
  const std::int64_t* keys_before = tile_before_.data() + nt;
  const std::int64_t* k0 = tile_before_.data() + 2 * nt;
  // Key t of a (sequence, kv head) block: the tiles from t's own to the last that reads it,
  // summed in tile order.
  Kokkos::parallel_for(
      "attn::sum_key_partials", Range2({0, 0}, {nseq * Hkv * T, dh}), KOKKOS_LAMBDA(int r, int c) {
        const int block = r / T, t = r % T;
        float sum = 0.0f;
        for (int i = t / kTile; i < nt && k0[i] <= t; ++i) {
          const int nk = (T - i * kTile < kTile ? T : (i + 1) * kTile) - int(k0[i]);
          sum += partial[(std::int64_t(nseq) * Hkv * keys_before[i] + std::int64_t(block) * nk +
                          (t - k0[i])) *
                             dh +
                         c];
        }
        out[std::int64_t(r) * dh + c] = sum;
      });
}

void TiledAttention::softmax_backward(float* d_probs, std::uint16_t* d_s16) const {
  const int T = dims_.T, nseq = nseq_, H = dims_.H, Hkv = dims_.Hkv, G = dims_.G();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dims_.dh));
  const DocStarts docs = docs_;
  // Softmax backward in place: dS = P * (dP - sum_j P dP) * scale (P as kept: R(P) in bf16).
  const KeptIn p = probs_.in();
  const int window = dims_.window;
  const std::int64_t* before = tile_before_.data();
  Kokkos::parallel_for(
      "attn::softmax_backward", row_policy(nseq * H * T), KOKKOS_LAMBDA(const TeamMember& tm) {
        const BandRow b = band_row(tm.league_rank(), nseq, H, Hkv, G, T, window, before, docs);
        float* g = d_probs + b.start;
        if (p.b16 && d_s16)
          softmax_row_backward(tm, b.lo, b.hi, b.nk, p.b16 + b.start, g, d_s16 + b.start, scale);
        else if (p.b16)
          softmax_row_backward(tm, b.lo, b.hi, b.nk, p.b16 + b.start, g, g, scale);
        else
          softmax_row_backward(tm, b.lo, b.hi, b.nk, p.f32 + b.start, g, g, scale);
      });
}

void TiledAttention::queries_keys_backward(const AttentionInputs& in, const float* d_probs,
                                           const std::uint16_t* d_s16, float* d_heads,
                                           float* partial, float* d_k) const {
  const int Hkv = dims_.Hkv, dh = dims_.dh;
  const std::int64_t Tdh = std::int64_t(dims_.T) * dh, TGdh = Tdh * dims_.G();
  const Strided qs = in.q.strided(0, 0, 0), ks = in.k.strided(0, 0, 0);
  // Per run, one grouped batch each: dq_tile = dS k_range (overwrites dO, no longer needed);
  // the tile's dk_range = dS^T q_tile into its key partials (whose skipped rows
  // probs_values_backward left zero), then summed over the tiles in order.
  std::vector<GemmGroup> queries, keys;
  for_each_run([&](const Run& r) {
    const Strided d_s =
        shifted({d_s16 ? nullptr : d_probs, r.m, r.n, r.mk, d_s16, r.tile->nk}, r.band);
    queries.push_back({d_s, shifted({ks.data, r.n, dh, Tdh, ks.b16}, r.key), d_heads + r.query, r.m,
                       dh, TGdh, r.count * Hkv});
    keys.push_back({d_s, shifted({qs.data, r.m, dh, TGdh, qs.b16}, r.query), partial + r.partial,
                    r.n, dh, std::int64_t(r.tile->nk) * dh, r.count * Hkv});
  });
  gemm_grouped_batched(ctx_, Trans::N, Trans::N, 1.0f, 0.0f, queries, tables_[4]);
  gemm_grouped_batched(ctx_, Trans::T, Trans::N, 1.0f, 0.0f, keys, tables_[5]);
  sum_key_partials(partial, d_k);
}

}  // namespace kmoe
