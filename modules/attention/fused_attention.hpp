// The fused attention core (attention_core.hpp's contract), in Kokkos for every backend: the
// FlashAttention-2 recurrence. Forward: one team per (sequence, head, query block of B rows)
// streams the key and value blocks its rows can see through team scratch, keeping a running max
// and sum per row (online softmax), and writes the heads and each row's log-sum-exp; no score
// matrix is in device memory and the launches per layer do not depend on T. Backward recomputes
// the probabilities block by block from the log-sum-exp: one kernel over (sequence, kv head, key
// block) sums dK and dV over the kv head's query heads and the query blocks that see the keys,
// one over (sequence, head, query block) sums dQ over the key blocks; each sum runs in a fixed
// order (no atomics: results do not depend on the scheduling).
//
// bf16 runs (MODEL.md section 8): q, k, v come rounded (kept as bf16); the products' other
// operands are rounded where they are formed, as a GEMM would round them and where the tiled
// core and the reference round them: the normalized probabilities before P v (a first sweep
// over the keys makes each row's max and sum, a second P = exp(S - lse): twice the forward's
// score products), dO, and P and dS before dV, dK and dQ (dS from R(P)); every sum in fp32. fp32
// runs sweep the keys once, rescaling the output rows as the running max grows. (A flash kernel on
// a GPU, cuDNN's, rounds the unnormalized probabilities of its one sweep instead: within bf16's
// tolerance of these.)
#pragma once

#include <cstdint>

#include "modules/attention/attention_core.hpp"

namespace kmoe {

class FusedAttention : public AttentionCore {
 public:
  FusedAttention(const RunContext& ctx, const AttentionDims& dims);

  const char* name() const override { return "fused"; }
  void forward(const AttentionInputs& in, int nseq, const DocStarts& docs, float* heads,
               Workspace& ws) override;
  void backward(const AttentionInputs& in, int nseq, float* d_heads, const std::uint16_t* d_heads16,
                float* d_k, float* d_v, Workspace& ws) override;
  // Its scores live in team scratch only.
  std::int64_t scores_computed() const override { return 0; }

  // Saved: the heads (q's layout, fp32 in every run: D = rowsum(dO * O) reads them, and the
  // unrounded O makes D the sum over the keys of R(P) dP that the tiled core forms) and the
  // log-sum-exp of each row (fp32). No workspace.
  static AttentionCoreSizes sizes(const AttentionDims& dims, bool bf16);
  // The rows of a query or key block: the largest power of two up to 64 whose three kernels'
  // team scratch fits the backend's budget (48 KiB on GPUs, the shared memory every vendor
  // gives a block by default, and with device paths; 1 MiB on host backends).
  static int block_rows(int dh);

 private:
  RunContext ctx_;
  AttentionDims dims_;
  int block_;
  DocStarts docs_;   // the last forward's
  KeptOperand out_;  // (max_seqs, Hkv, T, G, dh): the heads, fp32
  View1F lse_;       // (max_seqs, H, T)
};

}  // namespace kmoe
