// Final RMSNorm, LM head and the loss of MODEL.md section 2: cross-entropy over the positions
// that have a target (t < T-1) plus the optional output z-loss.
//
// The head runs in chunks of rows (a chunked, or fused linear, cross-entropy): per chunk the
// norm, the logits product, one kernel for the loss terms and d logits, and, when a gradient is
// asked for, at once the two products that take d logits (the head matrix's gradient and
// d normed). The (N, V) logits are never whole in memory; the chunk's logits, its d logits
// (bf16 runs: written as bf16 by the loss kernel, the copy both products read) and its normed
// rows are workspace. What backward() keeps is d normed (N, D) and the norm's rstd.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/run_context.hpp"
#include "core/tensor_table.hpp"
#include "core/workspace.hpp"

namespace kmoe {

// Sums over one micro-batch; per-sequence CE sums in sequence order (evaluation sums them
// per instance in instance order).
struct LossSums {
  std::vector<double> seq_ce;  // (nseq) sum of -log p(target) over the T-1 targets
  double ce = 0.0;             // sum of seq_ce
  double z = 0.0;              // sum of logsumexp^2 over the same positions
  std::int64_t targets = 0;    // nseq * (T-1)
  // Sum over the stage's MoE layers of lb_coef * LB + z_coef * RZ (MODEL.md section 2), in
  // block order (filled by the stage).
  double moe_aux = 0.0;
};

class LmHead {
 public:
  // Declares final_norm.weight and, unless tied, lm_head.weight [V, D]; `embed_weight` is the
  // tied matrix otherwise.
  // chunk_rows: rows per chunk, 0 for chunk_rows(max_tokens, V).
  LmHead(const RunContext& ctx, const ModelCfg& m, int max_tokens, int embed_weight,
         TensorTable& table, int chunk_rows = 0);

  // x: (N, D) final residual stream, tokens: (N) ids of the nseq = N/T sequences; the chunks'
  // buffers come from `ws`. grad_scale > 0: the gradient of loss * grad_scale / targets, the
  // head matrix's accumulated into its grad here, the rest left for backward().
  // With `accumulate` (2 doubles on the device) the CE and z sums are added there and not read
  // back (the training step reads them once; the returned ce, z and seq_ce stay empty);
  // without it they are read back and returned.
  LossSums forward(const TensorTable& table, ConstMat x, ConstIVec tokens, int seq_len,
                   float grad_scale, Workspace& ws, View1D accumulate = View1D());
  // The logits alone (generation): x: (n, D) -> the (n, V) logits, in a buffer of the head
  // valid until its next call.
  ConstMat logits(const TensorTable& table, ConstMat x);
  // From now on forward() without a gradient also keeps all its (N, V) logits, for
  // last_logits() (generation's check of its incremental logits).
  void keep_logits() { keep_logits_ = true; }
  ConstMat last_logits(int N) const;
  // dx: (N, D) gradient w.r.t. the final residual stream (assigned), from the d normed of the
  // last forward() with a gradient; the final norm's gain gradient accumulates. dx16 (bf16
  // runs): where dx is also written rounded, or nullptr.
  void backward(TensorTable& table, ConstMat x, Mat dx, std::uint16_t* dx16 = nullptr);
  // Rows per chunk: the chunk's fp32 logits at most kChunkElements values (at least 64 rows,
  // a multiple of 64), all rows when that is fewer.
  static int chunk_rows(std::int64_t max_tokens, int vocab);
  static constexpr std::int64_t kChunkElements = std::int64_t(1) << 25;
  // The workspace forward() takes (its chunk's buffers, in ctx's precision).
  static std::int64_t workspace_bytes(const RunContext& ctx, const ModelCfg& m,
                                      std::int64_t max_tokens);
  // The lowest table index of the tensors the head declared (final_norm.weight).
  int first_tensor() const { return norm_; }

  // The loss terms of chunk rows [r0, r0 + n) (row_ce_, row_z_) and, with grad_scale > 0, their
  // gradient w.r.t. the chunk's (n, V) logits through `grad`. Public only because a function
  // that launches a device lambda may not be private under nvcc; forward() is the interface.
  void softmax_xent(Mat logits, ConstIVec tokens, int r0, int T, float grad_scale,
                    KeptOut grad) const;

 private:
  RunContext ctx_;  // the precision of its products
  int V_, D_;
  float eps_, z_coef_;
  int norm_, weight_;
  int chunk_;
  bool keep_logits_ = false;
  View1F d_normed_;        // (N, D): the gradient w.r.t. the normed input, for backward()
  View1F rstd_;            // (N)
  View1F logits_, normed_;  // generation and keep_logits(): (n, V) and (n, D), grown to fit
  View1F row_ce_, row_z_;  // (N)
  View1D seq_sums_;  // (2 * max_tokens): CE and z sums per sequence, then per chunk of each
  static constexpr int kSumChunk = 64;  // positions summed by one thread
};

}  // namespace kmoe
