// The tiled attention core (attention_core.hpp's contract): blocked GEMMs over the causal band
// of scores. Queries in tiles of kTile positions; the tile of rows [r0, r0 + rows) reads the keys
// [k0, r0 + rows), k0 its window's first key rounded down to a tile (0 without a window), and
// nothing else is computed or kept: per sequence and query head the probabilities hold
// band_elements(T, window) values instead of T * T. Each product kind (scores, values; dP, dV;
// dQ, dK) is one grouped batch over the tiles and the runs of sequences that skip the same keys.
#pragma once

#include <cstdint>
#include <vector>

#include "core/gemm.hpp"
#include "modules/attention/attention_core.hpp"

namespace kmoe {

class TiledAttention : public AttentionCore {
 public:
  TiledAttention(const RunContext& ctx, const AttentionDims& dims);

  const char* name() const override { return "tiled"; }
  void forward(const AttentionInputs& in, int nseq, const DocStarts& docs, float* heads,
               Workspace& ws) override;
  void backward(const AttentionInputs& in, int nseq, float* d_heads, const std::uint16_t* d_heads16,
                float* d_k, float* d_v, Workspace& ws) override;
  std::int64_t scores_computed() const override { return scores_computed_; }

  static AttentionCoreSizes sizes(const AttentionDims& dims, bool bf16);

  static constexpr int kTile = kAttentionPlanRows;
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

  // One run of one query tile: sequences [s0, s0 + count) whose tile reads no key before
  // k0 + off (off: the run's document start past k0; 0 without a plan). Its products are one
  // strided batch over the run's (sequence, kv head) pairs; the offsets are in elements.
  struct Run {
    const Tile* tile;
    int s0, count, off;
    int m, n;              // the tile's query rows (G * rows) and the keys the run reads (nk - off)
    std::int64_t mk;       // band elements of one (sequence, kv head) block of the tile: m * nk
    std::int64_t band;     // where the run's first block starts in the probabilities (+ off)
    std::int64_t query;    // its first query row in q's layout (and dO's)
    std::int64_t key;      // its first key row in k's and v's layout
    std::int64_t partial;  // its first row in the per-tile key gradients
  };
  // fn(run) for every tile's runs, tiles in order: the one loop the six products share.
  template <class Fn>
  void for_each_run(const Fn& fn) const;

  // The phases of backward(), in order. Public only because a function that launches a device
  // lambda may not be private under nvcc; backward() is the interface.
  // Per run, one grouped batch per product kind: dP = dO v^T; the tile's dV rows P^T dO into
  // `partial` (key_band_ rows of dh per sequence and kv head), then dV = those summed over the
  // tiles in order (sum_key_partials).
  // d_heads16: dO as bf16 (bf16 runs), the operand both products read.
  void probs_values_backward(const AttentionInputs& in, const float* d_heads,
                             const std::uint16_t* d_heads16, float* d_probs, float* partial,
                             float* d_v) const;
  // dS = P * (dP - sum_j P dP) / sqrt(dh) in place (P as kept: R(P) in bf16 runs); with d_s16
  // (bf16 runs) written there as bf16 instead, the copy the products below read.
  void softmax_backward(float* d_probs, std::uint16_t* d_s16) const;
  // Per run, as above: dQ = dS k (over dO in d_heads); the tile's dK rows dS^T q into `partial`,
  // then dK = their sum over the tiles. dS: d_probs, or its bf16 copy d_s16.
  void queries_keys_backward(const AttentionInputs& in, const float* d_probs,
                             const std::uint16_t* d_s16, float* d_heads, float* partial,
                             float* d_k) const;
  // out (nseq, Hkv, T, dh) = for each key, the sum over the tiles that read it, in tile order,
  // of its rows in `partial` (tile i's block of nseq * Hkv * nk * dh at nseq * Hkv *
  // keys_before * dh).
  void sum_key_partials(const float* partial, float* out) const;
  // The masked softmax of the scores into the kept probabilities (forward).
  void causal_softmax(float* scores) const;

 private:
  RunContext ctx_;  // the precision and host threads of its products
  AttentionDims dims_;
  int nseq_ = 0;    // sequences of the call under way
  DocStarts docs_;  // the last forward's
  std::vector<Tile> tiles_;
  // The tiles' before, keys_before and k0 (three arrays of tiles_.size()), on the device.
  Kokkos::View<std::int64_t*, Layout, MemSpace> tile_before_;
  std::int64_t band_ = 0;      // band_elements(T, window)
  std::int64_t key_band_ = 0;  // key_band_elements(T, window)
  // The device pointer tables of the six grouped batches (scores, values; dP, dV; dQ, dK).
  mutable GemmGroupTables tables_[6];
  std::int64_t scores_computed_ = 0;
  // The masked softmax, tile after tile: tile i's (nseq * Hkv) blocks of (G * rows, nk) at
  // nseq * H * before (bf16 in bf16 runs): the core's saved state.
  KeptOperand probs_;
};

}  // namespace kmoe
