// A pipeline stage: the contiguous run of blocks this rank owns, plus the embedding on the
// first stage and the final norm, LM head and loss on the last. With pp = 1 it is the whole
// model. forward() keeps every block's activations for backward() of the same micro-batch; a
// pipeline schedule with several micro-batches in flight uses one Stage instance per
// micro-batch in flight, all on the same parameters in the TensorTable (declared again after
// TensorTable::allocate, a tensor is the existing one) and the same StepStats.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "modules/embedding/embedding.hpp"
#include "modules/loss/lm_head.hpp"
#include "modules/model/block.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

// Which part of the model a stage holds.
struct StagePlan {
  int first_block = 0, last_block = -1;  // blocks [first, last); last < 0: to the end
  bool embed = true, head = true;        // embedding here (first stage), head and loss here
  static StagePlan whole() { return StagePlan(); }
  // The blocks, embedding and head of the grid's pipeline stage of this rank.
  static StagePlan of(const ProcessGrid& grid) {
    StagePlan p;
    p.first_block = grid.first_block(grid.pp_rank);
    p.last_block = grid.first_block(grid.pp_rank + 1);
    p.embed = grid.first_stage();
    p.head = grid.last_stage();
    return p;
  }
};

// What generation keeps of one sequence on a stage: every block's cache (Block::new_cache).
struct DecodeCache {
  std::vector<BlockCache> blocks;
};

class Stage {
 public:
  // Declares every tensor of its blocks into `table` (plus embedding and head); buffers are
  // sized for micro-batches of up to max_seqs sequences of seq_len tokens. A last stage without
  // the embedding but with tied embeddings declares a tied copy of embed.weight for the head.
  // With `stats`, it declares the statistics columns of every block of the model (all
  // stages, so that every rank has the same columns) and its own blocks add into them.
  // Its layers compute as ctx says (precision, host threads). Instances built on one context's
  // pool share their blocks' workspace (BlockScratch); without one the stage has its own. When
  // the pool's blocks share (train.recompute = block) the blocks take their saved buffers from
  // it too, shared with every block of every instance built on it, keep only their inputs (the
  // residual streams), and backward() runs each block's forward again just before its
  // backward, counting no statistics the second time.
  Stage(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e, int max_seqs, int seq_len,
        TensorTable& table, const EngramCfg& g = EngramCfg(),
        const StagePlan& plan = StagePlan::whole(), const LayerComms& comms = LayerComms(),
        StepStats* stats = nullptr);

  // The workspace bytes reserved for the calls of a stage holding `plan`'s blocks (and head)
  // for max_seqs sequences, with an ep group of `ep` ranks, in ctx's precision (bf16 or fp32
  // kept operands) and host threads.
  static std::int64_t workspace_bytes(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e,
                                      const EngramCfg& g, const StagePlan& plan, int max_seqs,
                                      int seq_len, int ep);

  // The (N, D) buffer a stage without the embedding receives its input into before forward().
  float* input_buffer() { return resid_[0].data(); }
  // The (N, D) output of the last forward() (the next stage's input).
  const float* output() const { return resid_.back().data(); }
  // The (N, D) buffer a stage without the head receives d loss / d output into before
  // backward().
  float* output_grad_buffer() { return d_y_.data(); }

  // tokens: host ids of nseq <= max_seqs sequences (nseq * T); every stage reads them (Engram
  // hashes them, the head needs the targets). grad_scale > 0 prepares backward() for this
  // micro-batch's loss with weight grad_scale * targets in the step loss (CE gradients scaled by
  // grad_scale, MoE auxiliary losses by grad_scale * targets). The CE and z sums are those of
  // the head (0 on a stage without it), and the MoE terms those of this stage's MoE blocks; or,
  // given `loss_sums` (3 doubles on the device: CE, z, MoE terms), added there instead
  // (LmHead::forward) and nothing is read to the host. With grad_scale > 0 the head's matrix
  // gets its gradient here already (the head's loss runs in chunks, each chunk's products at
  // once); the rest comes in backward().
  LossSums forward(const TensorTable& table, const std::int32_t* tokens, int nseq, float grad_scale,
                   View1D loss_sums = View1D());
  // Accumulates parameter gradients of the last forward()'s micro-batch; returns d loss / d
  // input (N, D) for the previous stage (null on a stage with the embedding). `ready(k)`, when
  // given, hears as backward goes that every tensor with table index >= k is done (the
  // gradient buckets of the step's last backward start on it).
  const float* backward(TensorTable& table, const std::function<void(int)>& ready = nullptr);

