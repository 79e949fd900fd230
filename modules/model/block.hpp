// One transformer block (MODEL.md section 1), in either norm order:
//   reordered (OLMo2): h = x + norm_attn(attn(x));  out = h + norm_ffn(ffn(h))
//   pre (Llama):       h = x + attn(norm_attn(x));  out = h + ffn(norm_ffn(h))
#pragma once

#include <memory>
#include <string>

#include "modules/attention/attention.hpp"
#include "modules/engram/engram.hpp"
#include "modules/mlp/swiglu.hpp"
#include "modules/moe/moe.hpp"
#include "parallel/layer_comms.hpp"

namespace kmoe {

// What generation keeps of one sequence in a block: the attention's keys and values and, in a
// block with Engram, the block's input rows (Engram's output at a position reads a window of
// earlier positions, EngramLayer::context(), recomputed from them).
struct BlockCache {
  KvCache kv;
  View1F inputs;  // (capacity, D), Engram blocks only
};

// What the blocks of a rank share from call to call (every block of every Stage instance).
struct BlockScratch {
  // The temporaries of every layer call: a block's backward takes the gradients that pass
  // between its layers, d_h, d_a, d_b (N, D) and, with Engram, d_engram (N, D), the gradient
  // w.r.t. x + Engram(x); each layer takes its own on top (core/workspace.hpp).
  Workspace work{"block::workspace"};
  // The micro-batch's MoE loss terms (lb_coef * LB + z_coef * RZ), summed on the device by the
  // MoE blocks' forwards in block order; the stage zeroes it before the first.
  View1D moe_aux{"block::moe_aux", 1};
};

class Block {
 public:
  // The FFN is an MoE layer when e.is_moe_layer(layer), else the dense SwiGLU MLP. With an
  // Engram plan for this block, x + Engram(x, tokens) enters the block instead of x.
  // With `stats`, its MoE and Engram layers add their statistics there.
  // Its layers compute in ctx's precision and take their saved buffers from ctx's pool (the
  // caller begins the pool's block first).
  Block(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e, const EngramCfg& g,
        const EngramHashPlan* plan, int layer, int max_seqs, int seq_len, TensorTable& table,
        const LayerComms& comms = LayerComms(), StepStats* stats = nullptr);

  // x_in, x_out: (N, D); tokens: (N) ids (Engram); docs: document starts (train.document_mask;
  // valid until backward). Saves what backward needs (x_in itself is kept by the caller).
  // count = false: the recompute of a forward already run (statistics and the MoE loss terms
  // were counted then). x16_written: the kernel that produced x_in also wrote it rounded into
  // input16() (else the block rounds it there itself). x_out16: where the block's last kernel
  // also writes x_out rounded (the next block's input16()), or nullptr.
  void forward(const TensorTable& table, const RopeTables& rope, ConstMat x_in, ConstIVec tokens,
               Mat x_out, BlockScratch& s, bool count = true, DocStarts docs = DocStarts(),
               bool x16_written = false, std::uint16_t* x_out16 = nullptr);
  // bf16 runs, reordered norm, no Engram: where the block keeps its input rounded to bf16 for
  // the attention's two products on it, for the kernel that produces the input to write (the
  // embedding, the previous block's final norm). nullptr where the block makes that copy itself
  // (pre-norm: its norm; Engram: the sum x + Engram(x)) or needs none (fp32).
  std::uint16_t* input16() const { return reordered_ && !engram_ ? attn_in16_out() : nullptr; }
  // Incremental decoding (generation): x_in: (n, D) rows of positions [pos, pos + n) of one
  // sequence whose earlier positions `cache` holds; tokens: its compressed ids at positions
  // [0, pos + n) (Engram); docs: the document starts of positions [0, pos + n) -> x_out:
  // (n, D), as forward() computes those rows (MoE dropless when the layer was built without a
  // capacity). Counts nothing.
  void decode(const TensorTable& table, const RopeTables& rope, ConstMat x_in, ConstIVec tokens,
              int pos, BlockCache& cache, Mat x_out, BlockScratch& s, DocStarts docs = DocStarts());
  BlockCache new_cache(const ModelCfg& m, int capacity) const;

