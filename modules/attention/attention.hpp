// Causal self-attention with QK-norm, RoPE and grouped-query heads (MODEL.md section 1): one
// fused q|k|v projection, QK-norm + RoPE + the split into the head layout, the attention core
// (attention_core.hpp: one contract, a path per file, chosen in choose_attention_path), the head
// merge and the output projection.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/doc_starts.hpp"
#include "core/gemm.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"
#include "core/workspace.hpp"
#include "modules/attention/attention_core.hpp"
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
// d_qkv16 (bf16 runs): where the new q and k columns are also written rounded to bf16 (row
// stride W), the copy the products read.
void qk_norm_backward(ConstMat qkv, Mat d_qkv, int qd, int kd, ConstVec rq, ConstVec rk,
                      const float* gq, const float* gk, Vec grad_gq, Vec grad_gk,
                      std::uint16_t* d_qkv16 = nullptr);

class Attention {
 public:
  // Declares blocks.<l>.attn.{wq,wk,wv,wo,q_norm,k_norm} (wq|wk|wv adjacent: one GEMM).
  // window > 0: position t reads keys (t - window, t] only (model.sliding_window).
  Attention(const RunContext& ctx, const ModelCfg& m, const std::string& prefix, int max_seqs,
            int seq_len, TensorTable& table, int window = 0);

  // a: (N, D) with N = nseq * T  ->  out: (N, D). Position t of a row reads keys
  // [max(docs(row), t - window + 1), t] (docs: train.document_mask; empty: from 0). Saves what
  // backward needs (`docs` must stay valid until then); its temporaries (the head outputs and
  // the core's) come from `ws`. a: fp32, or bf16 in bf16 runs (read only by products).
  void forward(const TensorTable& table, const RopeTables& rope, const Operand& a, Mat out,
               Workspace& ws, DocStarts docs = DocStarts());
  void forward(const TensorTable& table, const RopeTables& rope, ConstMat a, Mat out, Workspace& ws,
               DocStarts docs = DocStarts()) {
    forward(table, rope, operand(a), out, ws, docs);
  }
  // dout: (N, D) -> da: (N, D) (assigned); parameter gradients accumulate. Temporaries from
  // `ws`: dO and dQ (nseq, H, T, dh), dK and dV (nseq, Hkv, T, dh), then the merged dO (N,
  // H*dh), then the core's backward, then d(q|k|v) (N, (H+2Hkv)*dh). a (forward's input) and
  // dout: fp32, or bf16 in bf16 runs (they are read only by products).
  void backward(TensorTable& table, const RopeTables& rope, const Operand& a, const Operand& dout,
                Mat da, Workspace& ws);
  void backward(TensorTable& table, const RopeTables& rope, ConstMat a, ConstMat dout, Mat da,
                Workspace& ws) {
    backward(table, rope, operand(a), operand(dout), da, ws);
  }

  // Incremental decoding (generation): a: (n, D), the rows of positions [pos, pos + n) of one
  // sequence whose earlier positions' keys and values `cache` holds -> out: (n, D), what
  // forward() gives those rows of the whole sequence (up to the order of the sums). Their keys
  // and values join the cache; docs(p): the document start of position p, for p < pos + n.
  // Saves nothing for backward; temporaries from `ws`.
  void decode(const TensorTable& table, const RopeTables& rope, ConstMat a, int pos, KvCache& cache,
              Mat out, Workspace& ws, DocStarts docs = DocStarts()) const;

  // The workspace bytes the deepest of the two calls takes, for max_seqs sequences, in a block
  // whose window is `window` (0: none): the projections' and the core's.
  static std::int64_t workspace_bytes(const ModelCfg& m, int max_seqs, int seq_len, bool bf16,
                                      int window, AttentionKernel kernel);
  // The core's dimensions for max_seqs sequences of seq_len positions.
  static AttentionDims core_dims(const ModelCfg& m, int max_seqs, int seq_len, int window);

  // The core the block's attention runs on (attention_core.hpp), and its path's name.
  const AttentionCore& core() const { return *core_; }
  // The score entries the last forward() computed (the tiled core: nseq * H *
  // band_elements(T, window) less the keys before each query tile's document when `docs`
  // carried the host's tile plan).
  std::int64_t scores_computed() const { return core_->scores_computed(); }

  // The phases of backward() around the core. Public only because a function that launches a
  // device lambda may not be private under nvcc; backward() is the interface.
  // dWo += dout^T merged; dO = dout Wo, split into the query layout (d_heads).
  // d_heads16 (bf16 runs): dO also rounded, or nullptr.
  void output_projection_backward(TensorTable& table, const Operand& dout, float* d_heads,
                                  std::uint16_t* d_heads16, Workspace& ws) const;
  // QK-norm: the norm weights' gradients, from dq and dk through the inverse RoPE (the
  // gradients w.r.t. the norms' outputs), before unrope_merge overwrites them.
  void qk_norm_weight_grads(TensorTable& table, const RopeTables& rope, const float* d_heads,
                            const float* d_k) const;
  // Back to (N, W) rows in one kernel: inverse RoPE on dq, dk (gradients w.r.t. the normalized
  // q, k), dv; with QK-norm then the RMSNorm backward of the q and k columns in place. d_qkv16
  // (bf16 runs): every column also rounded.
  void unrope_merge(const TensorTable& table, const RopeTables& rope, const float* d_heads,
                    const float* d_k, const float* d_v, Mat d_qkv, std::uint16_t* d_qkv16) const;

 private:
  // QK-norm + RoPE of a projected row (rope.hpp) with this layer's norm weights.
  NormRope norm_rope_of(const TensorTable& table, const RopeTables& rope) const;

  RunContext ctx_;  // the precision and host threads of its products
  int D_, H_, Hkv_, dh_, T_, window_;
  int N_ = 0;  // rows of the micro-batch backward() runs on
  bool qk_norm_;
  float eps_;
  int wq_, wo_, q_norm_ = -1, k_norm_ = -1;
  std::unique_ptr<AttentionCore> core_;
  // Saved activations, sized for max_seqs sequences.
  View1F qkv_;              // (N, (H+2Hkv)*dh), before QK-norm
  View1F rstd_q_, rstd_k_;  // (N)
  // The core's inputs, after norm and RoPE (bf16 in bf16 runs): q (nseq, Hkv, T, G, dh), k, v
  // (nseq, Hkv, T, dh) (attention_core.hpp).
  KeptOperand q_, k_, v_;
  KeptOperand merged_;  // (N, H*dh), heads concatenated (bf16 in bf16 runs)
};

}  // namespace kmoe
