// Final RMSNorm, LM head and the loss of MODEL.md section 2: cross-entropy over the positions
// that have a target (t < T-1) plus the optional output z-loss, with the gradient of
// logits written in place by the same fused kernel.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.hpp"
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
  LmHead(const RunContext& ctx, const ModelCfg& m, int max_tokens, int embed_weight,
         TensorTable& table);

  // x: (N, D) final residual stream, tokens: (N) ids of the nseq = N/T sequences.
  // grad_scale > 0: also leaves d(loss * grad_scale / targets)/d logits for backward().
  // With `accumulate` (2 doubles on the device) the CE and z sums are added there and not read
  // back (the training step reads them once; the returned ce, z and seq_ce stay empty);
  // without it they are read back and returned.
  LossSums forward(const TensorTable& table, ConstMat x, ConstIVec tokens, int seq_len,
                   float grad_scale, View1D accumulate = View1D());
  // The logits alone (generation): x: (n, D) -> the (n, V) logits, in a buffer of the head
  // valid until its next call.
  ConstMat logits(const TensorTable& table, ConstMat x);
  // The (N, V) logits of the last forward() with grad_scale 0 (with a gradient asked for, the
  // buffer holds the gradient instead).
  ConstMat last_logits(int N) const { return ConstMat(logits_.data(), N, V_); }
  // dx: (N, D) gradient w.r.t. the final residual stream (assigned); the normed input's
  // gradient (N, D) passes through `ws`.
  void backward(TensorTable& table, ConstMat x, Mat dx, Workspace& ws);
  static std::int64_t workspace_bytes(std::int64_t max_tokens, int d_model) {
    return Workspace::rounded(4 * max_tokens * d_model);
  }
  // The lowest table index of the tensors the head declared (final_norm.weight).
  int first_tensor() const { return norm_; }

 private:
  RunContext ctx_;  // the precision of its products
  int V_, D_;
  float eps_, z_coef_;
  int norm_, weight_;
  View1F normed_;          // (N, D)
  View1F rstd_;            // (N)
  View1F logits_;          // (N, V), then its gradient
  View1F row_ce_, row_z_;  // (N)
  View1D seq_sums_;  // (2 * max_tokens): CE and z sums per sequence, then per chunk of each
  static constexpr int kSumChunk = 64;  // positions summed by one thread
};

}  // namespace kmoe