  // dx_out -> dx_in (assigned; may not alias dx_out); parameter gradients accumulate.
  // aux_scale: the weight of this micro-batch's MoE auxiliary losses in the step loss.
  // bf16 runs: dx_out16, dx_out's bf16 copy where its producer wrote one (else the block rounds
  // it itself where wants_dx_out16()); dx_in16, where the block's last kernel also writes dx_in
  // rounded (the previous block's dx_out16), or nullptr.
  void backward(TensorTable& table, const RopeTables& rope, ConstMat x_in, ConstMat dx_out,
                Mat dx_in, BlockScratch& s, float aux_scale,
                const std::uint16_t* dx_out16 = nullptr, std::uint16_t* dx_in16 = nullptr);
  // bf16 runs, pre-norm, dense MLP: the MLP's products read dx_out as it is, so they take it
  // as bf16.
  bool wants_dx_out16() const { return bf16_ && !reordered_ && mlp_ != nullptr; }

  // The workspace bytes block `layer`'s calls take at most (with an Engram layer when
  // `engram`), for max_seqs sequences, an ep group of `ep` ranks, in ctx's precision (bf16 or
  // fp32 kept operands) and host threads.
  static std::int64_t workspace_bytes(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e,
                                      const EngramCfg& g, int layer, bool engram, int max_seqs,
                                      int seq_len, int ep);

  bool is_moe() const { return moe_ != nullptr; }
  // The lowest table index among the block's tensors (declared first: attn_norm.weight).
  int first_tensor() const { return attn_norm_; }
  const MoeLayer* moe() const { return moe_.get(); }
  ConstIVec moe_routes() const { return moe_->selected(); }

  // The block's Engram layer, or nullptr.
  EngramLayer* engram() const { return engram_.get(); }
  // Step hooks (Stage::finish_step, Stage::after_optimizer_step).
  void finish_step(StepStats& stats, const DataComm& stage_replicas,
                   const Communicator& stage_replicas_mpi, bool write) const;
  void after_optimizer_step(TensorTable& table, const StepStats& stats) const;

 private:
  Mat buf(const View1F& v, int rows) const { return as_mat(v.data(), rows, D_); }
  // The dense MLP's input as its products read it: in, or (bf16 runs) the copy in mlp_in16_.
  Operand mlp_input(ConstMat in, bool kept) const;
  std::uint16_t* mlp_in16_out() const { return mlp_in16_.is_bf16() ? mlp_in16_.b16() : nullptr; }
  // The attention's input as its products read it: in, or (bf16 runs) the copy in attn_in16_.
  Operand attn_input(ConstMat in) const {
    return attn_in16_.is_bf16() ? attn_in16_.matrix(in.extent(0), D_) : operand(in);
  }
  std::uint16_t* attn_in16_out() const { return attn_in16_.is_bf16() ? attn_in16_.b16() : nullptr; }
  void ffn_forward(const TensorTable& table, ConstMat in, Mat out, BlockScratch& s, bool count,
                   bool kept = false);
  // dy16: dy's bf16 copy where the caller's kernel wrote one (the dense MLP reads dy only in
  // products; an MoE layer reads it in fp32).
  void ffn_backward(TensorTable& table, ConstMat in, ConstMat dy, const std::uint16_t* dy16, Mat dx,
                    BlockScratch& s, float aux_scale);

  int D_;
  bool reordered_;
  bool bf16_;  // the run's precision: bf16 copies of the gradients products read
  float eps_;
  int attn_norm_, ffn_norm_;
  Attention attn_;
  std::unique_ptr<SwigluMlp> mlp_;  // exactly one of mlp_ and moe_
  std::unique_ptr<MoeLayer> moe_;
  std::unique_ptr<EngramLayer> engram_;
  View1F x_engram_;  // (N, D): x + Engram(x), the attention input of an Engram block
  // Saved (N, D): attn_in/ffn_in (pre only: the normed inputs), attn_out, h, ffn_out; rstds (N).
  View1F attn_in_, attn_out_, h_, ffn_in_, ffn_out_;
  View1F rstd_attn_, rstd_ffn_;
  // bf16 runs, dense MLP: the MLP's input (h, or ffn_in with pre-norm) as bf16, written by the
  // norm that makes it, read by the MLP's two products on it.
  KeptOperand mlp_in16_;
  // bf16 runs: the attention's input (the block input, x + Engram(x), or attn_in with pre-norm)
  // as bf16, written by the kernel that makes it, read by the QKV product and its weight
  // gradient.
  KeptOperand attn_in16_;
};

}  // namespace kmoe
