// Causal self-attention with QK-norm, RoPE and grouped-query heads (MODEL.md section 1), as
// GEMMs: one fused q|k|v projection, per (sequence, kv-head) score and value GEMMs over the
// kv-head's group of query heads, the output projection.
#pragma once

#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/doc_starts.hpp"
#include "core/gemm.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"
#include "core/workspace.hpp"
#include "modules/attention/rope.hpp"

namespace kmoe {

// One sequence's keys and values so far (generation): (Hkv, capacity, dh) each, after QK-norm
// and RoPE, position p at row p of each kv head.
struct KvCache {
  View1F k, v;
  int capacity = 0;
  KvCache() = default;
  KvCache(const ModelCfg& m, int capacity);
};

// The QK-norm backward (MODEL.md section 1) of the projected rows qkv (N, W: q in columns
// [0, qd), k in [qd, qd + kd)), given d_qkv w.r.t. the normalized q and k: grad_gq, grad_gk +=
// the norm weights' gradients, then d_qkv's q and k columns become the gradients w.r.t. the
// projections, in place. rq, rk: the forward's 1/rms per row; gq, gk: the norm weights.
void qk_norm_backward(ConstMat qkv, Mat d_qkv, int qd, int kd, ConstVec rq, ConstVec rk,
                      const float* gq, const float* gk, Vec grad_gq, Vec grad_gk);

class Attention {
 public:
  // Declares blocks.<l>.attn.{wq,wk,wv,wo,q_norm,k_norm} (wq|wk|wv adjacent: one GEMM).
  // window > 0: position t reads keys (t - window, t] only (model.sliding_window).
  Attention(const RunContext& ctx, const ModelCfg& m, const std::string& prefix, int max_seqs,
            int seq_len, TensorTable& table, int window = 0);

  // a: (N, D) with N = nseq * T  ->  out: (N, D). Position t of a row reads keys
  // [max(docs(row), t - window + 1), t] (docs: train.document_mask; empty: from 0). Saves what
  // backward needs (`docs` must stay valid until then); its temporaries (the head outputs; in
  // bf16 runs the fp32 scores) come from `ws`.
  void forward(const TensorTable& table, const RopeTables& rope, ConstMat a, Mat out,
               Workspace& ws, DocStarts docs = DocStarts());
  // dout: (N, D) -> da: (N, D) (assigned); parameter gradients accumulate. Temporaries from
  // `ws`: dO and dQ (nseq, H, T, dh), dP (the band), dK and dV (nseq, Hkv, T, dh), the merged
  // dO (N, H*dh), then the tiles' key gradients (nseq, Hkv, key_band_elements, dh), then
  // d(q|k|v) (N, (H+2Hkv)*dh).
  void backward(TensorTable& table, const RopeTables& rope, ConstMat a, ConstMat dout, Mat da,
                Workspace& ws);

  // Incremental decoding (generation): a: (n, D), the rows of positions [pos, pos + n) of one
  // sequence whose earlier positions' keys and values `cache` holds -> out: (n, D), what
  // forward() gives those rows of the whole sequence (up to the order of the sums). Their keys
  // and values join the cache; docs(p): the document start of position p, for p < pos + n.
  // Saves nothing for backward; temporaries from `ws`.
  void decode(const TensorTable& table, const RopeTables& rope, ConstMat a, int pos,
              KvCache& cache, Mat out, Workspace& ws, DocStarts docs = DocStarts()) const;

  // The workspace bytes the deepest of the two calls takes, for max_seqs sequences, in a block
  // whose window is `window` (0: none).
  static std::int64_t workspace_bytes(const ModelCfg& m, int max_seqs, int seq_len, bool bf16,
                                      int window = 0);

  // Blocked attention: queries in tiles of kTile positions; the tile of rows [r0, r0 + rows)
  // reads the keys [k0, r0 + rows), k0 its window's first key rounded down to a tile (0
  // without a window), and nothing else is computed or kept: per sequence and query head the
  // probabilities hold band_elements(T, window) values instead of T * T.
  static constexpr int kTile = 64;
  struct Tile {
    int r0, rows, k0, nk;
    std::int64_t before;       // band elements of the tiles before this one (per sequence and head)
    std::int64_t keys_before;  // keys the tiles before this one read (their nk summed)
  };
  static std::vector<Tile> tiles(int T, int window);
  static std::int64_t band_elements(int T, int window);
  // The keys all tiles read (their nk summed): a backward's per-tile key gradients hold
  // key_band_elements(T, window) rows of dh per sequence and kv head.
  static std::int64_t key_band_elements(int T, int window);
  // The score entries the last forward() computed: nseq * H * band_elements(T, window) less
  // the keys before each query tile's document (when `docs` carried the host's tile plan).
  std::int64_t scores_computed() const { return scores_computed_; }

