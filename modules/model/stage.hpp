// A pipeline stage: the contiguous run of blocks this rank owns, plus the embedding on the
// first stage and the final norm, LM head and loss on the last. With pp = 1 it is the whole
// model. forward() keeps every block's activations for backward() of the same micro-batch.
#pragma once

#include <memory>
#include <vector>

#include "modules/embedding/embedding.hpp"
#include "modules/loss/lm_head.hpp"
#include "modules/model/block.hpp"

namespace kmoe {

class Stage {
 public:
  // Declares every tensor of blocks [first_block, last_block) into `table` (plus embedding and
  // head); buffers are sized for micro-batches of up to max_seqs sequences of seq_len tokens.
  Stage(const ModelCfg& m, const MoeCfg& e, int max_seqs, int seq_len, TensorTable& table,
        const EngramCfg& g = EngramCfg());

  // Each Engram block's layer: (block index, layer), for metrics.
  std::vector<std::pair<int, const EngramLayer*>> engram_layers() const;

  // tokens: host ids of nseq <= max_seqs sequences (nseq * T). grad_scale > 0 prepares
  // backward() for this micro-batch's loss with weight grad_scale * targets in the step loss
  // (CE gradients scaled by grad_scale, MoE auxiliary losses by grad_scale * targets).
  LossSums forward(const TensorTable& table, const std::int32_t* tokens, int nseq,
                   float grad_scale);
  // Accumulates parameter gradients of the last forward()'s micro-batch.
  void backward(TensorTable& table);

  // Each MoE block's routing of the last forward(): (block index, (N*k) expert ids).
  std::vector<std::pair<int, ConstIVec>> moe_routes() const;
  int top_k() const { return top_k_; }

 private:
  Mat resid(int i, int N) { return as_mat(resid_[i].data(), N, D_); }

  int D_, T_, max_seqs_;
  RopeTables rope_;
  EngramCompression compression_;  // before blocks_: their Engram plans depend on it
  Embedding embed_;
  std::vector<std::unique_ptr<Block>> blocks_;
  LmHead head_;
  BlockScratch scratch_;
  View1I tokens_;                 // (max_seqs * T) device copy of the ids
  View1I compress_, compressed_;  // Engram: (V) canonical ids, (max_seqs * T) compressed ids
  std::vector<View1F> resid_;     // L+1 residual streams (N, D): block inputs and the output
  View1F d_x_, d_y_;              // (N, D) backward ping-pong
  int nseq_ = 0;
  float aux_scale_ = 0.0f;
  double lb_coef_, z_coef_;
  int top_k_;
};

}  // namespace kmoe
