// Causal self-attention with QK-norm, RoPE and grouped-query heads (MODEL.md section 1), as
// GEMMs: one fused q|k|v projection, per (sequence, kv-head) score and value GEMMs over the
// kv-head's group of query heads, the output projection.
#pragma once

#include <string>

#include "core/config.hpp"
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

class Attention {
 public:
  // Declares blocks.<l>.attn.{wq,wk,wv,wo,q_norm,k_norm} (wq|wk|wv adjacent: one GEMM).
  Attention(const ModelCfg& m, const std::string& prefix, int max_seqs, int seq_len,
            TensorTable& table);

  // a: (N, D) with N = nseq * T  ->  out: (N, D). Saves what backward needs; its temporaries
  // (the head outputs; in bf16 runs the fp32 scores) come from `ws`.
  void forward(const TensorTable& table, const RopeTables& rope, ConstMat a, Mat out,
               Workspace& ws);
  // dout: (N, D) -> da: (N, D) (assigned); parameter gradients accumulate. Temporaries from
  // `ws`: dO and dQ (nseq, H, T, dh), dP (nseq, H, T, T), dK and dV (nseq, Hkv, T, dh), the
  // merged dO (N, H*dh) and then d(q|k|v) (N, (H+2Hkv)*dh).
  void backward(TensorTable& table, const RopeTables& rope, ConstMat a, ConstMat dout, Mat da,
                Workspace& ws);

  // Incremental decoding (generation): a: (n, D), the rows of positions [pos, pos + n) of one
  // sequence whose earlier positions' keys and values `cache` holds -> out: (n, D), what
  // forward() gives those rows of the whole sequence (up to the order of the sums). Their keys
  // and values join the cache. Saves nothing for backward; temporaries from `ws`.
  void decode(const TensorTable& table, const RopeTables& rope, ConstMat a, int pos,
              KvCache& cache, Mat out, Workspace& ws) const;

  // The workspace bytes the deepest of the two calls takes, for max_seqs sequences.
  static std::int64_t workspace_bytes(const ModelCfg& m, int max_seqs, int seq_len, bool bf16);

 private:
  int D_, H_, Hkv_, dh_, T_;
  bool qk_norm_;
  float eps_;
  int wq_, wo_, q_norm_ = -1, k_norm_ = -1;
  // Saved activations, sized for max_seqs sequences.
  View1F qkv_;              // (N, (H+2Hkv)*dh), before QK-norm
  View1F rstd_q_, rstd_k_;  // (N)
  KeptOperand q_, k_, v_;   // (nseq, H|Hkv, T, dh), after norm and RoPE (bf16 in bf16 runs)
  KeptOperand probs_;       // (nseq, H, T, T), causal softmax (bf16 in bf16 runs)
  KeptOperand merged_;      // (N, H*dh), heads concatenated (bf16 in bf16 runs)
};

}  // namespace kmoe