  // The phases of backward(), in order, for its N_ rows. Public only because a function that
  // launches a device lambda may not be private under nvcc; backward() is the interface.
  // dWo += dout^T merged; dO = dout Wo, split into the query layout (d_heads).
  void output_projection_backward(TensorTable& table, ConstMat dout, float* d_heads,
                                  Workspace& ws) const;
  // Per query tile and run of sequences, one grouped batch per product kind: dP = dO v^T; the
  // tile's dV rows P^T dO into `partial` (key_band_ rows of dh per sequence and kv head), then
  // dV = those summed over the tiles in order (sum_key_partials).
  void probs_values_backward(const float* d_heads, float* d_probs, float* partial,
                             float* d_v) const;
  // dS = P * (dP - sum_j P dP) / sqrt(dh) in place (P as kept: R(P) in bf16 runs).
  void softmax_backward(float* d_probs) const;
  // Per query tile and run, as above: dQ = dS k (over dO in d_heads); the tile's dK rows dS^T q
  // into `partial`, then dK = their sum over the tiles.
  void queries_keys_backward(const float* d_probs, float* d_heads, float* partial,
                             float* d_k) const;
  // out (nseq, Hkv, T, dh) = for each key, the sum over the tiles that read it, in tile order,
  // of its rows in `partial` (tile i's block of nseq * Hkv * nk * dh at nseq * Hkv *
  // keys_before * dh).
  void sum_key_partials(const float* partial, float* out) const;
  // Where a run's products (sequences from s0, keys from k0 + off) start in the partials.
  std::int64_t key_partial(const Tile& tl, int s0, int off) const;
  // Back to (N, W) rows: inverse RoPE on dq, dk (gradients w.r.t. the normalized q, k), dv.
  void unrope_merge(const RopeTables& rope, const float* d_heads, const float* d_k,
                    const float* d_v, Mat d_qkv) const;
  // QK-norm: the norm weights' gradients, then the RMSNorm backward of the q and k columns in
  // place.
  void qk_norm_backward(TensorTable& table, Mat d_qkv) const;

 private:
  RunContext ctx_;  // the precision and host threads of its products
  int D_, H_, Hkv_, dh_, T_, window_;
  int N_ = 0;  // rows of the micro-batch backward() runs on
  bool qk_norm_;
  DocStarts docs_;  // the last forward's
  std::vector<Tile> tiles_;
  // The tiles' before, keys_before and k0 (three arrays of tiles_.size()), on the device.
  Kokkos::View<std::int64_t*, Layout, MemSpace> tile_before_;
  std::int64_t band_ = 0;      // band_elements(T, window)
  std::int64_t key_band_ = 0;  // key_band_elements(T, window)
  // The device pointer tables of the six grouped batches (scores, values; dP, dV; dQ, dK).
  mutable GemmGroupTables tables_[6];
  std::int64_t scores_computed_ = 0;
  float eps_;
  int wq_, wo_, q_norm_ = -1, k_norm_ = -1;
  // Saved activations, sized for max_seqs sequences.
  View1F qkv_;              // (N, (H+2Hkv)*dh), before QK-norm
  View1F rstd_q_, rstd_k_;  // (N)
  // After norm and RoPE (bf16 in bf16 runs): q (nseq, Hkv, T, G, dh), the G query heads of a
  // kv head interleaved per position so that a query tile of a kv head's group is one
  // (G * rows, dh) matrix; k, v (nseq, Hkv, T, dh).
  KeptOperand q_, k_, v_;
  // The masked softmax, tile after tile: tile i's (nseq * Hkv) blocks of (G * rows, nk) at
  // nseq * H * before (bf16 in bf16 runs).
  KeptOperand probs_;
  KeptOperand merged_;      // (N, H*dh), heads concatenated (bf16 in bf16 runs)
};

}  // namespace kmoe
