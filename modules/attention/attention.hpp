// Causal self-attention with QK-norm, RoPE and grouped-query heads (MODEL.md section 1), as
// GEMMs: one fused q|k|v projection, per (sequence, kv-head) score and value GEMMs over the
// kv-head's group of query heads, the output projection.
#pragma once

#include <string>

#include "core/config.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"
#include "modules/attention/rope.hpp"

namespace kmoe {

// Backward temporaries, shared by every attention layer of a stage.
struct AttentionScratch {
  View1F d_merged;  // (N, H*dh)
  View1F d_heads;   // (nseq, H, T, dh): forward head outputs; backward dO, then dQ
  View1F d_probs;   // (nseq, H, T, T); in bf16 runs the forward's fp32 scores too
  View1F d_k, d_v;  // (nseq, Hkv, T, dh)
  View1F d_qkv;     // (N, (H+2Hkv)*dh)
  AttentionScratch(const ModelCfg& m, int max_seqs, int seq_len);
};

class Attention {
 public:
  // Declares blocks.<l>.attn.{wq,wk,wv,wo,q_norm,k_norm} (wq|wk|wv adjacent: one GEMM).
  Attention(const ModelCfg& m, const std::string& prefix, int max_seqs, int seq_len,
            TensorTable& table);

  // a: (N, D) with N = nseq * T  ->  out: (N, D). Saves what backward needs.
  void forward(const TensorTable& table, const RopeTables& rope, ConstMat a, Mat out,
               AttentionScratch& s);
  // dout: (N, D) -> da: (N, D) (assigned); parameter gradients accumulate.
  void backward(TensorTable& table, const RopeTables& rope, ConstMat a, ConstMat dout, Mat da,
                AttentionScratch& s);

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