  // Incremental decoding of one sequence (generation; kmoe-generate): positions [pos, pos + n)
  // with host ids `ids` (n of them), the earlier positions given to earlier calls on `cache`;
  // a stage without the embedding finds their (n, D) input rows in input_buffer(). The rows
  // go through the stage's blocks (output() holds them for the next stage); the last stage
  // returns their (n, V) logits, valid until its next call (an empty matrix elsewhere). The
  // stage must be built with max_seqs = 1 and seq_len >= every position decoded.
  ConstMat decode(const TensorTable& table, const std::int32_t* ids, int pos, int n,
                  DecodeCache& cache);
  // A cache for positions [0, max_seqs * seq_len).
  DecodeCache new_decode_cache() const;
  // From now on a forward() with grad_scale 0 keeps its (N, V) logits, for last_logits().
  void keep_logits();
  // The (N, V) logits of the last forward() (a stage with the head, keep_logits(), grad_scale 0).
  ConstMat last_logits() const;

  bool has_moe() const;
  // Each MoE block's routing of the last forward(): (block index, (N*k) expert ids).
  std::vector<std::pair<int, ConstIVec>> moe_routes() const;

  // Step hooks, called on one instance per step (the instances share parameters and
  // statistics). The step starts with StepStats::begin_step(). finish_step: the statistics that
  // need the stage's replicas (Engram rows touched), on the device before the statistics are
  // gathered; collective over grid.stage's data plane. after_optimizer_step: updates that follow AdamW (MoE router biases from the
  // step's global expert counts).
  void finish_step(StepStats& stats, const ProcessGrid& grid) const;
  void after_optimizer_step(TensorTable& table, const StepStats& stats) const;
  int top_k() const { return top_k_; }
  int d_model() const { return D_; }

 private:
  // engram.offload = host: the host computes and stages every Engram block's rows.
  void prefetch_engram_rows(const TensorTable& table, const std::int32_t* tokens, int nseq);
  std::vector<std::int32_t> host_compressed_;  // (N) compressed ids of the micro-batch
  std::vector<int> host_starts_;               // (N) their document starts
  Mat resid(int i, int N) { return as_mat(resid_[i].data(), N, D_); }
  // The ids Engram reads (compressed when a compression map is given) of the last forward.
  ConstIVec engram_tokens(int N) const {
    return compress_.extent(0) > 0 ? ConstIVec(compressed_.data(), N)
                                   : ConstIVec(tokens_.data(), N);
  }

  // The document starts of the last forward's rows (train.document_mask), else none; with the
  // attention's tile plan for the nseq sequences of a forward (not for decoding).
  DocStarts docs(int N) const {
    return doc_start_.extent(0) > 0 ? DocStarts{ConstIVec(doc_start_.data(), N)} : DocStarts();
  }
  DocStarts planned_docs(int nseq) const {
    DocStarts d = docs(nseq * T_);
    if (!d.empty()) {
      d.tile_start = tile_start_.data();
      d.tile_rows = kAttentionPlanRows;
      d.tiles = static_cast<int>(tile_start_.size()) / nseq;
    }
    return d;
  }

  ModelCfg model_;
  int D_, T_, max_seqs_, first_;
  bool has_embed_, has_head_;
  RopeTables rope_;
  EngramCompression compression_;  // before blocks_: their Engram plans depend on it
  std::unique_ptr<Embedding> embed_;
  int embed_weight_ = -1;  // embed.weight (here or its tied copy), -1 if neither
  std::vector<std::unique_ptr<Block>> blocks_;
  std::unique_ptr<LmHead> head_;
  // The blocks' workspace: the pool's, which every instance shares (instances never run at the
  // same time), or without a pool this instance's own.
  std::shared_ptr<BlockScratch> scratch_;
  View1I tokens_;                 // (max_seqs * T) device copy of the ids
  View1I compress_, compressed_;  // Engram: (V) canonical ids, (max_seqs * T) compressed ids
  View1I doc_start_;              // (max_seqs * T) train.document_mask: each row's document start
  std::vector<int> tile_start_;   // the same on the host at each attention tile's first row
  std::vector<View1F> resid_;     // blocks+1 residual streams (N, D): block inputs and output
  View1F d_x_, d_y_;              // (N, D) backward ping-pong
  bool recompute_ = false;
  View1F recomputed_;  // (N, D) recompute: a block's output again (discarded; shared)
  int nseq_ = 0;
  float aux_scale_ = 0.0f;
  int top_k_;
};

// Every tensor of cfg's model with its global shape, in model order (embedding, blocks, head):
// the tensors a whole-model Stage on one rank declares, built with the smallest buffers and
// nothing allocated (export and import list a model's tensors with it, on a login node too).
std::vector<TensorSpec> model_tensors(const Config& cfg);

}  // namespace kmoe
